"""Every fault ends with a clear error on both sides and nothing left held on either side."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Iterator

import pytest
import torch

from pdrouter.core.errors import CancelledError, DeadlineExceededError, IncompatibleError, StaleEpochError
from pdrouter.transfer import (
    AuthError,
    Backend,
    ChecksumError,
    KvReceiver,
    KvSender,
    PeerLostError,
    ProtocolError,
    TransferState,
    UnknownTransferError,
)

from .factories import FaultyProxy, Pair, make_config, make_layout, make_pool, wait_until

BIG_LAYOUT = make_layout(num_layers=4, num_blocks=32, block_size=16, num_kv_heads=2, head_dim=32)
"""8 KiB per block and layer (K and V): with 8 blocks and one frame per layer, frames are 64 KiB."""


@pytest.fixture
def proxies() -> Iterator[list[FaultyProxy]]:
    made: list[FaultyProxy] = []
    yield made
    for proxy in made:
        proxy.close()


def through(proxy: FaultyProxy, target: object) -> object:
    return dataclasses.replace(target, peer=proxy.address)  # type: ignore[type-var]


def frame_per_layer_pair(make_pair: Callable[..., Pair]) -> Pair:
    pair = make_pair(BIG_LAYOUT)
    pair.sender.close()
    pair.sender = KvSender(pair.src, BIG_LAYOUT, make_config(max_frame_bytes=64 << 10))  # one layer a frame
    return pair


def send_all(pair: Pair, target: object, src: list[int]) -> object:
    transfer = pair.sender.open_transfer(target)  # type: ignore[arg-type]
    for layer in range(pair.layout.num_layers):
        transfer.send_layers(src, layer)
    return transfer


def test_corrupted_payload_fails_both_sides_with_checksum_error(make_pair: Callable[..., Pair],
                                                                proxies: list[FaultyProxy]) -> None:
    pair = frame_per_layer_pair(make_pair)
    proxies.append(proxy := FaultyProxy(pair.receiver.address, flip=(4, 5000)))  # inside the 2nd frame's payload
    handle = pair.receiver.expect("req-1", list(range(8)), timeout_s=30)
    transfer = send_all(pair, through(proxy, handle.target), list(range(8, 16)))
    with pytest.raises(ChecksumError, match="frame 1 payload failed its integrity check"):
        handle.wait_all(30)
    with pytest.raises(ChecksumError, match="integrity"):
        transfer.finish(30)  # type: ignore[attr-defined]
    assert proxy.fired.is_set()
    assert handle.layer_done(0) and not handle.layer_done(1)
    pair.assert_released()
    # the connection survives a payload error (the stream is still in step): the next transfer works
    again = pair.receiver.expect("req-2", [20], timeout_s=30)
    follow = pair.sender.open_transfer(through(proxy, again.target))  # type: ignore[arg-type]
    follow.send_layers([1])
    follow.finish(30)
    again.wait_all(30)


def test_corrupted_header_fails_the_connection_with_checksum_error(make_pair: Callable[..., Pair],
                                                                   proxies: list[FaultyProxy]) -> None:
    pair = frame_per_layer_pair(make_pair)
    proxies.append(proxy := FaultyProxy(pair.receiver.address, flip=(4, 40)))  # the 2nd DATA header's MAC
    handle = pair.receiver.expect("req-1", list(range(8)), timeout_s=30)
    transfer = send_all(pair, through(proxy, handle.target), list(range(8, 16)))
    with pytest.raises(ChecksumError, match="header MAC mismatch"):
        handle.wait_all(30)
    with pytest.raises(ChecksumError, match="header MAC mismatch"):
        transfer.finish(30)  # type: ignore[attr-defined]
    pair.assert_released()


def test_truncated_stream_fails_both_sides(make_pair: Callable[..., Pair], proxies: list[FaultyProxy]) -> None:
    pair = frame_per_layer_pair(make_pair)
    proxies.append(proxy := FaultyProxy(pair.receiver.address, cut=(3, 60_000)))
    handle = pair.receiver.expect("req-1", list(range(8)), timeout_s=30)
    transfer = send_all(pair, through(proxy, handle.target), list(range(8, 16)))
    with pytest.raises(PeerLostError, match="truncated"):
        handle.wait_all(30)
    with pytest.raises(PeerLostError):
        transfer.finish(30)  # type: ignore[attr-defined]
    pair.assert_released()


def test_a_hung_receiver_trips_the_progress_timeout_on_both_sides(proxies: list[FaultyProxy]) -> None:
    layout = make_layout(num_layers=8, num_blocks=64, block_size=16, num_kv_heads=2, head_dim=256)  # 32 MiB
    fast = {"progress_timeout_s": 1.0, "socket_buffer_bytes": 64 << 10}
    pair = Pair(layout, Backend.TCP)
    try:
        pair.receiver.close()
        pair.sender.close()
        pair.receiver = KvReceiver(pair.dst, layout, make_config(**fast))
        pair.sender = KvSender(pair.src, layout, make_config(**fast))
        proxies.append(proxy := FaultyProxy(pair.receiver.address, stall=(3, 100_000)))
        handle = pair.receiver.expect("req-1", list(range(64)), timeout_s=60)
        transfer = send_all(pair, through(proxy, handle.target), list(range(64)))
        with pytest.raises(PeerLostError, match="no progress"):
            handle.wait_all(60)
        # the sender's writes time out too, unless the receiver hanging up reaches it first
        with pytest.raises(PeerLostError, match=r"within the timeout|closed by peer"):
            transfer.finish(60)  # type: ignore[attr-defined]
        pair.assert_released()
    finally:
        pair.close()


def test_wrong_compat_hash_refuses_and_tells_the_receiver(make_pair: Callable[..., Pair]) -> None:
    pair = make_pair(make_layout(head_dim=8))
    other_layout = make_layout(head_dim=16)
    with KvSender(make_pool(other_layout), other_layout, make_config()) as sender:
        handle = pair.receiver.expect("req-1", [1, 2], timeout_s=30)
        with pytest.raises(IncompatibleError, match="KV layouts differ"):
            sender.open_transfer(handle.target)
        with pytest.raises(IncompatibleError, match="KV layouts differ"):
            handle.wait_all(30)
        assert sender.stats().transfers == 0
    # a forged hash in the target is caught the same way
    forged = pair.receiver.expect("req-2", [3], timeout_s=30)
    with pytest.raises(IncompatibleError):
        pair.sender.open_transfer(dataclasses.replace(forged.target, compat_hash="0" * 16))
    with pytest.raises(IncompatibleError):
        forged.wait_all(30)
    assert not pair.dst.view(-1).view(torch.uint8).any()
    pair.assert_released()


def test_wrong_auth_token_is_refused(make_pair: Callable[..., Pair]) -> None:
    pair = make_pair()
    with KvSender(pair.src, pair.layout, make_config(token="not-the-right-token-at-all")) as intruder:
        handle = pair.receiver.expect("req-1", [1], timeout_s=0.5)
        with pytest.raises(AuthError, match="auth token"):
            intruder.open_transfer(handle.target)
        assert intruder.stats().connections == 0
    # an unauthenticated peer cannot touch the expectation; it ends at its deadline
    with pytest.raises(DeadlineExceededError):
        handle.wait_all(30)
    assert not pair.dst.view(-1).view(torch.uint8).any()
    pair.assert_released()


def test_restarted_receiver_is_stale(make_pair: Callable[..., Pair]) -> None:
    pair = make_pair()
    handle = pair.receiver.expect("req-1", [1], timeout_s=30)
    pair.sender.connect(pair.receiver.address)
    port = int(pair.receiver.address.rsplit(":", 1)[1])
    pair.receiver.close()  # the decode worker restarts...
    with pytest.raises(CancelledError):
        handle.wait_all(1)
    pair.receiver = KvReceiver(pair.dst, pair.layout, make_config(), port=port)  # ...with a new epoch
    assert wait_until(lambda: pair.sender.stats().connections == 0)
    with pytest.raises(StaleEpochError, match="restarted"):
        pair.sender.open_transfer(handle.target)
    pair.assert_released()


def test_restarted_sender_is_stale(make_pair: Callable[..., Pair]) -> None:
    pair = make_pair()
    old_epoch = pair.sender.epoch
    pair.sender.close()
    pair.sender = KvSender(pair.src, pair.layout, make_config())  # the prefill worker restarted
    handle = pair.receiver.expect("req-1", [1], sender_epoch=old_epoch, timeout_s=30)
    transfer = pair.sender.open_transfer(handle.target)
    transfer.send_layers([2])
    with pytest.raises(StaleEpochError, match="sender restarted"):
        transfer.finish(30)
    with pytest.raises(StaleEpochError, match="sender restarted"):
        handle.wait_all(30)
    assert not pair.dst.view(-1).view(torch.uint8).any()
    pair.assert_released()


@pytest.mark.parametrize("backend", [Backend.TCP, Backend.GLOO])
def test_receiver_abort_mid_transfer(make_pair: Callable[..., Pair], backend: Backend) -> None:
    pair = make_pair(make_layout(num_layers=4), backend)
    handle = pair.receiver.expect("req-1", [1, 2], timeout_s=30)
    transfer = pair.sender.open_transfer(handle.target)
    transfer.send_layers([3, 4], 0)
    handle.wait_layer(0, 30)
    handle.abort("the client went away")
    assert handle.state is TransferState.FAILED
    with pytest.raises(CancelledError, match="client went away"):
        handle.wait_all(1)
    assert wait_until(lambda: transfer.state is TransferState.FAILED)
    with pytest.raises(CancelledError, match="client went away"):
        transfer.send_layers([3, 4], 1)
    with pytest.raises(CancelledError):
        transfer.finish(30)
    pair.assert_released()


@pytest.mark.parametrize("backend", [Backend.TCP, Backend.GLOO])
def test_sender_abort_mid_transfer(make_pair: Callable[..., Pair], backend: Backend) -> None:
    pair = make_pair(make_layout(num_layers=4), backend)
    handle = pair.receiver.expect("req-1", [1, 2], timeout_s=30)
    transfer = pair.sender.open_transfer(handle.target)
    transfer.send_layers([3, 4], range(0, 2))
    handle.wait_layer(1, 30)
    transfer.abort("prefill failed")
    with pytest.raises(CancelledError, match="prefill failed"):
        handle.wait_all(30)
    with pytest.raises(CancelledError):
        transfer.finish(1)
    pair.assert_released()


def test_abort_before_the_sender_shows_up(make_pair: Callable[..., Pair]) -> None:
    pair = make_pair()
    handle = pair.receiver.expect("req-1", [1], timeout_s=30)
    handle.abort("cancelled early")
    transfer = pair.sender.open_transfer(handle.target)
    transfer.send_layers([2])
    with pytest.raises(CancelledError, match="cancelled early"):
        transfer.finish(30)
    assert not pair.dst.view(-1).view(torch.uint8).any()
    pair.assert_released()


def test_deadline_mid_transfer_fails_both_sides(make_pair: Callable[..., Pair]) -> None:
    pair = make_pair(make_layout(num_layers=4))
    handle = pair.receiver.expect("req-1", [1, 2], timeout_s=0.5)
    transfer = pair.sender.open_transfer(handle.target)
    transfer.send_layers([3, 4], 0)  # ...and the rest never comes
    with pytest.raises(DeadlineExceededError, match="deadline"):
        handle.wait_all(30)
    assert wait_until(lambda: transfer.state is TransferState.FAILED)  # the receiver told the sender
    with pytest.raises(DeadlineExceededError, match="deadline"):
        transfer.send_layers([3, 4], 1)
    pair.assert_released()


def test_a_wait_timeout_aborts_the_transfer(make_pair: Callable[..., Pair]) -> None:
    pair = make_pair(make_layout(num_layers=2))
    handle = pair.receiver.expect("req-1", [1])
    transfer = pair.sender.open_transfer(handle.target)
    transfer.send_layers([3], 0)
    started = time.monotonic()
    with pytest.raises(DeadlineExceededError, match=r"not complete within 0\.2s"):
        handle.wait_all(0.2)
    assert time.monotonic() - started < 10
    assert wait_until(lambda: transfer.state is TransferState.FAILED)
    with pytest.raises(DeadlineExceededError):
        transfer.send_layers([3], 1)
    pair.assert_released()


def test_sender_finish_timeout_aborts_and_tells_the_receiver(make_pair: Callable[..., Pair]) -> None:
    pair = make_pair(make_layout(num_layers=2))
    handle = pair.receiver.expect("req-1", [1])
    transfer = pair.sender.open_transfer(dataclasses.replace(handle.target, layer_end=1))
    transfer.send_layers([3])
    # the receiver waits for layer 1 that this (mis-targeted) sender will never send
    with pytest.raises(ProtocolError):
        transfer.finish(30)
    with pytest.raises(ProtocolError, match="target differs"):
        handle.wait_all(30)
    pair.assert_released()


def test_unknown_and_finished_transfers_are_refused(make_pair: Callable[..., Pair]) -> None:
    pair = make_pair()
    handle = pair.receiver.expect("req-1", [1], timeout_s=30)
    ghost = pair.sender.open_transfer(dataclasses.replace(handle.target, transfer_id="req-ghost"))
    ghost.send_layers([2])
    with pytest.raises(UnknownTransferError, match="not expected"):
        ghost.finish(30)
    first = pair.sender.open_transfer(handle.target)
    first.send_layers([2])
    first.finish(30)
    replay = pair.sender.open_transfer(handle.target)
    replay.send_layers([2])
    with pytest.raises(UnknownTransferError, match="already completed"):
        replay.finish(30)
    pair.assert_released()


def test_forged_destination_blocks_are_never_written(make_pair: Callable[..., Pair]) -> None:
    pair = make_pair()
    handle = pair.receiver.expect("req-1", [1, 2], timeout_s=30)
    forged = dataclasses.replace(handle.target, dst_block_ids=(1, 40))
    transfer = pair.sender.open_transfer(forged)
    transfer.send_layers([5, 6])
    with pytest.raises(ProtocolError, match="differs"):
        transfer.finish(30)
    with pytest.raises(ProtocolError, match="differs"):
        handle.wait_all(30)
    assert not pair.dst.view(-1).view(torch.uint8).any()
    pair.assert_released()


def test_closing_the_receiver_fails_transfers_in_flight(make_pair: Callable[..., Pair]) -> None:
    pair = make_pair(make_layout(num_layers=3))
    handle = pair.receiver.expect("req-1", [1], timeout_s=30)
    transfer = pair.sender.open_transfer(handle.target)
    transfer.send_layers([2], 0)
    handle.wait_layer(0, 30)
    pair.receiver.close()
    with pytest.raises(CancelledError, match="shutting down"):
        handle.wait_all(1)
    # The sender learns it from the connection; the rest of the layers cannot change that (whether
    # the news arrived before they were queued or after).
    with pytest.raises((CancelledError, PeerLostError)):
        transfer.send_layers([2], range(1, 3))
        transfer.finish(30)
    pair.assert_released()


def test_closing_the_sender_fails_transfers_in_flight(make_pair: Callable[..., Pair]) -> None:
    pair = make_pair(make_layout(num_layers=3))
    handle = pair.receiver.expect("req-1", [1], timeout_s=30)
    transfer = pair.sender.open_transfer(handle.target)
    transfer.send_layers([2], 0)
    handle.wait_layer(0, 30)
    pair.sender.close()
    with pytest.raises(PeerLostError):
        transfer.finish(1)
    with pytest.raises(PeerLostError):
        handle.wait_all(30)
    pair.assert_released()
