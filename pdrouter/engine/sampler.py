"""Next-token sampling: greedy, temperature, top-k, top-p, per-request seeded generators.

Greedy rows are decided on the model's device in one ``argmax``. Random rows move to the CPU and
are sampled one by one with the request's own ``torch.Generator``, so a seeded request draws the
same tokens whatever else is in the batch, on whichever device the model runs.
Order of the filters: temperature, then top-k, then top-p (the smallest set of most likely tokens
whose probability reaches ``top_p``; the most likely token is always kept).
"""

from __future__ import annotations

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


def filtered_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Probabilities of one ``[vocab]`` float32 row after temperature, top-k and top-p."""
    scaled = logits / params.temperature
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


def sample(logits: torch.Tensor, params: Sequence[SamplingParams],
           generators: Sequence[torch.Generator | None]) -> list[int]:
    """One token per row of ``[rows, vocab]`` float32 logits."""
    tokens: list[int] = [0] * len(params)
    if not params:
        return tokens
    greedy = [i for i, p in enumerate(params) if p.greedy]
    if len(greedy) == len(params):
        return [int(t) for t in logits.argmax(dim=-1).tolist()]
    if greedy:
        rows = torch.tensor(greedy, device=logits.device)
        for i, t in zip(greedy, logits.index_select(0, rows).argmax(dim=-1).tolist(), strict=True):
            tokens[i] = int(t)
    cpu_logits = logits.float().cpu()
    for i, p in enumerate(params):
        if p.greedy:
            continue
        gen = generators[i]
        probs = filtered_probs(cpu_logits[i], p)
        tokens[i] = int(torch.multinomial(probs, 1, generator=gen).item())
    return tokens
