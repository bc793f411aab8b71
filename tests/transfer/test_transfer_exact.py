"""Bit-exact transfers over TCP and gloo (in one process): dtypes, sizes, layer streaming, skipping."""

from __future__ import annotations

import asyncio
import random
import threading
from collections.abc import Callable

import pytest
import torch

from pdrouter.core.errors import InvalidRequestError
from pdrouter.transfer import Backend, KvReceiver, KvSender, TransferState

from .factories import Pair, blocks_equal, make_config, make_layout

BACKENDS = [Backend.TCP, Backend.GLOO]
DTYPES = ["float32", "bfloat16", "float16"]


def untouched_except(pool: torch.Tensor, written: list[int]) -> bool:
    others = [b for b in range(pool.shape[2]) if b not in set(written)]
    return not pool[:, :, others].view(-1).view(torch.uint8).any()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_one_block(make_pair: Callable[..., Pair], backend: Backend, dtype: str) -> None:
    pair = make_pair(make_layout(dtype), backend)
    handle = pair.receiver.expect("req-1", [17], timeout_s=30)
    transfer = pair.sender.open_transfer(handle.target)
    transfer.send_layers([3])
    transfer.finish(30)
    handle.wait_all(30)
    assert handle.state is TransferState.DONE and transfer.state is TransferState.DONE
    assert blocks_equal(pair.src, [3], pair.dst, [17])
    assert untouched_except(pair.dst, [17])
    pair.assert_released()


@pytest.mark.parametrize("backend", BACKENDS)
def test_open_without_dialling_only_on_a_live_connection(make_pair: Callable[..., Pair], backend: Backend) -> None:
    """The event-loop path: no connection yet → None (nothing sent); connected → the same transfer."""
    pair = make_pair(make_layout("float32"), backend)
    first = pair.receiver.expect("req-a", [5], timeout_s=30)
    assert pair.sender.open_transfer_if_connected(first.target) is None
    assert pair.sender.stats().connections == 0 and first.state is TransferState.WAITING
    transfer = pair.sender.open_transfer(first.target)  # dials
    transfer.send_layers([1])
    transfer.finish(30)
    second = pair.receiver.expect("req-b", [9], timeout_s=30)
    again = pair.sender.open_transfer_if_connected(second.target)
    assert again is not None
    again.send_layers([2])
    again.finish(30)
    for handle in (first, second):
        handle.wait_all(30)
    assert blocks_equal(pair.src, [1, 2], pair.dst, [5, 9])
    pair.assert_released()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_thousands_of_scattered_blocks_layer_by_layer(make_pair: Callable[..., Pair], backend: Backend,
                                                      dtype: str) -> None:
    layout = make_layout(dtype, num_layers=3, num_blocks=4096, block_size=2, num_kv_heads=1, head_dim=4)
    pair = make_pair(layout, backend, seed=7)
    rng = random.Random(dtype)
    src = rng.sample(range(4096), 3000)
    dst = rng.sample(range(4096), 3000)
    handle = pair.receiver.expect("req-many", dst, timeout_s=60)
    transfer = pair.sender.open_transfer(handle.target)
    for layer in range(layout.num_layers):
        transfer.send_layers(src, layer)
    transfer.finish(60)
    handle.wait_all(60)
    assert blocks_equal(pair.src, src, pair.dst, dst)
    assert untouched_except(pair.dst, dst)
    assert handle.bytes_landed == 3000 * layout.block_bytes
    pair.assert_released()


@pytest.mark.slow
@pytest.mark.parametrize("backend", BACKENDS)
def test_512_mib_in_one_transfer(make_pair: Callable[..., Pair], backend: Backend) -> None:
    # Llama-3-8B-like geometry: 128 KiB per token, 2 MiB per 16-token block; 256 blocks = 512 MiB.
    layout = make_layout("bfloat16", num_layers=32, num_blocks=260, block_size=16, num_kv_heads=8, head_dim=128)
    pair = make_pair(layout, backend, seed=3)
    src, dst = list(range(0, 256)), list(range(3, 259))
    handle = pair.receiver.expect("req-big", dst, timeout_s=120)
    assert layout.block_bytes * len(dst) == 512 << 20
    transfer = pair.sender.open_transfer(handle.target)
    for layer in range(layout.num_layers):
        transfer.send_layers(src, layer)
    transfer.finish(120)
    handle.wait_all(120)
    assert torch.equal(pair.src[:, :, 0:256].view(torch.uint8), pair.dst[:, :, 3:259].view(torch.uint8))
    assert not pair.dst[:, :, [0, 1, 2, 259]].view(torch.uint8).any()
    pair.assert_released()


@pytest.mark.parametrize("backend", BACKENDS)
def test_layers_stream_while_later_ones_are_computed(make_pair: Callable[..., Pair], backend: Backend) -> None:
    pair = make_pair(make_layout(num_layers=4), backend)
    handle = pair.receiver.expect("req-stream", [5, 6, 7], timeout_s=30)
    transfer = pair.sender.open_transfer(handle.target)
    transfer.send_layers([1, 2, 3], 0)
    handle.wait_layer(0, timeout=30)
    assert handle.layer_done(0) and not handle.layer_done(1)
    assert handle.state is TransferState.TRANSFERRING
    assert blocks_equal(pair.src[0:1], [1, 2, 3], pair.dst[0:1], [5, 6, 7])
    transfer.send_layers([1, 2, 3], range(1, 3))
    handle.wait_layer(2, timeout=30)
    assert not handle.layer_done(3)
    transfer.send_layers([1, 2, 3], 3)
    transfer.finish(30)
    handle.wait_layer(3, timeout=30)
    handle.wait_all(30)
    assert blocks_equal(pair.src, [1, 2, 3], pair.dst, [5, 6, 7])
    pair.assert_released()


async def test_async_waits_and_finish(make_pair: Callable[..., Pair]) -> None:
    pair = make_pair(make_layout(num_layers=2))
    handle = pair.receiver.expect("req-async", [9, 10], timeout_s=30)
    transfer = pair.sender.open_transfer(handle.target)
    waiter = asyncio.create_task(handle.wait_all_async(timeout=30))
    transfer.send_layers([0, 1], 0)
    await handle.wait_layer_async(0, timeout=30)
    assert not waiter.done()
    transfer.send_layers([0, 1], 1)
    await transfer.finish_async(timeout=30)
    await waiter
    assert blocks_equal(pair.src, [0, 1], pair.dst, [9, 10])
    pair.assert_released()


@pytest.mark.parametrize("backend", BACKENDS)
def test_only_missing_blocks_cross_the_wire(make_pair: Callable[..., Pair], backend: Backend) -> None:
    layout = make_layout(num_layers=2)
    pair = make_pair(layout, backend)
    dst = list(range(10, 20))
    pair.dst[:, :, 10:14] = 7.0  # the decode side's own prefix cache already holds blocks 0-3 of the prompt
    cached = pair.dst[:, :, 10:14].clone()
    handle = pair.receiver.expect("req-prefix", dst, skip_blocks=4, timeout_s=30)
    assert handle.target.blocks_to_send == tuple(range(14, 20))
    src = list(range(30, 40))
    transfer = pair.sender.open_transfer(handle.target)
    transfer.send_layers(src)
    transfer.finish(30)
    handle.wait_all(30)
    assert transfer.bytes_queued == handle.bytes_landed == 6 * layout.block_bytes
    assert torch.equal(pair.dst[:, :, 10:14], cached)
    assert blocks_equal(pair.src, src[4:], pair.dst, dst[4:])
    pair.assert_released()


def test_fully_cached_prompt_needs_no_transfer(make_pair: Callable[..., Pair]) -> None:
    pair = make_pair()
    handle = pair.receiver.expect("req-cached", [1, 2], skip_blocks=2, timeout_s=30)
    assert handle.state is TransferState.DONE
    handle.wait_all(0)
    transfer = pair.sender.open_transfer(handle.target)
    transfer.send_layers([5, 6])
    transfer.finish(0)
    assert transfer.state is TransferState.DONE
    assert not pair.dst.view(-1).view(torch.uint8).any()
    pair.assert_released()


def test_many_parallel_transfers_between_several_peers() -> None:
    layout = make_layout("bfloat16", num_layers=4, num_blocks=256, block_size=8, num_kv_heads=2, head_dim=32)
    pairs = [Pair(layout, Backend.TCP, seed=s) for s in range(2)]  # 2 senders...
    receivers = [pairs[0].receiver, pairs[1].receiver]  # ...and 3 receivers
    extra = Pair(layout, Backend.TCP, seed=9)
    receivers.append(extra.receiver)
    senders: list[tuple[KvSender, torch.Tensor]] = [(p.sender, p.src) for p in pairs]
    dst_pools = {r.address: pool for r, pool in zip(receivers, [pairs[0].dst, pairs[1].dst, extra.dst],
                                                    strict=True)}
    errors: list[BaseException] = []
    checks: list[tuple[torch.Tensor, list[int], KvReceiver, list[int]]] = []
    lock = threading.Lock()

    def run(sender: KvSender, src_pool: torch.Tensor, receiver: KvReceiver, n: int) -> None:
        try:
            rng = random.Random(f"{receiver.address}-{n}-{id(sender)}")
            with lock:
                slot = len([c for c in checks if c[2] is receiver])
                dst = list(range(slot * 10, slot * 10 + 10))
                checks.append((src_pool, [], receiver, dst))
                entry = len(checks) - 1
            src = rng.sample(range(256), 10)
            checks[entry] = (src_pool, src, receiver, dst)
            handle = receiver.expect(f"req-{id(sender)}-{receiver.address}-{n}", dst, timeout_s=60)
            transfer = sender.open_transfer(handle.target)
            for layer in range(layout.num_layers):
                transfer.send_layers(src, layer)
            transfer.finish(60)
            handle.wait_all(60)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(s, pool, r, n))
               for s, pool in senders for r in receivers for n in range(4)]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert not errors, errors
        assert len(checks) == 24
        for src_pool, src, receiver, dst in checks:
            assert blocks_equal(src_pool, src, dst_pools[receiver.address], dst)
        for sender, _ in senders:
            assert sender.stats().connections == 3  # one persistent connection per peer, shared
    finally:
        for p in (*pairs, extra):
            p.close()


@pytest.mark.parametrize("window", [0, 128 << 10, 256 << 20])
def test_bytes_in_flight_stay_within_the_window(window: int) -> None:
    layout = make_layout(num_layers=8, num_blocks=64, block_size=16, num_kv_heads=2, head_dim=32)
    pair = Pair(layout, Backend.TCP)
    pair.sender.close()
    pair.sender = KvSender(pair.src, layout, make_config(max_frame_bytes=64 << 10, max_inflight_bytes=window))
    peak = 0
    done = threading.Event()

    def watch() -> None:
        nonlocal peak
        while not done.is_set():
            peak = max(peak, pair.sender.stats().inflight_bytes)

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        handle = pair.receiver.expect("req-window", list(range(64)), timeout_s=60)
        transfer = pair.sender.open_transfer(handle.target)
        transfer.send_layers(list(range(64)))  # 8 layers x 512 KiB, in 64 KiB frames
        transfer.finish(60)
        handle.wait_all(60)
        assert blocks_equal(pair.src, list(range(64)), pair.dst, list(range(64)))
        pair.assert_released()
    finally:
        done.set()
        watcher.join()
        pair.close()
    assert peak <= window


def test_a_small_transfer_is_not_stuck_behind_a_big_one() -> None:
    layout = make_layout(num_layers=16, num_blocks=130, block_size=16, num_kv_heads=4, head_dim=64)  # 64 MiB+
    pair = Pair(layout, Backend.TCP)
    pair.sender.close()
    pair.sender = KvSender(pair.src, layout, make_config(max_frame_bytes=64 << 10))
    try:
        big = pair.receiver.expect("req-big", list(range(128)), timeout_s=60)
        small = pair.receiver.expect("req-small", [129], timeout_s=60)
        out_big = pair.sender.open_transfer(big.target)
        out_big.send_layers(list(range(128)))  # 1024 frames queued on the shared connection
        out_small = pair.sender.open_transfer(small.target)
        out_small.send_layers([0])
        out_small.finish(60)
        assert big.state is TransferState.TRANSFERRING  # the frames took turns
        out_big.finish(60)
        big.wait_all(60)
        assert blocks_equal(pair.src, [*range(128), 0], pair.dst, [*range(128), 129])
    finally:
        pair.close()


def test_misuse_is_refused_and_fails_both_sides(make_pair: Callable[..., Pair]) -> None:
    pair = make_pair(make_layout(num_layers=3))
    handle = pair.receiver.expect("req-misuse", [4, 5], timeout_s=30)
    transfer = pair.sender.open_transfer(handle.target)
    with pytest.raises(InvalidRequestError, match="2 destination"):
        transfer.send_layers([1])
    with pytest.raises(InvalidRequestError, match=">= 0 and < 64"):
        transfer.send_layers([1, 64])
    transfer.send_layers([1, 2], 0)
    with pytest.raises(InvalidRequestError, match="already sent"):
        transfer.send_layers([1, 2], range(0, 2))
    with pytest.raises(InvalidRequestError, match="outside"):
        transfer.send_layers([1, 2], 3)
    with pytest.raises(InvalidRequestError, match="finish before layers"):
        transfer.finish(10)
    with pytest.raises(InvalidRequestError, match="sender"):
        handle.wait_all(10)
    pair.assert_released()


def test_expect_validates_blocks_and_layers(make_pair: Callable[..., Pair]) -> None:
    pair = make_pair()
    with pytest.raises(InvalidRequestError):
        pair.receiver.expect("bad", [64])
    with pytest.raises(InvalidRequestError):
        pair.receiver.expect("bad", [1], layers=range(2, 9))
    pair.receiver.expect("dup", [1])
    with pytest.raises(InvalidRequestError, match="already expected"):
        pair.receiver.expect("dup", [2])
