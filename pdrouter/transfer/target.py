"""Where a transfer goes: the ``TransferTarget`` value object, and pairing source with destination blocks.

A decode worker reserves blocks, calls ``KvReceiver.expect`` and hands the resulting target to the
prefill worker (through the router, in a protobuf message). The target is made only of ints,
strings and a tuple of ints so that it converts to and from protobuf field by field.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from pdrouter.core.errors import InvalidRequestError

MAX_TRANSFER_ID_BYTES = 256


@dataclass(frozen=True)
class TransferTarget:
    """The blocks one request's KV must land in, on which receiver, under which checks.

    ``dst_block_ids[i]`` receives the prompt's block ``i``. The first ``skip_blocks`` of them are
    already filled on the decode side (its own prefix cache), so only the rest is sent.
    ``epoch`` is the receiver's epoch when it issued the target; ``sender_epoch`` (0: any) is the
    epoch the receiver expects of the sender. ``deadline_unix_ms`` (0: none) is advisory for the
    sender; the receiver enforces its own deadline.
    """

    transfer_id: str
    peer: str
    dst_block_ids: tuple[int, ...]
    compat_hash: str
    epoch: int
    layer_start: int
    layer_end: int
    skip_blocks: int = 0
    sender_epoch: int = 0
    backend: str = "tcp"
    deadline_unix_ms: int = 0

    def __post_init__(self) -> None:
        object.__setattr__(self, "dst_block_ids", tuple(map(int, self.dst_block_ids)))
        tid = self.transfer_id.encode()
        if not tid or len(tid) > MAX_TRANSFER_ID_BYTES:
            raise InvalidRequestError(f"transfer_id must be 1..{MAX_TRANSFER_ID_BYTES} bytes, "
                                      f"got {self.transfer_id!r}")
        host, sep, port = self.peer.rpartition(":")
        if not sep or not host or not port.isdigit():
            raise InvalidRequestError(f"peer must be 'host:port', got {self.peer!r}")
        if not 0 <= self.skip_blocks <= len(self.dst_block_ids):
            raise InvalidRequestError(f"skip_blocks={self.skip_blocks} outside 0..{len(self.dst_block_ids)}")
        if not 0 <= self.layer_start < self.layer_end:
            raise InvalidRequestError(f"bad layer range [{self.layer_start}, {self.layer_end})")
        if self.epoch <= 0 or self.sender_epoch < 0 or self.deadline_unix_ms < 0:
            raise InvalidRequestError("epoch must be > 0; sender_epoch and deadline_unix_ms >= 0")
        check_block_ids(self.dst_block_ids, what="dst_block_ids")

    @property
    def host(self) -> str:
        return self.peer.rpartition(":")[0]

    @property
    def port(self) -> int:
        return int(self.peer.rpartition(":")[2])

    @property
    def layers(self) -> range:
        return range(self.layer_start, self.layer_end)

    @property
    def blocks_to_send(self) -> tuple[int, ...]:
        """The destination blocks that actually cross the wire."""
        return self.dst_block_ids[self.skip_blocks:]


class BlockSegment(NamedTuple):
    """``length`` blocks read from ``src_start..`` and written to ``dst_start..``, both consecutive."""

    src_start: int
    dst_start: int
    length: int


def check_block_ids(ids: Sequence[int], *, what: str, num_blocks: int | None = None) -> None:
    """InvalidRequestError unless ``ids`` are distinct, >= 0 and (if given) < ``num_blocks``."""
    if not ids:
        return
    if len(ids) <= _SMALL:  # most requests: plain Python beats numpy's per-call overhead here
        low, high, distinct = min(ids), max(ids), len(set(ids))
    else:
        arr = np.asarray(ids, dtype=np.int64)
        low, high, distinct = int(arr.min()), int(arr.max()), len(np.unique(arr))
    if low < 0 or (num_blocks is not None and high >= num_blocks):
        limit = "" if num_blocks is None else f" and < {num_blocks}"
        raise InvalidRequestError(f"{what} must be >= 0{limit}; got min {low}, max {high}")
    if distinct != len(ids):
        raise InvalidRequestError(f"{what} has duplicate block ids")


_SMALL = 256
_segment = tuple.__new__
"""``_segment(BlockSegment, (src, dst, length))``: a ``BlockSegment`` made in C. The named tuple's own
``__new__`` is Python code, and a scattered prompt has a segment per block: 138 of them took 42 µs
to pair with it and 23 µs this way."""


def pair_segments(src_ids: Sequence[int], dst_ids: Sequence[int]) -> tuple[BlockSegment, ...]:
    """Coalesce positionally paired blocks into the fewest segments consecutive on both sides."""
    if len(src_ids) != len(dst_ids):
        raise InvalidRequestError(f"{len(src_ids)} source blocks for {len(dst_ids)} destination blocks")
    if not src_ids:
        return ()
    if len(src_ids) <= _SMALL:
        segments: list[BlockSegment] = []
        start = 0
        for i in range(1, len(src_ids) + 1):
            if i == len(src_ids) or src_ids[i] != src_ids[i - 1] + 1 or dst_ids[i] != dst_ids[i - 1] + 1:
                segments.append(_segment(BlockSegment, (int(src_ids[start]), int(dst_ids[start]), i - start)))
                start = i
        return tuple(segments)
    src = np.asarray(src_ids, dtype=np.int64)
    dst = np.asarray(dst_ids, dtype=np.int64)
    breaks = np.flatnonzero((np.diff(src) != 1) | (np.diff(dst) != 1)) + 1
    starts = np.concatenate(([0], breaks))
    counts = np.diff(np.concatenate((starts, [len(src)])))
    return tuple([_segment(BlockSegment, (int(src[s]), int(dst[s]), int(c)))
                  for s, c in zip(starts.tolist(), counts.tolist(), strict=True)])
