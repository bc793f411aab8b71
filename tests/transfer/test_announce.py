"""``OutgoingTransfer.announce``: a transfer's BEGIN sent before any layer is ready (real sockets, one
process). The receiver checks the target and binds the transfer at once; the layers that follow land
as they would have; and an announce that comes too late, or twice, changes nothing."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import pytest

from pdrouter.core.errors import PdRouterError
from pdrouter.transfer import TransferState
from pdrouter.transfer.integrity import MacKey
from pdrouter.transfer.sender_connection import SenderConnection

from .factories import Pair, blocks_equal, make_layout, wait_until


@pytest.fixture
def writes(monkeypatch: pytest.MonkeyPatch) -> list[list[str]]:
    """The kinds of the messages of each group written, in order."""
    seen: list[list[str]] = []
    write = SenderConnection._write_items

    def spy(self: SenderConnection, items: Any) -> None:
        seen.append([type(item).__name__ for item in items])
        write(self, items)

    monkeypatch.setattr(SenderConnection, "_write_items", spy)
    return seen


@pytest.mark.parametrize("from_thread", [False, True], ids=["caller", "other-thread"])
def test_an_announced_transfer_is_bound_before_its_first_layer(make_pair: Callable[..., Pair],
                                                               writes: list[list[str]], from_thread: bool) -> None:
    pair = make_pair()
    pair.sender.connect(pair.receiver.address)
    handle = pair.receiver.expect("t-1", [3, 4], timeout_s=30)
    transfer = pair.sender.open_transfer(handle.target)
    assert handle.state is TransferState.WAITING
    if from_thread:
        runner = threading.Thread(target=transfer.announce)
        runner.start()
        runner.join(10)
    else:
        transfer.announce()
    assert wait_until(lambda: handle.state is TransferState.TRANSFERRING), handle.state  # bound, nothing sent yet
    assert writes[0] == ["BeginItem"]
    transfer.announce()  # a second time: nothing more is written
    transfer.send_layers([1, 2])
    transfer.announce()  # after a layer: nothing either
    transfer.finish(30)
    handle.wait_all(30)
    assert transfer.state is TransferState.DONE
    assert blocks_equal(pair.src, [1, 2], pair.dst, [3, 4])
    assert all("BeginItem" not in group for group in writes[1:]), writes
    pair.assert_released()


def test_without_an_announce_the_begin_leaves_with_the_first_frame(make_pair: Callable[..., Pair],
                                                                   writes: list[list[str]]) -> None:
    pair = make_pair()
    pair.sender.connect(pair.receiver.address)
    handle = pair.receiver.expect("t-1", [3, 4], timeout_s=30)
    transfer = pair.sender.open_transfer(handle.target)
    transfer.send_layers([1, 2])
    transfer.finish(30)
    handle.wait_all(30)
    assert writes[0][:2] == ["BeginItem", "DataItem"]
    pair.assert_released()


def test_an_announce_the_receiver_refuses_fails_the_transfer_before_any_layer(make_pair: Callable[..., Pair]) -> None:
    """The expectation was withdrawn: the announce brings the receiver's refusal back while the
    sender still has nothing to send; its first layer then raises it, and nothing is written."""
    pair = make_pair()
    pair.sender.connect(pair.receiver.address)
    handle = pair.receiver.expect("t-1", [3, 4], timeout_s=30)
    transfer = pair.sender.open_transfer(handle.target)
    handle.abort("the decode request ended")
    before = pair.dst.clone()
    transfer.announce()
    assert wait_until(lambda: transfer.state is TransferState.FAILED), transfer.state
    with pytest.raises(PdRouterError):
        transfer.send_layers([1, 2])
    assert blocks_equal(before, [3, 4], pair.dst, [3, 4])  # the destination blocks were never written
    pair.assert_released()


def test_an_aborted_announced_transfer_fails_its_bound_expectation(make_pair: Callable[..., Pair]) -> None:
    pair = make_pair()
    pair.sender.connect(pair.receiver.address)
    handle = pair.receiver.expect("t-1", [3, 4], timeout_s=30)
    transfer = pair.sender.open_transfer(handle.target)
    transfer.announce()
    assert wait_until(lambda: handle.state is TransferState.TRANSFERRING)
    transfer.abort("the prompt was not computed")
    assert wait_until(lambda: handle.state is TransferState.FAILED), handle.state
    assert handle.error is not None and "the prompt was not computed" in handle.error.message
    pair.assert_released()


def test_an_announced_large_transfer_finds_its_sender_mac_context_made(make_pair: Callable[..., Pair],
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """Announcing a transfer whose payload needs a running MAC context makes the sender's context
    for its first frame with the BEGIN, off the path of the frame itself (and the bytes still land
    bit for bit)."""
    taken: list[tuple[str, bool]] = []
    context = MacKey._context

    def spy(self: MacKey, seq: int) -> object:
        taken.append((threading.current_thread().name, self._spare is not None and self._spare[0] == seq))
        return context(self, seq)

    monkeypatch.setattr(MacKey, "_context", spy)
    pair = make_pair(make_layout(num_layers=8, num_blocks=16, block_size=16, head_dim=64))  # 512 KiB a 4 blocks
    pair.sender.connect(pair.receiver.address)
    handle = pair.receiver.expect("t-1", [3, 4, 5, 6], timeout_s=30)
    transfer = pair.sender.open_transfer(handle.target)
    transfer.announce()
    transfer.send_layers([8, 9, 10, 11])
    transfer.finish(30)
    handle.wait_all(30)
    assert blocks_equal(pair.src, [8, 9, 10, 11], pair.dst, [3, 4, 5, 6])
    me = threading.current_thread().name
    assert (me, True) in taken, taken  # this thread wrote the frame with the context made at the announce
    pair.assert_released()


def test_a_transfer_opened_early_sends_nothing_until_fed(make_pair: Callable[..., Pair],
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """A transfer opened ahead of its layers (its prompt still computing) writes nothing, not even
    when the connection carries another transfer meanwhile, and leaves that transfer's caller
    writing it itself; its own BEGIN then leaves with its first frame."""
    seen: list[tuple[str, str, list[str]]] = []
    write = SenderConnection._write_items

    def spy(self: SenderConnection, items: Any) -> None:
        seen.append((threading.current_thread().name, items[0].transfer.transfer_id,
                     [type(item).__name__ for item in items]))
        write(self, items)

    monkeypatch.setattr(SenderConnection, "_write_items", spy)
    pair = make_pair()
    pair.sender.connect(pair.receiver.address)
    early_handle = pair.receiver.expect("early", [5, 6], timeout_s=30)
    early = pair.sender.open_transfer(early_handle.target)
    other_handle = pair.receiver.expect("other", [3, 4], timeout_s=30)
    other = pair.sender.open_transfer(other_handle.target)
    other.send_layers([1, 2])
    other.finish(30)
    other_handle.wait_all(30)
    me = threading.current_thread().name
    assert seen and all(tid == "other" and name == me for name, tid, _ in seen), seen
    assert early_handle.state is TransferState.WAITING  # the receiver has not heard of it
    early.send_layers([7, 8])
    early.finish(30)
    early_handle.wait_all(30)
    assert next(kinds[:2] for _, tid, kinds in seen if tid == "early") == ["BeginItem", "DataItem"]
    assert blocks_equal(pair.src, [1, 2], pair.dst, [3, 4]) and blocks_equal(pair.src, [7, 8], pair.dst, [5, 6])
    pair.assert_released()
