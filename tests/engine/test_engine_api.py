"""The workers' contract: prefill-only requests, remote-KV requests, abort, events, threads.

Tests taking ``make_any_engine`` run on the torch engine and on the simulated one (the contract
suite); those taking ``make_engine`` check the torch engine's tensors and logits.
"""

from __future__ import annotations

import queue
import random
import threading
from collections.abc import Callable, Sequence
from typing import Any

import pytest
import torch

from pdrouter.core.errors import CapacityError, FailedPreconditionError, NotFoundError
from pdrouter.core.hashing import BlockHasher
from pdrouter.core.ids import RequestId
from pdrouter.core.kv_layout import KvLayout
from pdrouter.core.sampling import SamplingParams
from pdrouter.engine.batch_engine import BatchEngine, StepWork
from pdrouter.engine.events import RecordingBlockEventSink
from pdrouter.engine.outputs import FinishReason, PrefillResult, RequestOutput
from pdrouter.engine.torch_engine import TorchEngine

from .dense_reference import dense_greedy
from .engine_testing import AnyEngineFactory, EngineFactory, assert_no_leak, random_prompt, rid

GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


class StepRunning:
    """An engine's model step with ``run`` replaced: put in the engine's place, not patched into the
    step itself (a compiled build's objects have read-only methods)."""

    def __init__(self, step: Any, run: Callable[[Sequence[StepWork]], list[int]]) -> None:
        self._step = step
        self.run = run

    def __getattr__(self, name: str) -> Any:
        return getattr(self._step, name)


def drain(engine: BatchEngine, max_steps: int = 500) -> list[RequestOutput]:
    outs: list[RequestOutput] = []
    for _ in range(max_steps):
        step = engine.step()
        outs.extend(step)
        if not step and not engine.stats().num_running and not engine.stats().num_waiting:
            return outs
    raise AssertionError("the engine did not go idle")


def prefill(engine: BatchEngine, prompt: Sequence[int], params: SamplingParams = GREEDY) -> PrefillResult:
    r = rid("prefill")
    engine.add_prefill_request(r, prompt, params)
    outs = drain(engine)
    assert [o.request_id for o in outs] == [r]
    (out,) = outs
    assert out.finished and out.finish_reason is FinishReason.PREFILLED and out.prefill is not None
    assert out.new_token_ids == (out.prefill.first_token,)
    return out.prefill


def ship(src: TorchEngine, result: PrefillResult, dst: TorchEngine, reservation_blocks: Sequence[int],
         num_cached: int) -> None:
    """Copy the prompt's KV from the prefill pool into the reserved blocks, skipping cached ones."""
    data = src.kv_cache.export_blocks(result.block_ids[num_cached:])
    dst.kv_cache.import_blocks(reservation_blocks[num_cached:], data)


def test_kv_tensor_has_the_shared_layout(make_engine: EngineFactory) -> None:
    engine = make_engine(num_blocks=10, block_size=8)
    expected = KvLayout.for_model(engine.spec, num_blocks=10, block_size=8, dtype="float32")
    assert engine.kv_layout == expected
    assert tuple(engine.kv_tensor.shape) == expected.shape == (2, 2, 10, 8, 2, 16)
    assert engine.kv_tensor.dtype == torch.float32 and engine.kv_tensor.is_contiguous()


def test_prefill_only_holds_blocks_until_release(make_any_engine: AnyEngineFactory) -> None:
    engine = make_any_engine()
    prompt = random_prompt(random.Random(0), 37)
    result = prefill(engine, prompt)
    assert result.token_ids == tuple(prompt)
    assert len(result.block_ids) == 3 and result.num_cached_blocks == 0
    if isinstance(engine, TorchEngine):
        assert result.first_token == dense_greedy(engine.model, prompt, 1)[0]
    assert 0 <= result.first_token < engine.spec.vocab_size
    assert result.block_hashes == tuple(BlockHasher(16).hash_blocks(prompt))
    assert result.finish_after_first_token is None
    stats = engine.stats()
    assert (stats.num_held, stats.num_free_blocks) == (1, 61)
    assert all(engine.block_manager.ref_count(b) == 1 for b in result.block_ids)
    assert engine.step() == []
    engine.release(result.request_id)
    with pytest.raises(NotFoundError):
        engine.release(result.request_id)
    assert_no_leak(engine)


def test_prefill_reports_when_the_first_token_ends_the_request(make_any_engine: AnyEngineFactory) -> None:
    engine = make_any_engine()
    result = prefill(engine, [1, 2, 3], SamplingParams(max_tokens=1, temperature=0.0))
    assert result.finish_after_first_token is FinishReason.LENGTH
    engine.release(result.request_id)


def test_disaggregated_round_trip_equals_colocated_greedy(make_engine: EngineFactory) -> None:
    prefill_engine, decode_engine = make_engine(), make_engine(num_blocks=32)
    rng = random.Random(5)
    shared = random_prompt(rng, 40)
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    for i, tail in enumerate([random_prompt(rng, 9), random_prompt(rng, 30)]):
        prompt = shared + tail
        result = prefill(prefill_engine, prompt, params)
        r = RequestId(f"remote-{i}")
        reservation = decode_engine.reserve_remote(r, prompt, params)
        # The second request reuses the two full blocks of the shared prefix committed by the first.
        assert reservation.num_cached_blocks == (0 if i == 0 else 2)
        assert len(reservation.block_ids) == -(-len(prompt) // 16)
        assert decode_engine.stats().num_awaiting_kv == 1
        ship(prefill_engine, result, decode_engine, reservation.block_ids, reservation.num_cached_blocks)
        prefill_engine.release(result.request_id)
        assert decode_engine.commit_remote(r, result.first_token) is None
        outs = drain(decode_engine)
        got = [result.first_token] + [t for o in outs for t in o.new_token_ids]
        assert got == dense_greedy(decode_engine.model, prompt, 10)
        assert outs[-1].finished and outs[-1].num_output_tokens == 10
        assert outs[0].num_cached_tokens == reservation.num_cached_tokens


def test_commit_remote_when_the_first_token_ends_it(make_any_engine: AnyEngineFactory) -> None:
    engine = make_any_engine()
    eos = engine.eos_token_ids[0]
    a, b = rid(), rid()
    engine.reserve_remote(a, [1, 2, 3], SamplingParams(max_tokens=5, temperature=0.0))
    engine.reserve_remote(b, [1, 2, 3], SamplingParams(max_tokens=1, temperature=0.0))
    assert engine.commit_remote(a, eos) is FinishReason.STOP
    assert engine.commit_remote(b, 65) is FinishReason.LENGTH
    assert engine.step() == []
    with pytest.raises(NotFoundError):
        engine.commit_remote(a, 65)


def test_commit_remote_requires_a_reservation(make_any_engine: AnyEngineFactory) -> None:
    engine = make_any_engine()
    r = rid()
    engine.add_request(r, [1, 2, 3], GREEDY)
    with pytest.raises(FailedPreconditionError):
        engine.commit_remote(r, 5)
    with pytest.raises(FailedPreconditionError):
        engine.release(r)
    with pytest.raises(NotFoundError):
        engine.commit_remote(rid(), 5)
    engine.abort(r)


def test_reserve_remote_refuses_when_short_and_allocates_nothing(make_any_engine: AnyEngineFactory) -> None:
    engine = make_any_engine(num_blocks=6)
    held = engine.reserve_remote(rid(), list(range(60)), SamplingParams(max_tokens=4))
    assert len(held.block_ids) == 4
    with pytest.raises(CapacityError, match="no room"):
        engine.reserve_remote(rid(), list(range(100, 140)), SamplingParams(max_tokens=4))
    stats = engine.stats()
    assert (stats.num_free_blocks, stats.num_awaiting_kv) == (2, 1)
    engine.abort(held.request_id)


def test_abort_in_every_state_frees_everything(make_any_engine: AnyEngineFactory) -> None:
    engine = make_any_engine(max_num_batched_tokens=16)
    rng = random.Random(6)
    waiting, prefilling, decoding, held, awaiting = (rid() for _ in range(5))
    engine.add_request(decoding, random_prompt(rng, 5), GREEDY)
    engine.step()
    engine.add_request(prefilling, random_prompt(rng, 60), GREEDY)
    engine.step()  # 60-token prompt: first 15-token chunk only (budget 16, one decode)
    engine.add_prefill_request(held, random_prompt(rng, 10), GREEDY)
    engine.reserve_remote(awaiting, random_prompt(rng, 20), GREEDY)
    engine.add_request(waiting, random_prompt(rng, 5), GREEDY)
    states = {r.request_id: r.state.value for r in engine._requests.values()}
    assert states == {decoding: "running", prefilling: "running", held: "waiting", awaiting: "awaiting_kv",
                      waiting: "waiting"}
    for r in (waiting, prefilling, decoding, awaiting):
        assert engine.abort(r)
    assert not engine.abort(waiting)
    outs = drain(engine)
    assert {o.request_id for o in outs} == {held}
    engine.abort(held)
    assert engine.step() == []
    assert_no_leak(engine)


def test_abort_during_the_model_step_frees_after_it(make_any_engine: AnyEngineFactory,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    engine = make_any_engine()
    victim, other = rid(), rid()
    engine.add_request(victim, [1, 2, 3, 4], GREEDY)
    engine.add_request(other, [5, 6, 7], GREEDY)
    real_run = engine.model_step.run
    seen: list[int] = []

    def run_and_abort(work: Sequence[StepWork]) -> list[int]:
        assert engine.abort(victim)
        seen.append(engine.stats().num_free_blocks)  # the victim's block is still held mid-step
        return real_run(work)

    step = engine.model_step
    monkeypatch.setattr(engine, "model_step", StepRunning(step, run_and_abort))
    outs = engine.step()
    monkeypatch.setattr(engine, "model_step", step)
    assert seen == [62]
    assert [o.request_id for o in outs] == [other]
    assert engine.stats().num_free_blocks == 63
    drain(engine)


def test_preempted_requests_do_not_leak_and_abort_cleanly(make_any_engine: AnyEngineFactory) -> None:
    engine = make_any_engine(num_blocks=8)
    rng = random.Random(7)
    ids = [rid() for _ in range(4)]
    for r in ids:
        engine.add_request(r, random_prompt(rng, 20), SamplingParams(max_tokens=40, ignore_eos=True,
                                                                    temperature=0.0))
    for _ in range(30):
        engine.step()
    assert engine.stats().num_preemptions > 0
    for r in ids:
        engine.abort(r)
    assert_no_leak(engine)


def test_block_events_follow_the_prefix_cache(make_any_engine: AnyEngineFactory) -> None:
    sink = RecordingBlockEventSink()
    engine = make_any_engine(num_blocks=6, event_sink=sink)
    hasher = BlockHasher(16)
    first = random_prompt(random.Random(8), 40)
    (tokens,) = engine.generate([first], SamplingParams(max_tokens=9, temperature=0.0, ignore_eos=True))
    full = first + tokens
    # 48 of the 49 tokens were computed: the prefill stored two full blocks, decoding a third.
    hashes = hasher.hash_blocks(full[:48])
    assert sink.events == [("stored", tuple(hashes[:2])), ("stored", (hashes[2],))]
    assert engine.cached_prefix_tokens(full) == 48
    # An unrelated 6-block request evicts all three, least recently used first: the tail first.
    engine.generate([random_prompt(random.Random(9), 90)], SamplingParams(max_tokens=1, temperature=0.0))
    removed = [h for kind, hs in sink.events if kind == "removed" for h in hs]
    assert removed == list(reversed(hashes))
    assert sink.live == {engine.block_manager.block_hash(b) for b in range(6)} - {None}


def test_request_threads_and_a_driver_thread(make_engine: EngineFactory) -> None:
    engine = make_engine(max_num_batched_tokens=32)
    rng = random.Random(10)
    prompts = {rid(): random_prompt(rng, rng.randrange(1, 40)) for _ in range(12)}
    outputs: queue.Queue[RequestOutput] = queue.Queue()
    stop = threading.Event()

    def drive() -> None:
        while not stop.is_set():
            if engine.wait_for_work(timeout=0.01):
                for out in engine.step():
                    outputs.put(out)

    def submit(ids: list[RequestId]) -> None:
        for r in ids:
            engine.add_request(r, prompts[r], GREEDY)

    driver = threading.Thread(target=drive)
    driver.start()
    keys = list(prompts)
    submitters = [threading.Thread(target=submit, args=(keys[i::3],)) for i in range(3)]
    for t in submitters:
        t.start()
    for t in submitters:
        t.join()
    got: dict[RequestId, list[int]] = {r: [] for r in prompts}
    finished = 0
    while finished < len(prompts):
        out = outputs.get(timeout=60)
        got[out.request_id].extend(out.new_token_ids)
        finished += out.finished
    stop.set()
    driver.join()
    for r, prompt in prompts.items():
        assert got[r] == dense_greedy(engine.model, prompt, GREEDY.max_tokens)


def test_wait_for_work_and_backlog(make_any_engine: AnyEngineFactory) -> None:
    engine = make_any_engine(num_blocks=4, max_num_batched_tokens=16)
    assert not engine.wait_for_work(timeout=0)
    held = prefill(engine, list(range(60)))  # holds all 4 blocks
    r = rid()
    engine.add_request(r, [1, 2, 3], GREEDY)
    assert engine.queued_prefill_tokens() == 3
    assert engine.wait_for_work(timeout=0)
    assert engine.step() == []  # no block free: nothing can run
    assert not engine.wait_for_work(timeout=0)  # stalled until something changes
    engine.release(held.request_id)
    assert engine.wait_for_work(timeout=0)
    drain(engine)
    assert engine.queued_prefill_tokens() == 0


def test_the_backlog_by_priority(make_any_engine: AnyEngineFactory) -> None:
    engine = make_any_engine(num_blocks=4, max_num_batched_tokens=16)
    held = prefill(engine, list(range(60)))  # holds all 4 blocks: what follows waits
    assert engine.queued_prefill_by_priority() == ()
    engine.add_request(rid(), [1, 2, 3], GREEDY, priority=1)
    engine.add_request(rid(), [4, 5], GREEDY, priority=-2)
    engine.add_request(rid(), [6, 7, 8, 9], GREEDY, priority=1)
    assert engine.queued_prefill_by_priority() == ((-2, 2), (1, 7))
    assert engine.queued_prefill_tokens() == 9
    engine.release(held.request_id)
    drain(engine)
    assert engine.queued_prefill_by_priority() == ()


def test_a_failed_model_step_can_be_retried(make_any_engine: AnyEngineFactory,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    engine = make_any_engine()
    r = rid()
    params = SamplingParams(max_tokens=3, temperature=0.0)
    engine.add_request(r, [9, 8, 7, 6], params)

    def broken(work: Sequence[StepWork]) -> list[int]:
        raise RuntimeError("device lost")

    step = engine.model_step
    monkeypatch.setattr(engine, "model_step", StepRunning(step, broken))
    with pytest.raises(RuntimeError, match="device lost"):
        engine.step()
    monkeypatch.setattr(engine, "model_step", step)
    (tokens,) = [[t for o in drain(engine) for t in o.new_token_ids]]
    # The retry gives what an engine that never failed gives.
    assert tokens == make_any_engine().generate([[9, 8, 7, 6]], params)[0]
    if isinstance(engine, TorchEngine):
        assert tokens == dense_greedy(engine.model, [9, 8, 7, 6], 3, engine.eos_token_ids)
