"""Greedy outputs of the paged, batched engine equal the dense reference token for token."""

from __future__ import annotations

import random

import pytest

from pdrouter.core.ids import RequestId
from pdrouter.core.sampling import SamplingParams
from pdrouter.core.tokens import PackedPrompt, pack_token_ids
from pdrouter.engine.outputs import FinishReason, RequestOutput
from pdrouter.engine.torch_engine import TorchEngine

from .dense_reference import dense_greedy
from .engine_testing import EngineFactory, rid

LENGTHS = [1, 7, 16, 31, 33, 64, 100]
MAX_TOKENS = [12, 5, 9, 1, 14, 8, 10]


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0)


def run(engine: TorchEngine, requests: dict[RequestId, tuple[list[int], SamplingParams]],
        packed: bool = False) -> dict[RequestId, list[RequestOutput]]:
    """Serve ``requests`` to the end; ``packed``: each prompt as the worker protocol brings it (packed
    bytes the engine reads from: a step unpacks only the span it computes)."""
    for request_id, (prompt, params) in requests.items():
        engine.add_request(request_id, PackedPrompt(pack_token_ids(prompt), max(prompt)) if packed else prompt, params)
    outputs: dict[RequestId, list[RequestOutput]] = {r: [] for r in requests}
    while any(not o or not o[-1].finished for o in outputs.values()):
        for out in engine.step():
            outputs[out.request_id].append(out)
    return outputs


def tokens(outs: list[RequestOutput]) -> list[int]:
    return [t for o in outs for t in o.new_token_ids]


def reference(engine: TorchEngine, prompt: list[int], max_tokens: int) -> list[int]:
    return dense_greedy(engine.model, prompt, max_tokens, engine.eos_token_ids)


@pytest.mark.parametrize("budget", [2048, 24], ids=["unchunked", "chunked"])
@pytest.mark.parametrize("prefix_hits", [False, True], ids=["cold", "prefix-hits"])
@pytest.mark.parametrize("packed", [False, True], ids=["ids", "packed"])
def test_mixed_batch_matches_dense_reference(make_engine: EngineFactory, budget: int, prefix_hits: bool,
                                             packed: bool) -> None:
    engine = make_engine(num_blocks=96, max_num_batched_tokens=budget)
    rng = random.Random(1)
    shared = [rng.randrange(256) for _ in range(40)]
    prompts = [[rng.randrange(256) for _ in range(n)] for n in LENGTHS]
    if prefix_hits:
        # Warm the cache: a 45-token prompt sharing 40 tokens with four of the batch (2 full blocks
        # hit), one sharing 32 tokens with prompts[5], and prompts[6] itself (hit capped at 96 of 100
        # tokens: the last block must be computed to sample from it).
        warm = [[*shared, 1, 2, 3, 4, 5], [*prompts[5][:32], 1, 2, 3], prompts[6]]
        run(engine, {rid(): (p, greedy(2)) for p in warm}, packed)
        prompts = [shared + p for p in prompts[:4]] + prompts[4:]
    batch = {rid(): (p, greedy(m)) for p, m in zip(prompts, MAX_TOKENS, strict=True)}
    outputs = run(engine, batch, packed)
    for request_id, (prompt, params) in batch.items():
        assert tokens(outputs[request_id]) == reference(engine, prompt, params.max_tokens), request_id
    cached = [outputs[r][0].num_cached_tokens for r in batch]
    if prefix_hits:
        assert cached == [32, 32, 32, 32, 0, 32, 96]
    else:
        assert cached == [0] * len(LENGTHS)


def test_requests_joining_and_leaving_between_steps(make_engine: EngineFactory) -> None:
    engine = make_engine(num_blocks=64, max_num_batched_tokens=20)
    rng = random.Random(2)
    arrivals = {0: 2, 3: 1, 4: 2, 9: 1}  # step -> how many requests arrive before it
    expected: dict[RequestId, list[int]] = {}
    got: dict[RequestId, list[int]] = {}
    step = 0
    while step < 10 or engine.has_unfinished_requests():
        for _ in range(arrivals.get(step, 0)):
            prompt = [rng.randrange(256) for _ in range(rng.randrange(1, 50))]
            params = greedy(rng.randrange(1, 12))
            r = rid()
            engine.add_request(r, prompt, params)
            expected[r] = reference(engine, prompt, params.max_tokens)
            got[r] = []
        for out in engine.step():
            got[out.request_id].extend(out.new_token_ids)
        step += 1
    assert got == expected


@pytest.mark.parametrize("packed", [False, True], ids=["ids", "packed"])
def test_preemption_recomputes_and_still_matches(make_engine: EngineFactory, packed: bool) -> None:
    # 5 requests of 30 + 40 tokens need 5 blocks each (25), the pool has 12: preemption must happen.
    engine = make_engine(num_blocks=12, max_num_batched_tokens=64)
    rng = random.Random(3)
    batch = {rid(): ([rng.randrange(256) for _ in range(30)], SamplingParams(max_tokens=40, temperature=0.0,
                                                                           ignore_eos=True))
             for _ in range(5)}
    outputs = run(engine, batch, packed)
    assert engine.stats().num_preemptions > 0  # recomputed: spans across the prompt and the tokens sampled
    for request_id, (prompt, params) in batch.items():
        expect = dense_greedy(engine.model, prompt, params.max_tokens)
        assert tokens(outputs[request_id]) == expect
        assert outputs[request_id][-1].finish_reason is FinishReason.LENGTH


def test_stop_tokens_eos_and_max_tokens(make_engine: EngineFactory) -> None:
    engine = make_engine()
    prompt = [5, 6, 7, 8, 9]
    full = dense_greedy(engine.model, prompt, 20)
    stop = full[6]
    first_stop = full.index(stop)
    outs = run(engine, {(a := rid()): (prompt, SamplingParams(max_tokens=20, temperature=0.0,
                                                               stop_token_ids=(stop,))),
                        (b := rid()): (prompt, greedy(3))})
    assert tokens(outs[a]) == full[:first_stop + 1]
    assert outs[a][-1].finish_reason is FinishReason.STOP
    assert [o.finished for o in outs[a]] == [False] * first_stop + [True]
    assert tokens(outs[b]) == full[:3] and outs[b][-1].finish_reason is FinishReason.LENGTH
    assert [o.num_output_tokens for o in outs[b]] == [1, 2, 3]


def test_eos_ends_generation_unless_ignored(make_engine: EngineFactory) -> None:
    engine = make_engine()
    eos = engine.eos_token_ids[0]
    # Find a prompt whose greedy continuation hits eos within 40 tokens (deterministic search).
    rng = random.Random(4)
    for _ in range(200):
        prompt = [rng.randrange(256) for _ in range(8)]
        full = dense_greedy(engine.model, prompt, 40)
        if eos in full:
            break
    else:
        pytest.fail("no prompt reaches eos")
    stop_at = full.index(eos)
    outs = run(engine, {(a := rid()): (prompt, greedy(40)),
                        (b := rid()): (prompt, SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True))})
    assert tokens(outs[a]) == full[:stop_at + 1] and outs[a][-1].finish_reason is FinishReason.STOP
    assert tokens(outs[b]) == full
