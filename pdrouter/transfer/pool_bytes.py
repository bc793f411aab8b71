"""Byte-level, copy-free access to a KV pool laid out as ``KvLayout`` says, without torch.

``PoolBytes`` is what the TCP path needs of a pool: the byte ranges of a frame's blocks and layers
as writable memoryviews (or none, for a CUDA pool, which moves through NCCL). Two pools have it:

* ``pdrouter.transfer.pool_view.PoolView``: the engine's torch tensor (CPU or CUDA);
* ``PoolBytes.allocate(layout)``: a plain byte buffer;
* ``StandinPool.for_layout(layout)``: a simulated worker's, whose blocks carry a small stand-in
  payload over the real transfer path (``standin_layout``).

``pdrouter.transfer.pools.open_pool`` takes either; only a tensor loads torch, so a simulated
worker's sender and receiver never do.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from operator import itemgetter

import xxhash

from pdrouter.core.errors import ConfigError, InvalidRequestError
from pdrouter.core.kv_layout import KvLayout
from pdrouter.transfer.frame_plan import FrameSpan


def checksum(buffers: Iterable[memoryview]) -> int:
    """xxh3-64 of the buffers' bytes taken in order (equal to hashing their concatenation)."""
    hasher = xxhash.xxh3_64()
    for buf in buffers:
        hasher.update(buf)
    return hasher.intdigest()


def standin_layout(layout: KvLayout) -> KvLayout:
    """The layout of a simulated pool: the same blocks and layers, one byte per block, layer and K|V.

    A transfer then runs every control step of the real one (frames per layer, block runs,
    ``skip_blocks``, checks) while moving ``2 × layers`` bytes per block instead of the geometry's
    ``block_bytes``; the simulated workers model the real bytes' time themselves.
    """
    return KvLayout(num_layers=layout.num_layers, num_kv_heads=1, head_dim=1, block_size=1,
                    num_blocks=layout.num_blocks, dtype="float8")


class PoolBytes:
    """Views of one KV pool as byte ranges.

    Never allocates or copies pool memory (except ``allocate``, which makes a pool), and has no
    opinion on which blocks are in use: callers pass block ids they own (sender) or were given
    (receiver).
    """

    def __init__(self, layout: KvLayout, memory: memoryview | None, *, is_cuda: bool = False) -> None:
        if memory is not None and len(memory) != layout.pool_bytes:
            raise ConfigError(f"KV pool buffer has {len(memory)} bytes, the layout says {layout.pool_bytes}")
        self.layout = layout
        self.half_block_bytes = layout.block_elems * layout.dtype_bytes
        self.is_cuda = is_cuda
        if memory is not None and (memory.format != "B" or memory.ndim != 1):
            memory = memory.cast("B")  # flat bytes: the socket writes the views it hands out as they are
        self._memory = memory

    @classmethod
    def allocate(cls, layout: KvLayout) -> PoolBytes:
        """A zeroed pool of ``layout.pool_bytes`` bytes in ordinary memory (untouched pages cost nothing)."""
        return cls(layout, memoryview(bytearray(layout.pool_bytes)))

    @property
    def num_blocks(self) -> int:
        return self.layout.num_blocks

    def nbytes(self, span: FrameSpan) -> int:
        return span.nbytes(self.half_block_bytes)

    def check_span(self, span: FrameSpan) -> None:
        """InvalidRequestError unless every layer and block of ``span`` is inside this pool."""
        if not 0 <= span.layer_start < span.layer_end <= self.layout.num_layers:
            raise InvalidRequestError(f"layers [{span.layer_start}, {span.layer_end}) outside the pool's "
                                      f"{self.layout.num_layers} layers")
        for start, count in span.runs:
            if count <= 0 or start < 0 or start + count > self.num_blocks:
                raise InvalidRequestError(f"blocks {start}..{start + count - 1} outside the pool's "
                                          f"{self.num_blocks} blocks")

    def pieces(self, span: FrameSpan) -> Iterable[tuple[int, int]]:
        """(byte offset, byte length) of each contiguous range of the span, in payload order.

        Both ends of a transfer cut a frame the same way, so a pool arranged otherwise (vLLM's
        per-layer pages, ``pdrouter.transfer.vllm.paged_pool``) overrides this one method.
        """
        return span.pieces(self.half_block_bytes, self.num_blocks)

    def buffers(self, span: FrameSpan) -> list[memoryview]:
        """Writable memoryviews of the span's ranges in payload order (CPU pools only)."""
        if self._memory is None:
            raise ConfigError("byte buffers need a CPU pool; a CUDA pool moves through NCCL")
        mem = self._memory
        return [mem[off:off + n] for off, n in self.pieces(span)]

    def chunks(self, span: FrameSpan, limit: int) -> list[memoryview]:
        """``buffers`` with each range cut into pieces of at most ``limit`` bytes."""
        if self._memory is None:
            raise ConfigError("byte buffers need a CPU pool; a CUDA pool moves through NCCL")
        mem = self._memory
        pieces = list(self.pieces(span))
        if max(map(itemgetter(1), pieces), default=0) <= limit:  # the usual case: a block's layer is tens of KiB
            return [mem[off:off + n] for off, n in pieces]  # one comprehension: per-range Python is the cost here
        out: list[memoryview] = []
        for off, n in pieces:
            out.extend(mem[start:min(start + limit, off + n)] for start in range(off, off + n, limit))
        return out

    def checksum(self, span: FrameSpan) -> int:
        """xxh3-64 of the span's payload (CPU pools only)."""
        return checksum(self.buffers(span))


class StandinPool(PoolBytes):
    """A simulated worker's pool: ``standin_layout``'s bytes, arranged block-major.

    A block's bytes for every layer, K and V lie together (``[block, layer, K|V]``), so a frame
    over every layer of a run of consecutive blocks is one range, and one over some layers is one
    range per block: a transfer moves a handful of ranges, not ``2 × layers × runs`` ranges of a
    byte each. The payload order differs from a tensor pool's; both ends of a simulated transfer
    are stand-in pools (their layout's compatibility hash is no real pool's).
    """

    @classmethod
    def for_layout(cls, layout: KvLayout) -> StandinPool:
        """A zeroed stand-in pool for a simulated engine of ``layout`` (its real geometry)."""
        standin = standin_layout(layout)
        return cls(standin, memoryview(bytearray(standin.pool_bytes)))

    def pieces(self, span: FrameSpan) -> Iterator[tuple[int, int]]:
        half = self.half_block_bytes
        per_block = 2 * self.layout.num_layers * half
        if span.layer_start == 0 and span.layer_end == self.layout.num_layers:
            for start, count in span.runs:
                yield start * per_block, count * per_block
            return
        first, length = 2 * span.layer_start * half, 2 * span.num_layers * half
        for start, count in span.runs:
            for block in range(start, start + count):
                yield block * per_block + first, length
