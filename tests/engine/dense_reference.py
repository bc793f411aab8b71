"""A plain dense reference: the same weights, no paging, no batching, no cache.

Every step recomputes the whole sequence with ordinary causal attention (K/V heads repeated for
grouped-query attention), so it shares nothing with the engine's attention, pool or scheduler.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence

import torch
import torch.nn.functional as F

from pdrouter.engine.model import DecoderLayer, LlamaModel, apply_rotary


@torch.inference_mode()
def dense_logits(model: LlamaModel, tokens: Sequence[int]) -> torch.Tensor:
    """``[len(tokens), vocab]`` float32 logits of a causal forward over ``tokens``."""
    spec = model.spec
    device = model.embed.weight.device
    ids = torch.tensor(list(tokens), dtype=torch.long, device=device)
    n = ids.shape[0]
    heads, kv_heads, dim = spec.num_heads, spec.num_kv_heads, spec.head_dim
    x = model.embed(ids)
    cos, sin = model.rotary.tables(torch.arange(n, device=device), x.dtype)
    for layer in model.layers:
        assert isinstance(layer, DecoderLayer)
        h = layer.input_norm(x)
        q, k, v = layer.attn.qkv(h).split((heads * dim, kv_heads * dim, kv_heads * dim), dim=-1)
        q = apply_rotary(q.view(n, heads, dim), cos, sin).transpose(0, 1)
        k = apply_rotary(k.view(n, kv_heads, dim), cos, sin).transpose(0, 1)
        v = v.reshape(n, kv_heads, dim).transpose(0, 1)
        k = k.repeat_interleave(heads // kv_heads, dim=0)
        v = v.repeat_interleave(heads // kv_heads, dim=0)
        attn = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + layer.attn.o(attn.transpose(0, 1).reshape(n, heads * dim))
        x = x + layer.mlp(layer.post_attn_norm(x))
    return model.logits(model.norm(x))


def dense_greedy(model: LlamaModel, prompt: Sequence[int], max_tokens: int,
                 stop_ids: Collection[int] = ()) -> list[int]:
    """Greedy continuation of ``prompt``: at most ``max_tokens`` tokens, ending at a stop id."""
    tokens = list(prompt)
    out: list[int] = []
    for _ in range(max_tokens):
        token = int(dense_logits(model, tokens)[-1].argmax())
        out.append(token)
        tokens.append(token)
        if token in stop_ids:
            break
    return out
