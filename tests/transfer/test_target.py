from __future__ import annotations

import dataclasses
import random

import pytest

from pdrouter.core.errors import InvalidRequestError
from pdrouter.transfer.target import BlockSegment, TransferTarget, check_block_ids, pair_segments


def make_target(**overrides: object) -> TransferTarget:
    fields: dict[str, object] = {
        "transfer_id": "req-1", "peer": "127.0.0.1:5000", "dst_block_ids": (7, 8, 9, 3), "compat_hash": "abc",
        "epoch": 11, "layer_start": 0, "layer_end": 4,
    }
    fields.update(overrides)
    return TransferTarget(**fields)  # type: ignore[arg-type]


def test_target_is_plain_and_frozen() -> None:
    target = make_target(dst_block_ids=[7, 8, 9, 3], skip_blocks=1)
    assert target.dst_block_ids == (7, 8, 9, 3)
    assert target.blocks_to_send == (8, 9, 3)
    assert (target.host, target.port, target.layers) == ("127.0.0.1", 5000, range(0, 4))
    assert all(isinstance(getattr(target, f.name), int | str | tuple) for f in dataclasses.fields(target))
    with pytest.raises(dataclasses.FrozenInstanceError):
        target.epoch = 12  # type: ignore[misc]


@pytest.mark.parametrize("overrides", [
    {"transfer_id": ""},
    {"peer": "no-port"},
    {"peer": ":80"},
    {"skip_blocks": 5},
    {"skip_blocks": -1},
    {"layer_start": 3, "layer_end": 3},
    {"epoch": 0},
    {"dst_block_ids": (1, 2, 1)},
    {"dst_block_ids": (-1,)},
])
def test_target_rejects_nonsense(overrides: dict[str, object]) -> None:
    with pytest.raises(InvalidRequestError):
        make_target(**overrides)


def test_pair_segments_coalesces_runs_consecutive_on_both_sides() -> None:
    src = [10, 11, 12, 20, 21, 5]
    dst = [0, 1, 2, 3, 9, 10]
    assert pair_segments(src, dst) == (
        BlockSegment(10, 0, 3), BlockSegment(20, 3, 1), BlockSegment(21, 9, 1), BlockSegment(5, 10, 1),
    )
    assert pair_segments([], []) == ()
    assert pair_segments(list(range(100)), list(range(200, 300))) == (BlockSegment(0, 200, 100),)


def test_pair_segments_needs_equal_lengths() -> None:
    with pytest.raises(InvalidRequestError, match="2 source blocks for 3"):
        pair_segments([1, 2], [1, 2, 3])


def test_check_block_ids_bounds() -> None:
    check_block_ids([0, 5, 63], what="ids", num_blocks=64)
    with pytest.raises(InvalidRequestError, match="< 64"):
        check_block_ids([0, 64], what="ids", num_blocks=64)
    with pytest.raises(InvalidRequestError, match="duplicate"):
        check_block_ids([4, 4], what="ids")


def _segments_by_hand(src: list[int], dst: list[int]) -> list[BlockSegment]:
    out: list[BlockSegment] = []
    for s, d in zip(src, dst, strict=True):
        last = out[-1] if out else None
        if last is not None and s == last.src_start + last.length and d == last.dst_start + last.length:
            out[-1] = BlockSegment(last.src_start, last.dst_start, last.length + 1)
        else:
            out.append(BlockSegment(s, d, 1))
    return out


@pytest.mark.parametrize("n", [1, 7, 256, 257, 1500])
def test_short_and_long_id_lists_are_checked_and_paired_alike(n: int) -> None:
    """Short lists take a plain-Python path, long ones numpy: the answers are the same."""
    rng = random.Random(n)
    for _ in range(20):
        src = rng.sample(range(4 * n), n)
        # Runs consecutive on both sides, broken at random places.
        base = rng.randrange(1000)
        dst = [base + i + (i // rng.randint(1, 8)) * 3 for i in range(n)]
        src = sorted(src) if rng.random() < 0.5 else src
        assert list(pair_segments(src, dst)) == _segments_by_hand(src, dst)
        check_block_ids(src, what="ids", num_blocks=4 * n)
        with pytest.raises(InvalidRequestError, match="duplicate"):
            check_block_ids([*src, src[0]], what="ids")
        with pytest.raises(InvalidRequestError, match="got min -1"):
            check_block_ids([*src, -1], what="ids")
        with pytest.raises(InvalidRequestError, match=f"max {4 * n}"):
            check_block_ids([*src, 4 * n], what="ids", num_blocks=4 * n)
