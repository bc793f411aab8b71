"""A failing request fails alone: values that are not finite end that request, the batch and the engine go on.

The torch engine, with its pool written directly where a test needs a value that is not finite
(the model itself, on random weights, never gives one).
"""

from __future__ import annotations

import math
import random

import pytest
import torch

from pdrouter.core.errors import TransferError
from pdrouter.core.ids import RequestId
from pdrouter.core.kv_layout import KvLayout
from pdrouter.core.sampling import SamplingParams
from pdrouter.engine.faults import INJECTED, EngineFault, FaultyStep
from pdrouter.engine.kv_cache import KvCache
from pdrouter.engine.outputs import FinishReason, RequestOutput

from .dense_reference import dense_greedy
from .engine_testing import AnyEngineFactory, EngineFactory, random_prompt, rid
from .test_engine_api import drain, prefill, ship

GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


def tokens_of(outs: list[RequestOutput], request_id: RequestId) -> list[int]:
    return [t for o in outs if o.request_id == request_id for t in o.new_token_ids]


def test_non_finite_logits_fail_that_request_alone_and_its_blocks_are_cleared(make_engine: EngineFactory) -> None:
    engine = make_engine()
    rng = random.Random(3)
    bad = rid("bad")
    engine.add_request(bad, random_prompt(rng, 5), GREEDY)  # first in: its block is block 0
    good = {rid("good"): random_prompt(rng, n) for n in (20, 37, 3)}  # longer: the decode table pads
    for r, prompt in good.items():
        engine.add_request(r, prompt, GREEDY)
    outs = engine.step()  # every prompt computed; each request has its first token
    assert sorted(o.request_id for o in outs) == sorted([bad, *good])
    (block,) = engine._requests[bad].block_ids  # the test's one reach inside: where the bad KV goes
    assert block == 0
    engine.kv_tensor[0, 1, block, 2, 1, 5] = math.nan  # one V value the bad request reads at its next step
    outs += drain(engine)
    (failed,) = [o for o in outs if o.request_id == bad and o.finished]
    assert failed.finish_reason is FinishReason.ERROR and failed.new_token_ids == ()
    assert failed.error is not None and "not finite" in failed.error
    assert len(tokens_of(outs, bad)) == 1  # the token sampled before the bad value
    for r, prompt in good.items():  # the rest of the batch: exactly what the model gives alone
        assert tokens_of(outs, r) == dense_greedy(engine.model, prompt, GREEDY.max_tokens)
    assert torch.isfinite(engine.kv_tensor).all()  # the bad block was cleared, not left for the next owner
    assert engine.block_manager.block_hash(block) is None
    again = rid("again")  # and the engine serves on
    engine.add_request(again, [7, 8, 9], GREEDY)
    assert tokens_of(drain(engine), again) == dense_greedy(engine.model, [7, 8, 9], GREEDY.max_tokens)


@pytest.mark.parametrize("where", ["K", "V", "last slot"])
@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf])
def test_received_kv_that_is_not_finite_is_refused_and_cleared(make_engine: EngineFactory, where: str,
                                                               value: float) -> None:
    prefill_engine, decode_engine = make_engine(), make_engine(num_blocks=32)
    prompt = random_prompt(random.Random(11), 40)  # three blocks, the last one partly filled
    result = prefill(prefill_engine, prompt, GREEDY)
    r = rid("remote")
    reservation = decode_engine.reserve_remote(r, prompt, GREEDY)
    ship(prefill_engine, result, decode_engine, reservation.block_ids, 0)
    prefill_engine.release(result.request_id)
    kv, slot = (1, 15) if where == "last slot" else ("KV".index(where), 3)  # slot 15: past the prompt's end
    decode_engine.kv_tensor[1, kv, reservation.block_ids[-1], slot, 0, 0] = value
    with pytest.raises(TransferError, match="not finite"):
        decode_engine.check_remote_kv(r)
    with pytest.raises(TransferError, match="not finite"):  # and no commit uses it unchecked
        decode_engine.commit_remote(r, result.first_token)
    assert all(decode_engine.kv_tensor[:, :, b].eq(0).all() for b in reservation.block_ids)
    assert decode_engine.abort(r)
    # Clean KV into the same blocks is taken, and decodes exactly.
    r2 = rid("remote")
    again = decode_engine.reserve_remote(r2, prompt, GREEDY)
    ship(prefill_engine, prefill(prefill_engine, prompt, GREEDY), decode_engine, again.block_ids, 0)
    for held in list(prefill_engine._requests):
        prefill_engine.release(held)
    decode_engine.check_remote_kv(r2)
    assert decode_engine.commit_remote(r2, result.first_token) is None
    got = [result.first_token, *tokens_of(drain(decode_engine), r2)]
    assert got == dense_greedy(decode_engine.model, prompt, GREEDY.max_tokens)


@pytest.mark.parametrize("heads", [2, 64], ids=["small-runs", "runs-over-1MiB"])  # one reduction / one per layer
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_the_pool_check_finds_one_bad_value_in_any_dtype(dtype: str, heads: int) -> None:
    layout = KvLayout(num_layers=3, num_kv_heads=heads, head_dim=128, block_size=16, num_blocks=12, dtype=dtype)
    cache = KvCache(layout, torch.device("cpu"))
    big = 1e4 if dtype == "float16" else 1e30  # finite, and their float16 sum overflows: no false alarm
    cache.tensor[:, :, 2:9] = big
    assert cache.blocks_finite([2, 3, 4, 7, 8])
    for value in (math.nan, math.inf, -math.inf):
        cache.tensor[2, 1, 7, 3, 1, 7] = value
        assert not cache.blocks_finite([2, 3, 4, 7, 8])
        assert cache.blocks_finite([2, 3, 4, 8])  # other blocks are not looked at
        cache.clear_blocks([7])
        assert cache.tensor[:, :, 7].eq(0).all() and cache.blocks_finite([2, 3, 4, 7, 8])
        assert cache.tensor[:, :, 8].eq(big).all()


def test_an_injected_request_fault_fails_that_request_alone(make_any_engine: AnyEngineFactory) -> None:
    engine = make_any_engine()
    engine.model_step = FaultyStep(engine.model_step, EngineFault("request-fails", 400))
    fine, doomed = rid("fine"), rid("doomed")
    engine.add_request(fine, [65, 66, 67], GREEDY)
    engine.add_request(doomed, [65, 400, 67], GREEDY)
    outs = drain(engine)
    (failed,) = [o for o in outs if o.request_id == doomed]
    assert failed.finished and failed.finish_reason is FinishReason.ERROR and failed.error == INJECTED.reason
    assert len(tokens_of(outs, fine)) == GREEDY.max_tokens
    assert tokens_of(outs, fine) == make_any_engine().generate([[65, 66, 67]], GREEDY)[0]
