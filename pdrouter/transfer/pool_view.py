"""A worker's KV pool tensor as ``PoolBytes`` (per ``KvLayout``), plus uint8 tensor views for torch.distributed."""

from __future__ import annotations

import torch

from pdrouter.core.errors import ConfigError
from pdrouter.core.kv_layout import KvLayout
from pdrouter.transfer.frame_plan import FrameSpan
from pdrouter.transfer.pool_bytes import PoolBytes, checksum

__all__ = ["PoolView", "checksum", "torch_dtype"]

_TORCH_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float8": torch.float8_e4m3fn,
}


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype of a ``KvLayout.dtype`` name."""
    return _TORCH_DTYPES[name]


class PoolView(PoolBytes):
    """Views of one KV pool tensor as byte ranges (and, for gloo/NCCL, as uint8 tensors).

    Holds a reference to the engine's tensor and never allocates or copies pool memory.
    """

    def __init__(self, pool: torch.Tensor, layout: KvLayout) -> None:
        if tuple(pool.shape) != layout.shape:
            raise ConfigError(f"KV pool tensor has shape {tuple(pool.shape)}, the layout says {layout.shape}")
        if pool.dtype != torch_dtype(layout.dtype):
            raise ConfigError(f"KV pool tensor is {pool.dtype}, the layout says {layout.dtype}")
        if not pool.is_contiguous():
            raise ConfigError("KV pool tensor must be contiguous")
        self.pool = pool
        self._bytes = pool.view(-1).view(torch.uint8)
        super().__init__(layout, None if pool.is_cuda else self._bytes.numpy().data, is_cuda=pool.is_cuda)

    def tensors(self, span: FrameSpan) -> list[torch.Tensor]:
        """1-D uint8 tensor views of the span's ranges in payload order (any device)."""
        flat = self._bytes
        return [flat[off:off + n] for off, n in self.pieces(span)]
