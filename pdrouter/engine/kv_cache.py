"""The KV pool tensor: one tensor per engine, shaped exactly ``KvLayout.shape``.

``tensor[layer, 0|1, block, slot, kv_head, dim]`` (0 = K, 1 = V). The KV transfer layer reads and
writes blocks of this tensor directly; :meth:`KvCache.export_blocks` / :meth:`KvCache.import_blocks`
are the reference copy operations (used by tests and by in-process transfers).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from pdrouter.core.errors import IncompatibleError
from pdrouter.core.kv_layout import KvLayout
from pdrouter.engine.device import torch_dtype


class KvCache:
    """Owns the pool tensor; zero-filled so padded reads never see NaNs."""

    def __init__(self, layout: KvLayout, device: torch.device) -> None:
        self.layout = layout
        self.tensor = torch.zeros(layout.shape, dtype=torch_dtype(layout.dtype), device=device)

    def layer(self, index: int) -> torch.Tensor:
        """``[2, blocks, slot, kv_heads, dim]`` view of one layer."""
        return self.tensor[index]

    def export_blocks(self, block_ids: Sequence[int]) -> torch.Tensor:
        """A copy of the given blocks: ``[layers, 2, len(block_ids), slot, kv_heads, dim]``."""
        index = torch.tensor(list(block_ids), dtype=torch.long, device=self.tensor.device)
        return self.tensor.index_select(2, index)

    def import_blocks(self, block_ids: Sequence[int], data: torch.Tensor) -> None:
        """Write ``data`` (as returned by :meth:`export_blocks` of a compatible pool) into ``block_ids``."""
        expected = (*self.layout.shape[:2], len(block_ids), *self.layout.shape[3:])
        if tuple(data.shape) != expected:
            raise IncompatibleError(f"KV blocks of shape {tuple(data.shape)} do not fit this pool "
                                    f"(expected {expected})")
        index = torch.tensor(list(block_ids), dtype=torch.long, device=self.tensor.device)
        self.tensor.index_copy_(2, index, data.to(device=self.tensor.device, dtype=self.tensor.dtype))
