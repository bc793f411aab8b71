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


def _frames_by_hand(segments: list[BlockSegment], layers: range, half: int, max_frame: int,
                    max_runs: int) -> list[PlannedFrame]:
    """The plan spelled out step by step: split, group, then every layer's frames."""
    cap = max(1, max_frame // (2 * half))
    pieces = [BlockSegment(s.src_start + o, s.dst_start + o, min(cap, s.length - o))
              for s in segments for o in range(0, s.length, cap)]
    groups: list[list[BlockSegment]] = [[]]
    for piece in pieces:
        if groups[-1] and (len(groups[-1]) >= max_runs or sum(p.length for p in groups[-1]) + piece.length > cap):
            groups.append([])
        groups[-1].append(piece)
    per_frame = max(1, max_frame // (sum(p.length for p in groups[0]) * 2 * half)) if len(groups) == 1 else 1
    frames = []
    for first in range(layers.start, layers.stop, per_frame):
        last = min(first + per_frame, layers.stop)
        for group in groups:
            src = FrameSpan(first, last, tuple((p.src_start, p.length) for p in group))
            dst = FrameSpan(first, last, tuple((p.dst_start, p.length) for p in group))
            frames.append(PlannedFrame(src, dst, src.nbytes(half)))
    return frames


def test_random_plans_equal_the_plan_by_hand() -> None:
    import random

    rng = random.Random(7)
    for _ in range(300):
        segments = [BlockSegment(rng.randrange(1000), rng.randrange(1000), rng.randrange(1, 40))
                    for _ in range(rng.randrange(1, 20))]
        start = rng.randrange(4)
        layers = range(start, start + rng.randrange(1, 9))
        half, max_frame = rng.choice([1, 64, 100]), rng.choice([200, 1_000, 8_000, 1 << 20])
        max_runs = rng.randrange(1, 6)
        frames = plan_frames(segments, layers, half, max_frame, max_runs)
        assert frames == _frames_by_hand(segments, layers, half, max_frame, max_runs)
        assert all(type(f) is PlannedFrame and type(f.src) is FrameSpan for f in frames)
        assert sum(f.nbytes for f in frames) == len(layers) * 2 * half * sum(s.length for s in segments)
