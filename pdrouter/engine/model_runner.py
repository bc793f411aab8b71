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
        """``[n_sample, vocab]`` float32 logits, one row per item with ``sample``, in item order.

        Every integer input of the step (token ids, positions, pool slots, block tables, the sampled
        rows) is packed into one host tensor and copied to the device once: each copy from pageable
        host memory waits for the device, so the six separate copies a step used to make held the host
        until the GPU had run the work queued before them (docs/simulation.md, "On a real GPU").
        """
        order = [i for i, it in enumerate(items) if len(it.token_ids) > 1]
        order += [i for i, it in enumerate(items) if len(it.token_ids) == 1]
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        segments: list[tuple[int, int, int, list[int] | None]] = []  # start, tokens, context, blocks
        last_index: dict[int, int] = {}
        bs = self.block_size
        n_prefill = len(items) - sum(1 for it in items if len(it.token_ids) == 1)
        for i in order[:n_prefill]:
            it = items[i]
            n, start = len(it.token_ids), len(ids)
            context = it.start + n
            blocks = list(it.block_ids[:blocks_for_tokens(context, bs)])
            positions.extend(range(it.start, context))
            slots.extend(blocks[p // bs] * bs + p % bs for p in range(it.start, context))
            ids.extend(it.token_ids)
            segments.append((start, n, context, blocks if it.start else None))
            last_index[i] = len(ids) - 1
        decode_items = order[n_prefill:]
        table: list[int] = []
        lengths: list[int] = []
        width = 0
        dec_start = len(ids)
        if decode_items:
            rows = []
            for i in decode_items:
                it = items[i]
                p = it.start
                positions.append(p)
                slots.append(it.block_ids[p // bs] * bs + p % bs)
                rows.append(list(it.block_ids[:p // bs + 1]))
                lengths.append(p + 1)
                ids.append(it.token_ids[0])
                last_index[i] = len(ids) - 1
            width = max(len(row) for row in rows)
            # Padded with the row's own last block: a masked slot still enters the sum as 0 × value,
            # so it must hold nothing but this request's (finite) KV; another request's could be NaN.
            for row in rows:
                table.extend(row + row[-1:] * (width - len(row)))
        sampled = [last_index[i] for i, it in enumerate(items) if it.sample]
        parts = [ids, positions, slots, table, lengths, sampled]
        parts += [blocks for *_, blocks in segments if blocks is not None]
        packed = torch.tensor([x for part in parts for x in part], dtype=torch.long).to(self.device)
        views = []
        offset = 0
        for part in parts:
            views.append(packed[offset:offset + len(part)])
            offset += len(part)
        input_ids, pos_t, slot_t, table_t, len_t, index = views[:6]
        block_views = iter(views[6:])
        prefills = tuple(
            PrefillSegment(start, n, context, None, None) if blocks is None else
            PrefillSegment(start, n, context, next(block_views), causal_prefix_mask(n, context, self.device))
            for start, n, context, blocks in segments)
        decode = None
        if decode_items:
            size = len(decode_items)
            mask = torch.arange(width * bs, device=self.device).unsqueeze(0) < len_t.unsqueeze(1)
            decode = DecodeBatch(dec_start, size, table_t.view(size, width), mask.view(size, 1, 1, width * bs))
        meta = AttentionMetadata(slot_mapping=slot_t, prefills=prefills, decode=decode)
        hidden = self.model(input_ids, pos_t, meta, self.kv_cache.tensor)
        return self.model.logits(hidden.index_select(0, index))
