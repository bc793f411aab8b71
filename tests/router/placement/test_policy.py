"""Placement policies on plain candidates: least loaded, cache-aware scoring, the balance guard."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from pdrouter.core.errors import ConfigError
from pdrouter.core.ids import RequestId, WorkerId
from pdrouter.core.sampling import SamplingParams
from pdrouter.core.workers import WorkerLoad
from pdrouter.router.placement.cache_aware import CacheAware, CacheAwareConfig
from pdrouter.router.placement.least_loaded import LeastLoaded
from pdrouter.router.placement.policies import POLICIES, make_policy
from pdrouter.router.request import RouterRequest


@dataclass
class Cand:
    worker_id: WorkerId
    load: WorkerLoad = field(default_factory=WorkerLoad)
    inflight: int = 0
    inflight_prefill_tokens: int = 0
    assigned_tokens: int = 0


def make_request(tokens: int = 1000) -> RouterRequest:
    return RouterRequest(RequestId("r"), "m", tuple(range(tokens)), SamplingParams(max_tokens=8))


def cands(*backlogs: int) -> list[Cand]:
    return [Cand(WorkerId(f"w{i}"), WorkerLoad(queued_prefill_tokens=b)) for i, b in enumerate(backlogs)]


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
