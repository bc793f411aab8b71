"""Byte-level, copy-free access to a worker's KV pool tensor (shape and dtype from ``KvLayout``)."""

from __future__ import annotations

from collections.abc import Iterable

import torch
import xxhash

from pdrouter.core.errors import ConfigError, InvalidRequestError
from pdrouter.core.kv_layout import KvLayout
from pdrouter.transfer.frame_plan import FrameSpan

_TORCH_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float8": torch.float8_e4m3fn,
}


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype of a ``KvLayout.dtype`` name."""
    return _TORCH_DTYPES[name]


def checksum(buffers: Iterable[memoryview]) -> int:
    """xxh3-64 of the buffers' bytes taken in order (equal to hashing their concatenation)."""
    hasher = xxhash.xxh3_64()
    for buf in buffers:
        hasher.update(buf)
    return hasher.intdigest()


class PoolView:
    """Views of one KV pool tensor as byte ranges.

    Holds a reference to the engine's tensor, never allocates or copies pool memory, and has no
    opinion on which blocks are in use: callers pass block ids they own (sender) or were given
    (receiver).
    """

    def __init__(self, pool: torch.Tensor, layout: KvLayout) -> None:
        if tuple(pool.shape) != layout.shape:
            raise ConfigError(f"KV pool tensor has shape {tuple(pool.shape)}, the layout says {layout.shape}")
        if pool.dtype != torch_dtype(layout.dtype):
            raise ConfigError(f"KV pool tensor is {pool.dtype}, the layout says {layout.dtype}")
        if not pool.is_contiguous():
            raise ConfigError("KV pool tensor must be contiguous")
        self.pool = pool
        self.layout = layout
        self.half_block_bytes = layout.block_elems * layout.dtype_bytes
        self.is_cuda = pool.is_cuda
        self._bytes = pool.view(-1).view(torch.uint8)
        self._memory = None if self.is_cuda else self._bytes.numpy().data

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

    def buffers(self, span: FrameSpan) -> list[memoryview]:
        """Writable memoryviews of the span's ranges in payload order (CPU pools only)."""
        if self._memory is None:
            raise ConfigError("byte buffers need a CPU pool; a CUDA pool moves through NCCL")
        mem = self._memory
        return [mem[off:off + n] for off, n in span.pieces(self.half_block_bytes, self.num_blocks)]

    def chunks(self, span: FrameSpan, limit: int) -> list[memoryview]:
        """``buffers`` with each range cut into pieces of at most ``limit`` bytes."""
        return [buf[start:start + limit] for buf in self.buffers(span) for start in range(0, len(buf), limit)]

    def tensors(self, span: FrameSpan) -> list[torch.Tensor]:
        """1-D uint8 tensor views of the span's ranges in payload order (any device)."""
        flat = self._bytes
        return [flat[off:off + n] for off, n in span.pieces(self.half_block_bytes, self.num_blocks)]

    def checksum(self, span: FrameSpan) -> int:
        """xxh3-64 of the span's payload (CPU pools only)."""
        return checksum(self.buffers(span))
