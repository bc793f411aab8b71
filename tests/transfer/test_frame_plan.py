from __future__ import annotations

from pdrouter.transfer.frame_plan import FrameSpan, PlannedFrame, plan_frames
from pdrouter.transfer.target import BlockSegment

HALF = 100  # bytes of one block's K (or V) in one layer


def test_small_request_packs_several_layers_per_frame() -> None:
    frames = plan_frames([BlockSegment(0, 10, 2)], range(0, 4), HALF, max_frame_bytes=800, max_runs=8)
    # 2 blocks x (K, V) x 100 B = 400 B per layer: two layers per frame.
    assert frames == [
        PlannedFrame(FrameSpan(0, 2, ((0, 2),)), FrameSpan(0, 2, ((10, 2),)), 800),
        PlannedFrame(FrameSpan(2, 4, ((0, 2),)), FrameSpan(2, 4, ((10, 2),)), 800),
    ]


def test_large_run_is_split_within_a_layer_and_frames_are_layer_major() -> None:
    frames = plan_frames([BlockSegment(0, 0, 5)], range(1, 3), HALF, max_frame_bytes=400, max_runs=8)
    assert [(f.src.layer_start, f.src.runs) for f in frames] == [
        (1, ((0, 2),)), (1, ((2, 2),)), (1, ((4, 1),)),
        (2, ((0, 2),)), (2, ((2, 2),)), (2, ((4, 1),)),
    ]
    assert all(f.nbytes <= 400 for f in frames)


def test_run_limit_starts_new_frames() -> None:
    segments = [BlockSegment(i * 2, 100 + i * 3, 1) for i in range(5)]
    frames = plan_frames(segments, range(0, 1), HALF, max_frame_bytes=10_000, max_runs=2)
    assert [len(f.dst.runs) for f in frames] == [2, 2, 1]
    assert [run for f in frames for run in f.dst.runs] == [(100 + i * 3, 1) for i in range(5)]


def test_nothing_to_plan() -> None:
    assert plan_frames([], range(0, 4), HALF, 1000, 4) == []
    assert plan_frames([BlockSegment(0, 0, 1)], range(2, 2), HALF, 1000, 4) == []


def test_pieces_are_layer_kv_run_ranges_in_payload_order() -> None:
    span = FrameSpan(1, 2, ((3, 2), (9, 1)))
    # pool of 10 blocks: (layer, kv) row r starts at block r * 10
    assert list(span.pieces(HALF, 10)) == [
        ((20 + 3) * HALF, 2 * HALF), ((20 + 9) * HALF, HALF),   # layer 1, K
        ((30 + 3) * HALF, 2 * HALF), ((30 + 9) * HALF, HALF),   # layer 1, V
    ]
    assert span.nbytes(HALF) == 6 * HALF
