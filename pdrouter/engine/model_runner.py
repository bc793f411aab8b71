"""Turns one step's scheduled work into tensors, runs the model, returns the logits to sample from.

Pure bookkeeping around :class:`~pdrouter.engine.model.LlamaModel`: token ids, positions, pool slots and
block tables are built on the CPU and moved to the model's device in one go.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from pdrouter.core.capacity import blocks_for_tokens
from pdrouter.engine.attention import AttentionMetadata, DecodeBatch, PrefillSegment, causal_prefix_mask
from pdrouter.engine.kv_cache import KvCache
from pdrouter.engine.model import LlamaModel


@dataclass(frozen=True)
class WorkItem:
    """Compute ``token_ids`` at positions ``start ..``; ``block_ids`` cover every position up to the last."""

    token_ids: Sequence[int]
    start: int
    block_ids: Sequence[int]
    sample: bool


class ModelRunner:
    def __init__(self, model: LlamaModel, kv_cache: KvCache) -> None:
        self.model = model
        self.kv_cache = kv_cache
        self.block_size = kv_cache.layout.block_size
        self.device = kv_cache.tensor.device

    def run(self, items: Sequence[WorkItem]) -> torch.Tensor:
        """``[n_sample, vocab]`` float32 logits, one row per item with ``sample``, in item order."""
        order = [i for i, it in enumerate(items) if len(it.token_ids) > 1]
        order += [i for i, it in enumerate(items) if len(it.token_ids) == 1]
        ids: list[int] = []
        prefills: list[PrefillSegment] = []
        positions: list[torch.Tensor] = []
        slots: list[torch.Tensor] = []
        last_index: dict[int, int] = {}
        bs = self.block_size
        n_prefill = len(items) - sum(1 for it in items if len(it.token_ids) == 1)
        for i in order[:n_prefill]:
            it = items[i]
            n, start = len(it.token_ids), len(ids)
            context = it.start + n
            pos = torch.arange(it.start, context)
            blocks = torch.tensor(list(it.block_ids[:blocks_for_tokens(context, bs)]), dtype=torch.long)
            slots.append(blocks[pos // bs] * bs + pos % bs)
            positions.append(pos)
            ids.extend(it.token_ids)
            if it.start == 0:
                prefills.append(PrefillSegment(start, n, context, None, None))
            else:
                prefills.append(PrefillSegment(start, n, context, blocks.to(self.device),
                                               causal_prefix_mask(n, context, self.device)))
            last_index[i] = len(ids) - 1
        decode = None
        decode_items = order[n_prefill:]
        if decode_items:
            start = len(ids)
            dec_pos, dec_slots, table, lengths = [], [], [], []
            for i in decode_items:
                it = items[i]
                p = it.start
                dec_pos.append(p)
                dec_slots.append(it.block_ids[p // bs] * bs + p % bs)
                table.append(list(it.block_ids[:p // bs + 1]))
                lengths.append(p + 1)
                ids.append(it.token_ids[0])
                last_index[i] = len(ids) - 1
            width = max(len(row) for row in table)
            # Padded with the row's own last block: a masked slot still enters the sum as 0 × value,
            # so it must hold nothing but this request's (finite) KV; another request's could be NaN.
            padded = torch.tensor([row + row[-1:] * (width - len(row)) for row in table], dtype=torch.long)
            mask = torch.arange(width * bs).unsqueeze(0) < torch.tensor(lengths).unsqueeze(1)
            decode = DecodeBatch(start, len(decode_items), padded.to(self.device),
                                 mask.view(len(decode_items), 1, 1, width * bs).to(self.device))
            positions.append(torch.tensor(dec_pos, dtype=torch.long))
            slots.append(torch.tensor(dec_slots, dtype=torch.long))
        meta = AttentionMetadata(slot_mapping=torch.cat(slots).to(self.device), prefills=tuple(prefills),
                                 decode=decode)
        input_ids = torch.tensor(ids, dtype=torch.long).to(self.device)
        hidden = self.model(input_ids, torch.cat(positions).to(self.device), meta, self.kv_cache.tensor)
        rows = [last_index[i] for i, it in enumerate(items) if it.sample]
        index = torch.tensor(rows, dtype=torch.long).to(self.device)
        return self.model.logits(hidden.index_select(0, index))
