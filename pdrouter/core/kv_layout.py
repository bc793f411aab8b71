"""The KV pool's memory layout, shared by the engine (which owns the tensor) and the transfer layer.

One tensor per worker holds the whole pool::

    kv[layer, kv_index, block, slot, kv_head, head_dim]      kv_index 0 = K, 1 = V

so for a given (layer, K|V) a run of consecutive block ids is one contiguous byte range, and a
whole layer of a block is two ranges of ``block_size × kv_heads × head_dim`` elements.
"""

from __future__ import annotations

from dataclasses import dataclass

import xxhash

from pdrouter.core.errors import ConfigError
from pdrouter.core.model_spec import DTYPE_BYTES, ModelSpec, normalize_dtype

LAYOUT_NAME = "layer-kv-block-slot-head-dim/v1"


@dataclass(frozen=True)
class KvLayout:
    """Geometry of one worker's KV pool (per TP rank)."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    num_blocks: int
    dtype: str

    def __post_init__(self) -> None:
        for field in ("num_layers", "num_kv_heads", "head_dim", "block_size", "num_blocks"):
            if getattr(self, field) <= 0:
                raise ConfigError(f"KV layout: {field} must be > 0, got {getattr(self, field)}")
        object.__setattr__(self, "dtype", normalize_dtype(self.dtype))

    @classmethod
    def for_model(cls, spec: ModelSpec, num_blocks: int, block_size: int = 16,
                  dtype: str | None = None, tp: int = 1) -> KvLayout:
        return cls(num_layers=spec.num_layers, num_kv_heads=max(1, spec.num_kv_heads // tp),
                   head_dim=spec.head_dim, block_size=block_size, num_blocks=num_blocks,
                   dtype=dtype or spec.dtype)

    @property
    def shape(self) -> tuple[int, int, int, int, int, int]:
        return (self.num_layers, 2, self.num_blocks, self.block_size, self.num_kv_heads, self.head_dim)

    @property
    def dtype_bytes(self) -> int:
        return DTYPE_BYTES[self.dtype]

    @property
    def block_elems(self) -> int:
        """Elements of one block's K (or V) in one layer."""
        return self.block_size * self.num_kv_heads * self.head_dim

    @property
    def block_bytes_per_layer(self) -> int:
        """Bytes of one block in one layer, K and V together."""
        return 2 * self.block_elems * self.dtype_bytes

    @property
    def block_bytes(self) -> int:
        """Bytes of one block across all layers."""
        return self.num_layers * self.block_bytes_per_layer

    @property
    def kv_bytes_per_token(self) -> int:
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.dtype_bytes

    @property
    def pool_bytes(self) -> int:
        return self.num_blocks * self.block_bytes

    def compat_hash(self) -> str:
        """Two pools can exchange blocks iff this matches (the pool's size does not count)."""
        key = (f"{LAYOUT_NAME}|{self.num_layers}|{self.num_kv_heads}|{self.head_dim}|"
               f"{self.block_size}|{self.dtype}")
        return xxhash.xxh3_64_hexdigest(key.encode())


def model_compat_hash(spec: ModelSpec, block_size: int, kv_dtype: str | None = None, tp: int = 1) -> str:
    """Hash of everything that must agree between router, prefill and decode for one model."""
    key = (f"{spec.num_layers}|{spec.hidden_size}|{spec.num_heads}|{spec.num_kv_heads}|{spec.head_dim}|"
           f"{spec.intermediate_size}|{spec.vocab_size}|{spec.rope_theta}|{spec.dtype}|"
           f"{normalize_dtype(kv_dtype or spec.dtype)}|{block_size}|{tp}|{LAYOUT_NAME}")
    return xxhash.xxh3_64_hexdigest(key.encode())
