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

SMALL_CHECK_BYTES = 1 << 20
"""A run of blocks up to this size is checked in one reduction over its strided view (a call per
layer and K|V would cost more than the bytes); larger ones layer by layer, over contiguous memory."""


class KvCache:
    """Owns the pool tensor; zero-filled so padded reads never see NaNs."""

    def __init__(self, layout: KvLayout, device: torch.device) -> None:
        self.layout = layout
        self.tensor = torch.zeros(layout.shape, dtype=torch_dtype(layout.dtype), device=device)

    def layer(self, index: int) -> torch.Tensor:
        """``[2, blocks, slot, kv_heads, dim]`` view of one layer."""
        return self.tensor[index]

    def blocks_finite(self, block_ids: Sequence[int]) -> bool:
        """Whether every value of these blocks (all layers, K and V, every slot) is finite.

        One reduction per layer, K|V and run of consecutive blocks, each over contiguous memory
        (about 9 GB/s on one CPU core in bfloat16; a strided view of the same bytes reduces
        15-20 times slower). A sum is not finite when any term is not. In bfloat16 and float32 it
        sums in float32, which finite values overflow only when they are near float32's limit,
        values that would overflow attention's arithmetic anyway (and are refused with the rest);
        a float16 sum overflows at 65504, well within what KV holds, so there the extremes are
        taken instead.
        """
        t = self.tensor
        by_sum = t.dtype in (torch.bfloat16, torch.float32, torch.float64)

        def finite(chunk: torch.Tensor) -> bool:
            if by_sum:
                return bool(torch.isfinite(chunk.sum()))
            return bool(torch.isfinite(chunk.amax()) and torch.isfinite(chunk.amin()))

        for start, end in _runs(block_ids):
            run = t[:, :, start:end]
            if run.numel() * run.element_size() <= SMALL_CHECK_BYTES:  # one call: its cost is the call's
                if not finite(run):
                    return False
                continue
            for layer in range(t.shape[0]):
                for kv in range(2):
                    if not finite(t[layer, kv, start:end].reshape(-1)):
                        return False
        return True

    def clear_blocks(self, block_ids: Sequence[int]) -> None:
        """Zero these blocks in every layer (the pool's state before anything was written)."""
        for start, end in _runs(block_ids):
            self.tensor[:, :, start:end].zero_()

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


def _runs(block_ids: Sequence[int]) -> list[tuple[int, int]]:
    """``[start, end)`` ranges of consecutive ids, in the order given (``[3, 4, 7]``: ``[(3, 5), (7, 8)]``)."""
    runs: list[tuple[int, int]] = []
    for block in block_ids:
        if runs and runs[-1][1] == block:
            runs[-1] = (runs[-1][0], block + 1)
        else:
            runs.append((block, block + 1))
    return runs
