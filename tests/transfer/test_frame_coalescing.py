"""The writer merges frames queued back to back for the next layers of the same blocks (pure logic)."""

from __future__ import annotations

from collections import deque
from typing import Any

from pdrouter.transfer.frame_plan import FrameSpan, PlannedFrame
from pdrouter.transfer.outgoing import DataItem, EndItem, OutItem
from pdrouter.transfer.sender_connection import _coalesce

RUNS = ((4, 2),)
DST = ((10, 2),)
LAYER_BYTES = 1000


def data(seq: int, layer: int, runs: tuple[tuple[int, int], ...] = RUNS, dst: tuple[tuple[int, int], ...] = DST,
         layers: int = 1, transfer: Any = None) -> DataItem:
    frame = PlannedFrame(FrameSpan(layer, layer + layers, runs), FrameSpan(layer, layer + layers, dst),
                         LAYER_BYTES * layers)
    return DataItem(transfer, seq, frame)


def test_consecutive_layers_of_the_same_blocks_become_one_frame() -> None:
    queue: deque[OutItem] = deque(data(seq, seq) for seq in range(1, 5))
    merged = _coalesce(data(0, 0), queue, 10 * LAYER_BYTES)
    assert merged.seq == 0
    assert merged.frame == PlannedFrame(FrameSpan(0, 5, RUNS), FrameSpan(0, 5, DST), 5 * LAYER_BYTES)
    assert not queue


def test_merging_stops_at_the_frame_size_limit() -> None:
    queue: deque[OutItem] = deque(data(seq, seq) for seq in range(1, 5))
    merged = _coalesce(data(0, 0), queue, 3 * LAYER_BYTES)
    assert (merged.frame.src.layer_start, merged.frame.src.layer_end) == (0, 3)
    assert [item.frame.src.layer_start for item in queue if isinstance(item, DataItem)] == [3, 4]


def test_frames_that_do_not_continue_the_span_are_left_alone() -> None:
    first = data(0, 0)
    for follower in (data(1, 2),                      # a gap in the layers
                     data(1, 1, runs=((6, 2),)),      # other source blocks (the next group of a split layer)
                     data(1, 1, dst=((12, 2),)),      # other destination blocks
                     EndItem(None, 1, LAYER_BYTES)):  # type: ignore[arg-type]
        queue: deque[OutItem] = deque([follower])
        assert _coalesce(first, queue, 100 * LAYER_BYTES) is first
        assert list(queue) == [follower]


def test_a_multi_layer_frame_merges_with_the_layers_after_it() -> None:
    queue: deque[OutItem] = deque([data(1, 2, layers=2), data(2, 4)])
    merged = _coalesce(data(0, 0, layers=2), queue, 100 * LAYER_BYTES)
    assert (merged.frame.src.layer_start, merged.frame.src.layer_end, merged.frame.nbytes) == (0, 5, 5 * LAYER_BYTES)
