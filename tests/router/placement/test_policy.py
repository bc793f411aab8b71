"""Placement policies on plain candidates: least loaded, cache-aware scoring, the balance guard."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, cast

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pdrouter.core.errors import ConfigError
from pdrouter.core.ids import Epoch, RequestId, WorkerId
from pdrouter.core.sampling import SamplingParams
from pdrouter.core.workers import WorkerLoad, WorkerRecord, WorkerRole
from pdrouter.router.placement.cache_aware import CacheAware, CacheAwareConfig
from pdrouter.router.placement.least_loaded import LeastLoaded
from pdrouter.router.placement.policies import POLICIES, make_policy
from pdrouter.router.placement.policy import backlog_tokens, displaced
from pdrouter.router.placement.worker_pool import KEEP_REPORTED_S, WorkerHandle
from pdrouter.router.request import RouterRequest


@dataclass
class Cand:
    worker_id: WorkerId
    load: WorkerLoad = field(default_factory=WorkerLoad)
    inflight: int = 0
    inflight_prefill_tokens: int = 0
    inflight_prefill_by_priority: dict[int, int] = field(default_factory=dict)
    assigned_tokens: int = 0
    schedules_by_priority: bool = True


def make_request(tokens: int = 1000) -> RouterRequest:
    return RouterRequest(RequestId("r"), "m", tuple(range(tokens)), SamplingParams(max_tokens=8))


def cands(*backlogs: int) -> list[Cand]:
    return [Cand(WorkerId(f"w{i}"), WorkerLoad(queued_prefill_tokens=b)) for i, b in enumerate(backlogs)]


@settings(max_examples=300, deadline=None)
@given(workers=st.lists(st.tuples(st.integers(0, 20_000), st.integers(0, 3_000), st.integers(0, 8), st.integers(0, 3),
                                  st.integers(0, 5_000)), min_size=1, max_size=6),
       prompt=st.integers(1, 3_000), priority=st.one_of(st.none(), st.integers(-1, 1)),
       running_weight=st.sampled_from([0.0, 50.0]))
def test_the_pick_is_the_least_score_with_its_tie_breaks(workers: list[tuple[int, int, int, int, int]], prompt: int,
                                                         priority: int | None, running_weight: float) -> None:
    """``pick_prefill`` against its definition: among the candidates within the balance guard, the
    least (score, tokens displaced, tokens assigned, worker id), the first of equals."""
    policy = CacheAware(CacheAwareConfig(running_weight_tokens=running_weight))
    c = [Cand(WorkerId(f"w{i % 3}{i}"), WorkerLoad(queued_prefill_tokens=q, running=r,
                                                   queued_prefill_by_priority=((1, q),) if q else ()),
              inflight=f, assigned_tokens=a) for i, (q, hit, r, f, a) in enumerate(workers)]
    cached = {h.worker_id: hit for h, (_, hit, *_) in zip(c, workers, strict=True)}
    request = make_request(prompt)
    backlogs = {h.worker_id: backlog_tokens(h, priority) for h in c}
    bound = 1.25 * (sum(backlogs.values()) / len(c)) + 4096
    eligible = [h for h in c if backlogs[h.worker_id] <= bound] or c
    behind = displaced(eligible, priority)
    expected = min(eligible, key=lambda h: (
        policy.score(prompt, cached[h.worker_id], backlogs[h.worker_id], h.load.running + h.inflight),
        behind.get(h.worker_id, ()), h.assigned_tokens, h.worker_id))
    assert policy.pick_prefill(request, c, cached, priority) is expected


def test_least_loaded_prefill_and_decode() -> None:
    policy = LeastLoaded()
    c = cands(500, 100, 300)
    assert policy.pick_prefill(make_request(), c).worker_id == "w1"
    c[1].inflight_prefill_tokens = 1000
    assert policy.pick_prefill(make_request(), c).worker_id == "w2"
    d = [Cand(WorkerId("a"), WorkerLoad(free_blocks=10)), Cand(WorkerId("b"), WorkerLoad(free_blocks=50))]
    assert policy.pick_decode(make_request(), d, 4).worker_id == "b"
    d[1].inflight = 11  # 50 - 11*4 = 6 < 10
    assert policy.pick_decode(make_request(), d, 4).worker_id == "a"


def test_cache_hit_beats_a_small_backlog() -> None:
    policy = CacheAware()
    c = cands(200, 0, 0)
    assert policy.pick_prefill(make_request(1000), c, {WorkerId("w0"): 960}).worker_id == "w0"


def test_backlog_beats_a_small_hit() -> None:
    policy = CacheAware()
    c = cands(900, 0)
    # w0 saves 100 tokens but has 900 queued: w1 is cheaper (1000 vs 900 + 900).
    assert policy.pick_prefill(make_request(1000), c, {WorkerId("w0"): 100}).worker_id == "w1"


def test_a_tiny_common_preamble_earns_no_credit() -> None:
    c = cands(0, 0)
    c[0].assigned_tokens = 5000  # w0 already got plenty
    assert CacheAware().pick_prefill(make_request(1000), c, {WorkerId("w0"): 32}).worker_id == "w1"
    assert CacheAware().pick_prefill(make_request(1000), c, {WorkerId("w0"): 64}).worker_id == "w0"


def test_balance_guard_stops_a_hot_prefix_from_collapsing_onto_one_worker() -> None:
    policy = CacheAware(CacheAwareConfig(backlog_weight=0.0, balance_factor=1.25, balance_slack_tokens=0))
    c = cands(10_000, 1_000, 1_000, 1_000)  # mean 3250, bound 4062: w0 is out
    assert policy.pick_prefill(make_request(1000), c, {WorkerId("w0"): 1000}).worker_id != "w0"
    # Everyone over the bound: the guard steps aside rather than refusing.
    assert policy.pick_prefill(make_request(1000), cands(0), {}).worker_id == "w0"


def test_ties_are_deterministic_and_spread() -> None:
    c = cands(0, 0, 0)
    assert CacheAware().pick_prefill(make_request(), c).worker_id == "w0"
    c[0].assigned_tokens = 500
    c[1].assigned_tokens = 200
    assert CacheAware().pick_prefill(make_request(), c).worker_id == "w2"
    assert LeastLoaded().pick_prefill(make_request(), c).worker_id == "w2"


def test_policies_are_made_by_name() -> None:
    weights = CacheAwareConfig(min_hit_tokens=8)
    made = make_policy("cache_aware", weights)
    assert isinstance(made, CacheAware) and made.config is weights and made.name == "cache_aware"
    assert type(make_policy("least_loaded")) is LeastLoaded and make_policy("least_loaded").name == "least_loaded"
    assert POLICIES == ("least_loaded", "cache_aware")
    with pytest.raises(ConfigError) as raised:
        make_policy("round_robin")
    assert str(raised.value) == "unknown placement policy 'round_robin': use one of least_loaded, cache_aware"


def test_a_prompt_is_placed_by_the_backlog_it_would_wait_for() -> None:
    # w0: 4,000 tokens queued, all of a flood past its share (priority 1); w1: 1,000 at priority 0.
    c = [Cand(WorkerId("w0"), WorkerLoad(queued_prefill_tokens=4000, queued_prefill_by_priority=((1, 4000),))),
         Cand(WorkerId("w1"), WorkerLoad(queued_prefill_tokens=1000, queued_prefill_by_priority=((0, 1000),)))]
    for policy in (LeastLoaded(), CacheAware()):
        # A standard prompt (0) waits for none of w0's queue, all of w1's.
        assert policy.pick_prefill(make_request(), c, {}, priority=0).worker_id == "w0"
        # One of the flood's (1) waits for both queues: the smaller wins; so without a priority.
        assert policy.pick_prefill(make_request(), c, {}, priority=1).worker_id == "w1"
        assert policy.pick_prefill(make_request(), c, {}).worker_id == "w1"
    # What this router sent since the last report counts the same way.
    c[1].load = WorkerLoad()
    c[1].inflight_prefill_tokens = 500
    c[1].inflight_prefill_by_priority = {0: 500}
    assert LeastLoaded().pick_prefill(make_request(), c, {}, priority=0).worker_id == "w0"
    c[1].inflight_prefill_by_priority = {2: 500}
    assert LeastLoaded().pick_prefill(make_request(), c, {}, priority=0).worker_id == "w1"  # both 0 ahead; less behind
    # A worker whose engine does not schedule by priority (vLLM first come, first served): all of it is ahead.
    c[0].schedules_by_priority = False
    c[1].inflight_prefill_by_priority = {0: 500}
    assert LeastLoaded().pick_prefill(make_request(), c, {}, priority=0).worker_id == "w1"


def test_a_prompt_pushes_back_the_least_important_work() -> None:
    # An interactive prompt (-2) waits for neither queue; w0's holds a standard prompt (0), w1's a
    # flood's past-share prompts (1), twice as many tokens: w1's are the ones to push back.
    c = [Cand(WorkerId("w0"), WorkerLoad(queued_prefill_tokens=2048, queued_prefill_by_priority=((0, 2048),))),
         Cand(WorkerId("w1"), WorkerLoad(queued_prefill_tokens=4096, queued_prefill_by_priority=((1, 4096),)))]
    for policy in (LeastLoaded(), CacheAware()):
        assert policy.pick_prefill(make_request(), c, {}, priority=-2).worker_id == "w1"
        assert policy.pick_prefill(make_request(), c, {}, priority=0).worker_id == "w1"  # w0's is ahead of it
        assert policy.pick_prefill(make_request(), c, {}).worker_id == "w0"  # by the whole backlog
    # A worker with nothing queued behind beats both.
    c.append(Cand(WorkerId("w2"), WorkerLoad()))
    assert LeastLoaded().pick_prefill(make_request(), c, {}, priority=-2).worker_id == "w2"


def test_equal_priorities_place_as_before() -> None:
    c = cands(500, 100, 300)
    for cand, queued in zip(c, (500, 100, 300), strict=True):
        cand.load = WorkerLoad(queued_prefill_tokens=queued, queued_prefill_by_priority=((0, queued),))
    c[2].assigned_tokens = -1
    for policy in (LeastLoaded(), CacheAware()):
        assert policy.pick_prefill(make_request(), c, {}, priority=0) is policy.pick_prefill(make_request(), c, {})
        assert policy.pick_prefill(make_request(), c, {WorkerId("w0"): 960}, priority=0) is \
            policy.pick_prefill(make_request(), c, {WorkerId("w0"): 960})


def test_a_handle_counts_what_it_sent_by_priority_until_settled() -> None:
    record = WorkerRecord(worker_id=WorkerId("p0"), role=WorkerRole.PREFILL, address="127.0.0.1:1", epoch=Epoch(1),
                          model="m", model_compat_hash="m", kv_compat_hash="k", block_size=16, capacity_blocks=8,
                          engine="sim")
    handle = WorkerHandle(record, WorkerLoad(), cast(Any, None))
    assert handle.schedules_by_priority
    first = handle.charge_prefill(300, 0, priority=1)
    second = handle.charge_prefill(200, 100, priority=0)
    third = handle.charge_prefill(100, 0, priority=1)
    assert (handle.inflight, handle.inflight_prefill_tokens, handle.assigned_tokens) == (3, 600, 500)
    assert handle.inflight_prefill_by_priority == {1: 400, 0: 200}
    assert [backlog_tokens(handle, p) for p in (-1, 0, 1, None)] == [0, 200, 600, 600]
    handle.settle_prefill(first)
    handle.settle_prefill(second)
    assert handle.inflight_prefill_by_priority == {1: 100}
    handle.settle_prefill(third)
    assert (handle.inflight, handle.inflight_prefill_tokens, handle.inflight_prefill_by_priority) == (0, 0, {})
    # vLLM's record does not say it schedules by priority: everything sent is ahead of every prompt.
    vllm = WorkerHandle(dataclasses.replace(record, engine="vllm"), WorkerLoad(), cast(Any, None))
    vllm.charge_prefill(300, 0, priority=1)
    assert not vllm.schedules_by_priority and backlog_tokens(vllm, -2) == 300


def timed_handle() -> WorkerHandle:
    record = WorkerRecord(worker_id=WorkerId("p0"), role=WorkerRole.PREFILL, address="127.0.0.1:1", epoch=Epoch(1),
                          model="m", model_compat_hash="m", kv_compat_hash="k", block_size=16, capacity_blocks=8,
                          engine="sim")
    return WorkerHandle(record, WorkerLoad(taken_at=1.0), cast(Any, None))


def test_a_prompt_queued_in_a_heartbeat_counts_once_and_not_after_its_report(monkeypatch: pytest.MonkeyPatch) -> None:
    """The handle's own prompts in a worker's load: counted by the handle while in flight, never twice, and
    not at all once reported, though the load that holds them is still the last one read."""
    clock = [10.0]
    monkeypatch.setattr("pdrouter.router.placement.worker_pool.time.time", lambda: clock[0])
    handle = timed_handle()
    mine = handle.charge_prefill(300, 0)  # placed at 10.0
    clock[0] = 10.5  # the worker takes its load: 300 of this router's + 200 of another's queued
    handle.set_load(WorkerLoad(queued_prefill_tokens=500, taken_at=10.5))
    clock[0] = 10.8
    later = handle.charge_prefill(100, 0)  # placed after the load was taken: not in it
    assert handle.reported.queued_prefill_tokens == 500  # the report itself stays as it came
    assert backlog_tokens(handle) == 200 + 300 + 100
    handle.settle_prefill(mine)  # reported at 10.8: the load read last still holds it, and it is done
    assert backlog_tokens(handle) == 200 + 100
    clock[0] = 11.0  # a load taken before the report, read after it: the prompt is still in it
    handle.set_load(WorkerLoad(queued_prefill_tokens=600, taken_at=10.7))
    assert backlog_tokens(handle) == 300 + 100  # 600 less this router's 300; the 100 placed since, in flight
    clock[0] = 12.0  # a load taken after the report: the prompt is gone from it, and forgotten here
    handle.set_load(WorkerLoad(queued_prefill_tokens=100, taken_at=11.9))
    assert backlog_tokens(handle) == 0 + 100 and len(handle.own) == 1
    handle.settle_prefill(later)  # at 12.0
    clock[0] = 12.5
    handle.set_load(WorkerLoad(queued_prefill_tokens=0, taken_at=12.4))
    assert backlog_tokens(handle) == 0 and len(handle.own) == 0


def test_a_load_without_a_time_is_taken_as_it_is_and_keeps_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    """A static worker's load (asked over gRPC) says nothing of when it was taken: this router's prompts are
    added to it, as before, and a reported prompt is forgotten at once; a clock ahead of the router's
    counts as now."""
    clock = [10.0]
    monkeypatch.setattr("pdrouter.router.placement.worker_pool.time.time", lambda: clock[0])
    handle = timed_handle()
    handle.set_load(WorkerLoad(queued_prefill_tokens=400))
    charge = handle.charge_prefill(300, 0)
    handle.set_load(WorkerLoad(queued_prefill_tokens=400))
    assert backlog_tokens(handle) == 700
    handle.settle_prefill(charge)
    assert len(handle.own) == 0 and backlog_tokens(handle) == 400
    ahead = handle.charge_prefill(300, 0)
    handle.set_load(WorkerLoad(queued_prefill_tokens=400, taken_at=99.0))  # the worker's clock runs ahead
    assert backlog_tokens(handle) == 100 + 300
    handle.settle_prefill(ahead)
    clock[0] = 11.0
    handle.set_load(WorkerLoad(queued_prefill_tokens=0, taken_at=10.9))
    assert len(handle.own) == 0


def test_the_own_prompts_come_out_of_each_priority_they_were_queued_at(monkeypatch: pytest.MonkeyPatch) -> None:
    clock = [10.0]
    monkeypatch.setattr("pdrouter.router.placement.worker_pool.time.time", lambda: clock[0])
    handle = timed_handle()
    handle.charge_prefill(300, 0, priority=1)
    handle.charge_prefill(200, 0, priority=0)
    clock[0] = 10.5
    handle.set_load(WorkerLoad(queued_prefill_tokens=900, queued_prefill_by_priority=((0, 250), (1, 650)),
                               taken_at=10.5))
    assert handle.load.queued_prefill_by_priority == ((0, 50), (1, 350))
    assert [backlog_tokens(handle, p) for p in (-1, 0, 1, None)] == [0, 250, 900, 900]


def test_a_reported_prompt_is_kept_no_longer_than_a_heartbeat_can_live(monkeypatch: pytest.MonkeyPatch) -> None:
    """The same load read again and again (the registry unreachable: the last known loads are kept) keeps
    no reported prompt past ``KEEP_REPORTED_S``."""
    clock = [10.0]
    monkeypatch.setattr("pdrouter.router.placement.worker_pool.time.time", lambda: clock[0])
    handle = timed_handle()
    handle.set_load(WorkerLoad(queued_prefill_tokens=0, taken_at=10.0))
    for _ in range(300):  # 30 s of them
        clock[0] += 0.1
        handle.settle_prefill(handle.charge_prefill(50, 0))
        handle.set_load(handle.reported)
    assert 0 < len(handle.own) <= KEEP_REPORTED_S / 0.1 + 1
    clock[0] += KEEP_REPORTED_S + 1
    handle.set_load(handle.reported)
    assert len(handle.own) == 0
