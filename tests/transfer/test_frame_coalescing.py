"""The writer merges frames queued back to back for the next layers of the same blocks, and sends a
transfer's BEGIN and END with the DATA beside them; the receiver reads a payload's last MiB in
small batches (pure logic)."""

from __future__ import annotations

from collections import deque
from typing import Any

from pdrouter.transfer.data_plane import RECV_BATCH_BYTES, RECV_TAIL_BYTES, _tail_batches
from pdrouter.transfer.frame_plan import FrameSpan, PlannedFrame
from pdrouter.transfer.outgoing import BeginItem, DataItem, EndItem, OutItem
from pdrouter.transfer.sender_connection import _coalesce, _group

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


def test_begin_data_and_end_of_one_transfer_go_out_together() -> None:
    begin, end = BeginItem(None), EndItem(None, 4, 4 * LAYER_BYTES)  # type: ignore[arg-type]
    queue: deque[OutItem] = deque([begin, *(data(seq, seq) for seq in range(4)), end])
    items = _group(queue, 100 * LAYER_BYTES)
    assert [type(item) for item in items] == [BeginItem, DataItem, EndItem]
    assert isinstance(items[1], DataItem) and items[1].frame.nbytes == 4 * LAYER_BYTES
    assert not queue


def test_a_group_stops_where_the_next_message_cannot_join_it() -> None:
    begin, end = BeginItem(None), EndItem(None, 2, 2 * LAYER_BYTES)  # type: ignore[arg-type]
    other = data(1, 0, runs=((6, 2),))  # the next group of blocks: a frame of its own
    queue: deque[OutItem] = deque([begin, data(0, 0), other, end])
    assert _group(queue, 100 * LAYER_BYTES)[0] is begin and list(queue) == [other, end]
    assert [type(item) for item in _group(queue, 100 * LAYER_BYTES)] == [DataItem, EndItem] and not queue
    queue = deque([begin])  # the layers are not computed yet: BEGIN goes alone
    assert _group(queue, 100 * LAYER_BYTES) == [begin]
    queue = deque([end])
    assert _group(queue, 100 * LAYER_BYTES) == [end]


def test_the_last_mib_of_a_payload_is_read_in_small_batches() -> None:
    piece = 32 << 10

    def sizes(nbytes: int) -> list[int]:
        pieces = [memoryview(bytearray(piece))] * (nbytes // piece)
        return [sum(len(p) for p in batch) for batch in _tail_batches(pieces, nbytes)]

    assert sizes(2 << 20) == [RECV_BATCH_BYTES] + [RECV_TAIL_BYTES] * 4
    assert sizes(3 << 20) == [RECV_BATCH_BYTES] * 2 + [RECV_TAIL_BYTES] * 4
    assert sizes(96 << 10) == [96 << 10]
    assert sizes((1 << 20) + (512 << 10)) == [RECV_BATCH_BYTES, RECV_TAIL_BYTES, RECV_TAIL_BYTES]
