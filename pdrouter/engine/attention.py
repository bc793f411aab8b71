"""Attention over the paged KV pool.

Per layer the pool is two tensors ``k_cache, v_cache`` of shape ``[num_blocks, block_size, kv_heads,
head_dim]`` (views of the engine's one pool tensor, see ``pdrouter.core.kv_layout``). One model step
processes a flat batch of tokens, prefill segments first, then single-token decodes:

* every new token's K and V are written to its slot (``block_id * block_size + offset``);
* a prefill segment (a whole prompt or one chunk, possibly after a cached prefix) attends
  causally to its sequence's context, gathered from the pool when part of it was computed earlier;
* all decodes attend together: their block tables are padded to one width, gathered in one
  indexing operation and masked by context length (grouped-query heads share the gathered K/V).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class PrefillSegment:
    """A run of ``num_tokens`` tokens of one sequence at flat offset ``start``."""

    start: int
    num_tokens: int
    context_len: int
    """Tokens the segment attends to: the earlier computed ones plus its own."""
    block_ids: torch.Tensor | None
    """Blocks covering ``context_len`` (None when the segment is the whole context)."""
    mask: torch.Tensor | None
    """``[num_tokens, context_len]`` bool, True where attention is allowed (None: plain causal)."""


@dataclass(frozen=True)
class DecodeBatch:
    """``size`` single-token queries at flat offsets ``start .. start + size``."""

    start: int
    size: int
    block_table: torch.Tensor
    """``[size, max_blocks]`` block ids, right-padded with the row's own last block (masked, but a
    masked slot enters the sum as 0 × value: it must hold a finite value of this request's)."""
    mask: torch.Tensor
    """``[size, 1, 1, max_blocks * block_size]`` bool, True for positions below the context length."""


@dataclass(frozen=True)
class AttentionMetadata:
    """Everything attention needs for one step, shared by all layers."""

    slot_mapping: torch.Tensor
    """``[num_tokens]`` pool slot of each new token."""
    prefills: tuple[PrefillSegment, ...]
    decode: DecodeBatch | None


def causal_prefix_mask(num_tokens: int, context_len: int, device: torch.device) -> torch.Tensor:
    """Causal mask of ``num_tokens`` queries ending a ``context_len`` context (query i sees keys <= i)."""
    offset = context_len - num_tokens
    q_pos = torch.arange(num_tokens, device=device).unsqueeze(1) + offset
    k_pos = torch.arange(context_len, device=device).unsqueeze(0)
    return k_pos <= q_pos


def write_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Store each token's K and V (``[tokens, kv_heads, head_dim]``) in its pool slot."""
    kv_heads, head_dim = k_cache.shape[-2:]
    k_cache.view(-1, kv_heads, head_dim).index_copy_(0, slot_mapping, k)
    v_cache.view(-1, kv_heads, head_dim).index_copy_(0, slot_mapping, v)


def _gather(cache: torch.Tensor, block_ids: torch.Tensor, length: int) -> torch.Tensor:
    """``[length, kv_heads, head_dim]`` context of one sequence."""
    return cache[block_ids].flatten(0, 1)[:length]


def _prefill(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
             v_cache: torch.Tensor, seg: PrefillSegment, scale: float) -> torch.Tensor:
    # Four-dimensional ([1, heads, tokens, dim]) operands: the fused CUDA kernels (FlashAttention,
    # memory-efficient) take nothing else, and three-dimensional ones fall back to the float32 math
    # path, 10x slower at 8k tokens on an H200 (docs/simulation.md, "On a real GPU").
    end = seg.start + seg.num_tokens
    qs = q[seg.start:end].transpose(0, 1).unsqueeze(0)
    if seg.block_ids is None:
        ks, vs = k[seg.start:end].transpose(0, 1).unsqueeze(0), v[seg.start:end].transpose(0, 1).unsqueeze(0)
        out = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=scale, enable_gqa=True)
    else:
        ks = _gather(k_cache, seg.block_ids, seg.context_len).transpose(0, 1).unsqueeze(0)
        vs = _gather(v_cache, seg.block_ids, seg.context_len).transpose(0, 1).unsqueeze(0)
        out = masked_attention(qs, ks, vs, seg.mask, scale, expand_heads=qs.is_cuda)
    return out.squeeze(0).transpose(0, 1)


def masked_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
                     scale: float, expand_heads: bool) -> torch.Tensor:
    """``[batch, heads, tokens, dim]`` attention of ``q`` over grouped ``k``/``v`` (``[batch, kv_heads, ...]``)
    under a boolean ``mask``. ``expand_heads`` repeats each KV head for its query heads first: the fused
    CUDA kernel that takes a mask (memory-efficient attention) has no grouped-query mode, and without
    it the call falls back to the float32 math path."""
    if expand_heads and q.shape[1] != k.shape[1]:
        group = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True)


def _decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, batch: DecodeBatch,
            scale: float) -> torch.Tensor:
    num_heads, head_dim = q.shape[-2:]
    kv_heads = k_cache.shape[-2]
    size, width = batch.size, batch.mask.shape[-1]
    # One KV head's group of query heads is that head's queries: [size, kv_heads, group, dim] against
    # keys [size, kv_heads, width, dim] is plain multi-head attention, which the fused masked kernel
    # runs on the gathered blocks as they lie (a strided view, no copy, no grouped-query mode needed).
    # Laying the keys out width-last for a hand-written product instead cost a transposing copy that
    # took 4x as long as the rest of a batch-128 decode's attention on an H200.
    qs = q[batch.start:batch.start + batch.size].view(size, kv_heads, num_heads // kv_heads, head_dim)
    keys = k_cache[batch.block_table].view(size, width, kv_heads, head_dim).transpose(1, 2)
    values = v_cache[batch.block_table].view(size, width, kv_heads, head_dim).transpose(1, 2)
    out = F.scaled_dot_product_attention(qs, keys, values, attn_mask=batch.mask, scale=scale)
    return out.reshape(size, num_heads, head_dim)


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                    v_cache: torch.Tensor, meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """Write this step's K/V into the pool, then attend; returns ``[tokens, heads, head_dim]``.

    ``q`` is ``[tokens, heads, head_dim]``; ``k`` and ``v`` are ``[tokens, kv_heads, head_dim]``.
    """
    write_kv(k, v, k_cache, v_cache, meta.slot_mapping)
    if meta.decode is not None and not meta.prefills:
        return _decode(q, k_cache, v_cache, meta.decode, scale)
    out = torch.empty_like(q)
    for seg in meta.prefills:
        out[seg.start:seg.start + seg.num_tokens] = _prefill(q, k, v, k_cache, v_cache, seg, scale)
    if meta.decode is not None:
        d = meta.decode
        out[d.start:d.start + d.size] = _decode(q, k_cache, v_cache, d, scale)
    return out
