"""The lane's incremental frame parser: any split of a stream into reads gives the same frames."""

from __future__ import annotations

import random

import pytest

from pdrouter.wire.lane.frames import _frame, _Frames


def _stream(rng: random.Random, n: int) -> tuple[bytes, list[tuple[int, int, int, int, bytes]]]:
    frames = [(rng.randrange(1, 1 << 20), rng.randrange(256), rng.randrange(256), rng.randrange(1 << 20),
               rng.randbytes(rng.choice([0, 1, 7, 300, 9000]))) for _ in range(n)]
    return b"".join(_frame(s, k, a, body, t) for s, k, a, t, body in frames), frames


@pytest.mark.parametrize("seed", range(40))
def test_any_split_gives_the_frames_in_order(seed: int) -> None:
    rng = random.Random(seed)
    data, want = _stream(rng, rng.randrange(1, 30))
    cuts = sorted(rng.sample(range(1, len(data)), min(len(data) - 1, rng.randrange(0, 12))))
    parser, got = _Frames(), []
    for start, end in zip([0, *cuts], [*cuts, len(data)], strict=True):
        piece = data[start:end]
        got += parser.feed(bytearray(piece) if rng.random() < 0.2 else piece)
    assert got == want
    assert all(type(body) is bytes for *_, body in got)
    assert parser.feed(b"") == [] and not parser._buf  # nothing left over


def test_a_frame_over_the_limit_is_refused_and_the_buffer_dropped() -> None:
    parser = _Frames(max_body=100)
    assert parser.feed(_frame(1, 2, 3, b"x" * 10)[:7]) == []  # a partial header is held
    with pytest.raises(ValueError, match="exceeds the 100-byte limit"):
        parser.feed(_frame(1, 2, 3, b"x" * 10)[7:] + _frame(2, 2, 3, b"y" * 101))
    assert not parser._buf
    with pytest.raises(ValueError, match="exceeds the 100-byte limit"):
        parser.feed(_frame(2, 2, 3, b"y" * 101))  # nothing held: straight from the read
    assert not parser._buf
    assert parser.feed(_frame(3, 1, 0, b"ok")) == [(3, 1, 0, 0, b"ok")]
