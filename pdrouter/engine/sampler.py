"""Next-token sampling: greedy, temperature, top-k, top-p, per-request seeded generators.

Greedy rows are decided on the model's device in one ``argmax``. Random rows move to the CPU and
are sampled one by one with the request's own ``torch.Generator``, so a seeded request draws the
same tokens whatever else is in the batch, on whichever device the model runs.
Order of the filters: temperature, then top-k, then top-p (the smallest set of most likely tokens
whose probability reaches ``top_p``; the most likely token is always kept).

A row that cannot be sampled, its logits (or, once scaled by the temperature, its scaled logits)
holding a NaN or an infinity, gets None instead of a token: that request fails alone. Greedy rows
find out from the maximum the ``argmax`` computes anyway; random rows check theirs before drawing.
"""

from __future__ import annotations

import math
import secrets
from collections.abc import Sequence

import torch

from pdrouter.core.sampling import SamplingParams


def make_generator(params: SamplingParams) -> torch.Generator | None:
    """The request's CPU generator (None for greedy); unseeded requests get a random seed."""
    if params.greedy:
        return None
    seed = params.seed if params.seed is not None else secrets.randbits(63)
    return torch.Generator(device="cpu").manual_seed(seed)


def filtered_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor | None:
    """Probabilities of one ``[vocab]`` float32 row after temperature, top-k and top-p; None when the
    scaled logits' maximum is not finite (a NaN, an infinity, or all of them ``-inf``)."""
    scaled = logits / params.temperature
    if not torch.isfinite(scaled.max()):
        return None
    vocab = scaled.shape[-1]
    if 0 < params.top_k < vocab:
        kth = torch.topk(scaled, params.top_k).values[-1]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    probs = torch.softmax(scaled, dim=-1)
    if params.top_p < 1.0:
        sorted_probs, order = torch.sort(probs, descending=True)
        before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs
        drop_sorted = before >= params.top_p
        drop_sorted[0] = False
        drop = torch.zeros_like(drop_sorted).scatter(0, order, drop_sorted)
        probs = probs.masked_fill(drop, 0.0)
        probs = probs / probs.sum()
    return probs


def _argmax(logits: torch.Tensor) -> list[int | None]:
    """Greedy tokens of ``[rows, vocab]`` logits; None for a row whose maximum is not finite
    (``max`` propagates NaN, and finds the same index as ``argmax``)."""
    values, indices = logits.max(dim=-1)
    # Checked in Python: a torch.where over the maxima costs more than the argmax itself on a CPU row.
    return [int(t) if math.isfinite(v) else None for t, v in zip(indices.tolist(), values.tolist(), strict=True)]


def sample(logits: torch.Tensor, params: Sequence[SamplingParams],
           generators: Sequence[torch.Generator | None]) -> list[int | None]:
    """One token per row of ``[rows, vocab]`` float32 logits (None: that row cannot be sampled)."""
    tokens: list[int | None] = [0] * len(params)
    if not params:
        return tokens
    greedy = [i for i, p in enumerate(params) if p.greedy]
    if len(greedy) == len(params):
        return _argmax(logits)
    if greedy:
        rows = torch.tensor(greedy, device=logits.device)
        for i, t in zip(greedy, _argmax(logits.index_select(0, rows)), strict=True):
            tokens[i] = t
    cpu_logits = logits.float().cpu()
    for i, p in enumerate(params):
        if p.greedy:
            continue
        probs = filtered_probs(cpu_logits[i], p)
        tokens[i] = None if probs is None else int(torch.multinomial(probs, 1, generator=generators[i]).item())
    return tokens
