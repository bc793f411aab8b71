"""The transport contract, checked against the in-process fake and the real TCP transport alike."""

from __future__ import annotations

import dataclasses
import gc
import weakref
from collections.abc import Iterator
from dataclasses import dataclass

import pytest
import torch

from pdrouter.core.errors import CancelledError, DeadlineExceededError, IncompatibleError, StaleEpochError
from pdrouter.transfer import (
    KvReceiver,
    KvSender,
    LocalFabric,
    LocalReceiver,
    ProtocolError,
    TransferReceiver,
    TransferSender,
    TransferState,
    UnknownTransferError,
)

from .factories import blocks_equal, make_config, make_layout, make_pool

LAYOUT = make_layout("bfloat16", num_layers=3)


@dataclass
class Endpoints:
    receiver: TransferReceiver
    sender: TransferSender
    src: torch.Tensor
    dst: torch.Tensor


@pytest.fixture(params=["local", "tcp"])
def endpoints(request: pytest.FixtureRequest) -> Iterator[Endpoints]:
    src, dst = make_pool(LAYOUT, 1), make_pool(LAYOUT, None)
    receiver: TransferReceiver
    sender: TransferSender
    if request.param == "local":
        fabric = LocalFabric()
        receiver = fabric.receiver(dst, LAYOUT, epoch=10)
        sender = fabric.sender(src, LAYOUT, epoch=20)
    else:
        receiver = KvReceiver(dst, LAYOUT, make_config(epoch=10))
        sender = KvSender(src, LAYOUT, make_config(epoch=20))
    yield Endpoints(receiver, sender, src, dst)
    sender.close()
    receiver.close()


def test_blocks_land_layer_by_layer(endpoints: Endpoints) -> None:
    e = endpoints
    handle = e.receiver.expect("req-1", [8, 9, 10, 11], skip_blocks=1, sender_epoch=20, timeout_s=30)
    transfer = e.sender.open_transfer(handle.target)
    transfer.send_layers([0, 1, 2, 3], 0)
    handle.wait_layer(0, 30)
    assert handle.state is TransferState.TRANSFERRING
    transfer.send_layers([0, 1, 2, 3], range(1, 3))
    transfer.finish(30)
    handle.wait_all(30)
    assert blocks_equal(e.src, [1, 2, 3], e.dst, [9, 10, 11])
    assert not e.dst[:, :, 8].view(torch.uint8).any()  # cached on the decode side: not sent
    assert (handle.state, transfer.state) == (TransferState.DONE, TransferState.DONE)


def test_abort_from_either_side(endpoints: Endpoints) -> None:
    e = endpoints
    first = e.receiver.expect("req-1", [1], timeout_s=30)
    out = e.sender.open_transfer(first.target)
    out.send_layers([2], 0)
    first.abort("decode gave up")
    with pytest.raises(CancelledError, match="decode gave up"):  # from whichever call learns it first
        out.send_layers([2], range(1, 3))
        out.finish(30)
    second = e.receiver.expect("req-2", [3], timeout_s=30)
    out = e.sender.open_transfer(second.target)
    out.send_layers([2], 0)
    out.abort("prefill gave up")
    with pytest.raises(CancelledError, match="prefill gave up"):
        second.wait_all(30)


def test_deadline(endpoints: Endpoints) -> None:
    handle = endpoints.receiver.expect("req-1", [1], timeout_s=0.2)
    with pytest.raises(DeadlineExceededError):
        handle.wait_all(30)


def test_a_finished_transfer_is_not_kept_until_its_deadline(endpoints: Endpoints) -> None:
    """A transfer that ends long before its deadline gives the deadline back at once: a busy
    receiver with long timeouts must not hold every finished transfer until then."""
    e = endpoints

    def deadlines() -> int:
        r = e.receiver
        return r.book.deadlines() if isinstance(r, LocalReceiver) else r.stats().deadlines  # type: ignore[attr-defined]

    finished: list[weakref.ref[object]] = []
    for i in range(20):
        handle = e.receiver.expect(f"req-{i}", [1 + i % 4], timeout_s=600)
        assert deadlines() == 1
        out = e.sender.open_transfer(handle.target)
        out.send_layers([2], range(0, 3))
        out.finish(30)
        handle.wait_all(30)
        finished.append(weakref.ref(handle))
        del handle, out
    assert deadlines() == 0
    gc.collect()
    assert sum(ref() is not None for ref in finished) <= 1  # the sender side may still hold the last


def test_refusals(endpoints: Endpoints) -> None:
    e = endpoints
    handle = e.receiver.expect("req-1", [1, 2], sender_epoch=99, timeout_s=30)
    stale = e.sender.open_transfer(handle.target)
    with pytest.raises(StaleEpochError):  # errors surface from whichever call learns them first
        stale.send_layers([3, 4])
        stale.finish(30)
    with pytest.raises(StaleEpochError):
        handle.wait_all(30)
    handle = e.receiver.expect("req-2", [1, 2], timeout_s=30)
    with pytest.raises(StaleEpochError):
        e.sender.open_transfer(dataclasses.replace(handle.target, epoch=handle.target.epoch - 1))
    with pytest.raises(IncompatibleError):
        e.sender.open_transfer(dataclasses.replace(handle.target, compat_hash="f" * 16))
    with pytest.raises(IncompatibleError):
        handle.wait_all(30)
    forged = e.sender.open_transfer(dataclasses.replace(
        e.receiver.expect("req-3", [5], timeout_s=30).target, dst_block_ids=(6,)))
    with pytest.raises(ProtocolError):
        forged.send_layers([7])
        forged.finish(30)
    ghost = e.sender.open_transfer(dataclasses.replace(handle.target, transfer_id="nobody"))
    with pytest.raises(UnknownTransferError):
        ghost.send_layers([3, 4])
        ghost.finish(30)
    assert not e.dst.view(-1).view(torch.uint8).any()
