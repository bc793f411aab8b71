"""Sampling: filters give exact distributions; seeded requests are reproducible in any batch."""

from __future__ import annotations

import math
import random

import pytest
import torch

from pdrouter.core.sampling import SamplingParams
from pdrouter.engine.sampler import filtered_probs, make_generator, sample

from .engine_testing import EngineFactory, random_prompt

LOGITS = torch.tensor([0.0, 1.0, 2.0, 3.0])


def test_top_k_keeps_the_k_largest() -> None:
    probs = filtered_probs(LOGITS, SamplingParams(top_k=2))
    expected = torch.softmax(torch.tensor([2.0, 3.0]), dim=0)
    torch.testing.assert_close(probs, torch.cat([torch.zeros(2), expected]))


def test_top_p_keeps_the_smallest_set_reaching_p() -> None:
    full = torch.softmax(LOGITS, dim=0)  # [0.032, 0.087, 0.237, 0.644]
    torch.testing.assert_close(filtered_probs(LOGITS, SamplingParams(top_p=0.5)), torch.tensor([0, 0, 0, 1.0]))
    two = filtered_probs(LOGITS, SamplingParams(top_p=0.8))
    torch.testing.assert_close(two, torch.tensor([0, 0, full[2] / (full[2] + full[3]), full[3] / (full[2] + full[3])]))
    torch.testing.assert_close(filtered_probs(LOGITS, SamplingParams(top_p=1.0)), full)


def test_temperature_sharpens_and_flattens() -> None:
    cold = filtered_probs(LOGITS, SamplingParams(temperature=0.5))
    torch.testing.assert_close(cold, torch.softmax(LOGITS * 2, dim=0))
    hot = filtered_probs(LOGITS, SamplingParams(temperature=4.0))
    assert hot.max() < cold.max()


def test_greedy_rows_take_the_argmax_in_a_mixed_batch() -> None:
    logits = torch.tensor([[0.0, 5.0, 1.0], [3.0, 0.0, 0.0], [0.0, 0.0, 9.0]])
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=1.0, top_k=1, seed=1),
              SamplingParams(temperature=0.0)]
    assert sample(logits, params, [make_generator(p) for p in params]) == [1, 0, 2]


def test_seeded_draws_repeat_and_ignore_the_rest_of_the_batch() -> None:
    logits = torch.randn(1, 64, generator=torch.Generator().manual_seed(0))
    params = SamplingParams(temperature=1.0, seed=42)

    def draws(neighbours: int) -> list[int]:
        gen = make_generator(params)
        batch = torch.cat([logits, torch.randn(neighbours, 64)])
        others = [SamplingParams(temperature=1.0)] * neighbours
        out = []
        for _ in range(30):
            out.append(sample(batch, [params, *others], [gen, *[make_generator(p) for p in others]])[0])
        return out

    first = draws(0)
    assert first == draws(3)
    assert len(set(first)) > 5
    other_seed = make_generator(SamplingParams(temperature=1.0, seed=43))
    assert [sample(logits, [params], [other_seed])[0] for _ in range(30)] != first


def test_draws_stay_inside_top_k() -> None:
    logits = torch.randn(1, 100, generator=torch.Generator().manual_seed(1))
    allowed = set(torch.topk(logits[0], 5).indices.tolist())
    params = SamplingParams(temperature=5.0, top_k=5, seed=3)
    gen = make_generator(params)
    seen = {sample(logits, [params], [gen])[0] for _ in range(300)}
    assert seen == allowed


@pytest.mark.parametrize("neighbours", [0, 3])
def test_seeded_request_output_does_not_depend_on_the_batch(make_engine: EngineFactory, neighbours: int) -> None:
    engine = make_engine()
    rng = random.Random(11)
    prompt = random_prompt(rng, 12)
    seeded = SamplingParams(max_tokens=16, temperature=0.8, top_p=0.9, top_k=50, seed=1234, ignore_eos=True)
    alone = engine.generate([prompt], seeded)[0]
    others = [random_prompt(rng, rng.randrange(1, 30)) for _ in range(neighbours)]
    mixed = engine.generate([*others, prompt], [SamplingParams(max_tokens=10, temperature=1.0)] * neighbours
                            + [seeded])[-1]
    assert mixed == alone
    greedy = engine.generate([prompt], SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True))[0]
    assert alone != greedy


@pytest.mark.parametrize("temperature", [1e-39, 5e-324, 1e-30, 9.99e-6])
def test_temperatures_below_the_greedy_threshold_are_greedy(make_engine: EngineFactory, temperature: float) -> None:
    """Dividing by such a temperature overflows; vLLM treats every temperature below 1e-5 as greedy."""
    params = SamplingParams(temperature=temperature, max_tokens=6, ignore_eos=True)
    assert params.greedy and not SamplingParams(temperature=1e-5).greedy
    assert make_generator(params) is None
    engine = make_engine()
    prompt = random_prompt(random.Random(2), 9)
    assert engine.generate([prompt], params) == \
        engine.generate([prompt], SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True))


def test_rows_that_cannot_be_sampled_give_none_and_the_rest_are_sampled() -> None:
    logits = torch.tensor([[0.0, 5.0, 1.0], [math.nan, 0.0, 0.0], [0.0, math.inf, 9.0], [1.0, 0.0, 0.0],
                           [-math.inf, -math.inf, -math.inf], [0.0, 3.0e38, 1.0]])
    greedy = SamplingParams(temperature=0.0)
    assert sample(logits, [greedy] * 6, [None] * 6) == [1, None, None, 0, None, 1]
    # Random rows: the same verdicts, and a finite row whose scaled logits overflow is refused too.
    hot = [SamplingParams(temperature=1e-5, top_k=1, seed=i) for i in range(6)]
    assert sample(logits, hot, [make_generator(p) for p in hot]) == [1, None, None, 0, None, None]
    mixed = [greedy, hot[1], greedy, hot[3], greedy, greedy]
    assert sample(logits, mixed, [make_generator(p) for p in mixed]) == [1, None, None, 0, None, 1]
