"""A simulated worker's stand-in pool: block-major ranges, and real TCP transfers into the right blocks."""

from __future__ import annotations

import pytest

from pdrouter.core.kv_layout import KvLayout
from pdrouter.transfer import KvReceiver, KvSender, TransferState
from pdrouter.transfer.frame_plan import FrameSpan
from pdrouter.transfer.pool_bytes import StandinPool, standin_layout

from .factories import make_config, wait_until

REAL = KvLayout(num_layers=4, num_kv_heads=8, head_dim=128, block_size=16, num_blocks=32, dtype="bfloat16")
PER_BLOCK = 2 * REAL.num_layers  # one byte per layer and K|V


def filled(seed: int) -> StandinPool:
    pool = StandinPool.for_layout(REAL)
    for block in range(REAL.num_blocks):
        for i in range(PER_BLOCK):
            pool.buffers(FrameSpan(0, REAL.num_layers, ((block, 1),)))[0][i] = (seed + 7 * block + i) % 251 + 1
    return pool


def block_bytes(pool: StandinPool, block: int) -> bytes:
    (view,) = pool.buffers(FrameSpan(0, REAL.num_layers, ((block, 1),)))
    return bytes(view)


def test_a_frame_over_every_layer_is_one_range_per_run() -> None:
    pool = StandinPool.for_layout(REAL)
    assert pool.layout == standin_layout(REAL)
    span = FrameSpan(0, 4, ((2, 3), (9, 1)))
    assert list(pool.pieces(span)) == [(2 * PER_BLOCK, 3 * PER_BLOCK), (9 * PER_BLOCK, PER_BLOCK)]
    assert sum(n for _, n in pool.pieces(span)) == pool.nbytes(span)


def test_a_frame_over_some_layers_is_one_range_per_block() -> None:
    pool = StandinPool.for_layout(REAL)
    span = FrameSpan(1, 3, ((2, 2), (9, 1)))
    assert list(pool.pieces(span)) == [(2 * PER_BLOCK + 2, 4), (3 * PER_BLOCK + 2, 4), (9 * PER_BLOCK + 2, 4)]
    assert sum(n for _, n in pool.pieces(span)) == pool.nbytes(span)


@pytest.mark.parametrize("layers", [None, [range(0, 3), range(3, 4)], [range(0, 1), range(1, 2), range(2, 4)]],
                         ids=["every-layer-at-once", "all-but-the-last-then-the-last", "layer-by-layer"])
def test_a_transfer_lands_each_block_in_its_destination_and_nowhere_else(layers: list[range] | None) -> None:
    src, dst = filled(3), StandinPool.for_layout(REAL)
    receiver = KvReceiver(dst, dst.layout, make_config())
    sender = KvSender(src, src.layout, make_config())
    try:
        source, destination = [4, 5, 6, 11, 20], [7, 8, 30, 31, 2]
        handle = receiver.expect("req-1", destination, skip_blocks=1, timeout_s=30)
        transfer = sender.open_transfer(handle.target)
        for span in layers or [range(0, REAL.num_layers)]:
            transfer.send_layers(source, span)
        transfer.finish(30)
        handle.wait_all(30)
        assert handle.state is TransferState.DONE and transfer.state is TransferState.DONE
        for s, d in zip(source[1:], destination[1:], strict=True):
            assert block_bytes(dst, d) == block_bytes(src, s)
        untouched = set(range(REAL.num_blocks)) - set(destination[1:])
        assert all(block_bytes(dst, b) == bytes(PER_BLOCK) for b in untouched)
        assert wait_until(lambda: receiver.stats().expectations == 0 and sender.stats().transfers == 0)
    finally:
        sender.close()
        receiver.close()
