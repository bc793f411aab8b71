"""A thread that waits for its transfer's confirmation (``finish``) writes the transfer itself when
the connection is idle, and leaves it to the writer thread otherwise (real sockets, one process)."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import pytest

from pdrouter.transfer import TransferState
from pdrouter.transfer.integrity import MacKey
from pdrouter.transfer.sender_connection import SenderConnection

from .factories import Pair, blocks_equal, make_layout


@pytest.fixture
def writers(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The name of the thread that wrote each group of messages."""
    seen: list[str] = []
    write = SenderConnection._write_items

    def spy(self: SenderConnection, items: Any) -> None:
        seen.append(threading.current_thread().name)
        write(self, items)

    monkeypatch.setattr(SenderConnection, "_write_items", spy)
    return seen


def test_an_idle_connection_is_written_by_the_waiting_caller(make_pair: Callable[..., Pair],
                                                            writers: list[str]) -> None:
    pair = make_pair()
    pair.sender.connect(pair.receiver.address)
    for i in range(5):
        handle = pair.receiver.expect(f"t-{i}", [3, 4], timeout_s=30)
        transfer = pair.sender.open_transfer(handle.target)
        transfer.send_layers([1, 2])
        # the writer thread may wake for the BEGIN before this thread gets here; what is left
        # (the DATA and END at least) is written by the caller
        transfer.finish(30)
        handle.wait_all(30)
        assert transfer.state is TransferState.DONE
        assert blocks_equal(pair.src, [1, 2], pair.dst, [3, 4])
    assert threading.current_thread().name in writers
    pair.assert_released()


def test_beside_another_transfer_the_writer_thread_writes(make_pair: Callable[..., Pair],
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """While the writer thread writes one transfer, the caller of another leaves its own to it too
    (the connection is shared: it waits its turn)."""
    writers: list[tuple[str, str]] = []
    holding = threading.Event()
    release = threading.Event()
    write = SenderConnection._write_items

    def spy(self: SenderConnection, items: Any) -> None:
        tid = items[0].transfer.transfer_id
        writers.append((threading.current_thread().name, tid))
        if tid == "first" and not holding.is_set():
            holding.set()
            assert release.wait(10)  # the writer thread is busy with the first transfer
        write(self, items)

    monkeypatch.setattr(SenderConnection, "_write_items", spy)
    pair = make_pair()
    pair.sender.connect(pair.receiver.address)
    first = pair.receiver.expect("first", [3], timeout_s=30)
    second = pair.receiver.expect("second", [4], timeout_s=30)
    a = pair.sender.open_transfer(first.target)
    b = pair.sender.open_transfer(second.target)
    a.send_layers([1], range(0, pair.layout.num_layers - 1))  # not its last layers: the writer thread sends them
    assert holding.wait(10)
    b.send_layers([2])  # the connection is being written: b is left to the writer thread
    release.set()
    b.finish(30)
    a.send_layers([1], pair.layout.num_layers - 1)
    a.finish(30)
    first.wait_all(30)
    second.wait_all(30)
    assert writers[0][1] == "first" and writers[0][0].startswith("kvt-send")
    assert [name for name, tid in writers if tid == "second"] and \
        all(name.startswith("kvt-send") for name, tid in writers if tid == "second"), writers
    assert blocks_equal(pair.src, [1, 2], pair.dst, [3, 4])
    pair.assert_released()


def test_the_next_large_payload_finds_its_mac_context_made(make_pair: Callable[..., Pair],
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """Once a connection has carried a large payload, the receiver makes the next one's running MAC
    context while it waits; that transfer then takes it (and still lands bit for bit)."""
    taken: list[bool] = []
    context = MacKey._context

    def spy(self: MacKey, seq: int) -> object:
        taken.append(self._spare is not None and self._spare[0] == seq)
        return context(self, seq)

    monkeypatch.setattr(MacKey, "_context", spy)
    pair = make_pair(make_layout(num_layers=8, num_blocks=16, block_size=16, head_dim=64))
    pair.sender.connect(pair.receiver.address)
    for i in range(3):
        handle = pair.receiver.expect(f"t-{i}", [3, 4, 5, 6], timeout_s=30)
        transfer = pair.sender.open_transfer(handle.target)
        transfer.send_layers([8, 9, 10, 11])
        transfer.finish(30)
        handle.wait_all(30)
        assert blocks_equal(pair.src, [8, 9, 10, 11], pair.dst, [3, 4, 5, 6])
    assert True in taken  # the receiver's side of the later transfers
    pair.assert_released()
