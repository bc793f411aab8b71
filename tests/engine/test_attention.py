"""Paged attention against plain causal attention, with scattered block tables."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pdrouter.engine.attention import (
    AttentionMetadata,
    DecodeBatch,
    PrefillSegment,
    causal_prefix_mask,
    masked_attention,
    paged_attention,
)

HEADS, KV_HEADS, DIM, BS, NUM_BLOCKS = 4, 2, 8, 4, 32
SCALE = DIM ** -0.5


def dense(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Causal attention of a whole sequence, ``[n, heads, dim]``."""
    rep = HEADS // KV_HEADS
    out = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1).repeat_interleave(rep, 0),
                                         v.transpose(0, 1).repeat_interleave(rep, 0), is_causal=True)
    return out.transpose(0, 1)


def slots(blocks: list[int], start: int, end: int) -> torch.Tensor:
    return torch.tensor([blocks[p // BS] * BS + p % BS for p in range(start, end)])


def qkv(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(n, HEADS, DIM, generator=g), torch.randn(n, KV_HEADS, DIM, generator=g),
            torch.randn(n, KV_HEADS, DIM, generator=g))


def empty_cache() -> tuple[torch.Tensor, torch.Tensor]:
    kv = torch.zeros(2, NUM_BLOCKS, BS, KV_HEADS, DIM)
    return kv[0], kv[1]


def test_causal_prefix_mask() -> None:
    assert causal_prefix_mask(2, 4, torch.device("cpu")).tolist() == [[True, True, True, False],
                                                                      [True, True, True, True]]


def test_prefill_after_cached_prefix_and_decode_batch_match_dense() -> None:
    k_cache, v_cache = empty_cache()
    lengths = [37, 1, 16, 9]
    tables = [[17, 3, 30, 8, 0, 21, 5, 12, 27, 2], [11], [6, 29, 14, 19], [23, 1, 31]]
    seqs = [qkv(n, seed) for seed, n in enumerate(lengths)]
    expected = [dense(*s) for s in seqs]
    # Step 1: seq 0 computes its first 20 tokens (no prefix), seqs 1-3 all but their last token.
    items = [(0, 0, 20), (2, 0, 15), (3, 0, 8)]
    q = torch.cat([seqs[i][0][a:b] for i, a, b in items])
    k = torch.cat([seqs[i][1][a:b] for i, a, b in items])
    v = torch.cat([seqs[i][2][a:b] for i, a, b in items])
    segs, off = [], 0
    for _, a, b in items:
        segs.append(PrefillSegment(off, b - a, b, None, None))
        off += b - a
    meta = AttentionMetadata(torch.cat([slots(tables[i], a, b) for i, a, b in items]), tuple(segs), None)
    out = paged_attention(q, k, v, k_cache, v_cache, meta, SCALE)
    for (i, a, b), seg in zip(items, segs, strict=True):
        torch.testing.assert_close(out[seg.start:seg.start + seg.num_tokens], expected[i][a:b])
    # Step 2: seq 0 computes tokens 20..37 over its cached prefix; seqs 1-3 decode one token each.
    decodes = [(1, 0), (2, 15), (3, 8)]
    q = torch.cat([seqs[0][0][20:]] + [seqs[i][0][p:p + 1] for i, p in decodes])
    k = torch.cat([seqs[0][1][20:]] + [seqs[i][1][p:p + 1] for i, p in decodes])
    v = torch.cat([seqs[0][2][20:]] + [seqs[i][2][p:p + 1] for i, p in decodes])
    width = max(len(tables[i][: p // BS + 1]) for i, p in decodes)
    table = torch.tensor([tables[i][: p // BS + 1] + [0] * (width - p // BS - 1) for i, p in decodes])
    mask = torch.arange(width * BS).unsqueeze(0) < torch.tensor([p + 1 for _, p in decodes]).unsqueeze(1)
    prefix_blocks = torch.tensor(tables[0][: -(-37 // BS)])
    meta = AttentionMetadata(
        torch.cat([slots(tables[0], 20, 37)] + [slots(tables[i], p, p + 1) for i, p in decodes]),
        (PrefillSegment(0, 17, 37, prefix_blocks, causal_prefix_mask(17, 37, torch.device("cpu"))),),
        DecodeBatch(17, 3, table, mask.view(3, 1, 1, width * BS)))
    out = paged_attention(q, k, v, k_cache, v_cache, meta, SCALE)
    torch.testing.assert_close(out[:17], expected[0][20:])
    for row, (i, p) in enumerate(decodes):
        torch.testing.assert_close(out[17 + row], expected[i][p])


def test_writes_land_in_the_named_slots_only() -> None:
    k_cache, v_cache = empty_cache()
    q, k, v = qkv(3, 9)
    meta = AttentionMetadata(torch.tensor([4 * BS + 1, 7 * BS, 7 * BS + 3]),
                             (PrefillSegment(0, 3, 3, None, None),), None)
    paged_attention(q, k, v, k_cache, v_cache, meta, SCALE)
    assert torch.equal(k_cache[4, 1], k[0]) and torch.equal(v_cache[7, 0], v[1])
    assert torch.equal(k_cache[7, 3], k[2])
    assert int((k_cache != 0).any(-1).any(-1).sum()) == 3


def test_a_masked_chunk_attends_the_same_with_its_kv_heads_repeated_as_with_grouped_heads() -> None:
    """The path a CUDA device takes (KV heads repeated for the fused masked kernel) is the grouped one."""
    q, k, v = qkv(23, 4)
    ctx_k, ctx_v = k.transpose(0, 1).unsqueeze(0), v.transpose(0, 1).unsqueeze(0)
    qs = q[-7:].transpose(0, 1).unsqueeze(0)
    mask = causal_prefix_mask(7, 23, torch.device("cpu"))
    grouped = masked_attention(qs, ctx_k, ctx_v, mask, SCALE, expand_heads=False)
    repeated = masked_attention(qs, ctx_k, ctx_v, mask, SCALE, expand_heads=True)
    torch.testing.assert_close(repeated, grouped)
    torch.testing.assert_close(grouped.squeeze(0).transpose(0, 1), dense(q, k, v)[-7:])
