"""The measured window: the rule, the figures over it, and the drain it leaves out (pure, no server).

The records come from two small models of a server, exact by construction: ``unbounded`` serves every
request in a fixed time, ``slots`` holds at most ``slots`` requests at once for ``service_s`` each
(first come, first served), so its capacity is ``slots / service_s``.
"""

from __future__ import annotations

import heapq
import math
import random

import pytest

from pdrouter.bench.stats import RequestRecord, Slo, summarize
from pdrouter.bench.window import MIN_REQUESTS, measure_window, offered_rate, saturated, window_summary


def poisson(rate: float, n: int, seed: int = 1) -> list[float]:
    rng = random.Random(seed)
    t, out = 0.0, []
    for _ in range(n):
        out.append(t)
        t += rng.expovariate(rate)
    return out


def record(i: int, start: float, e2e: float, *, ttft: float = 0.05, tokens: int = 10) -> RequestRecord:
    gap = (e2e - ttft) / (tokens - 1)
    return RequestRecord(index=i, start_s=start, input_tokens=100, output_tokens=tokens, ttft_s=ttft,
                         itl_s=[gap] * (tokens - 1), e2e_s=e2e, status=200)


def unbounded(arrivals: list[float], e2e: float) -> list[RequestRecord]:
    return [record(i, t, e2e) for i, t in enumerate(arrivals)]


def slots(arrivals: list[float], slots: int, service_s: float) -> list[RequestRecord]:
    free = [0.0] * slots  # when each slot frees up
    out = []
    for i, t in enumerate(arrivals):
        begin = max(t, heapq.heappop(free))
        heapq.heappush(free, begin + service_s)
        out.append(record(i, t, begin + service_s - t, ttft=begin - t + 0.05))
    return out


def test_the_window_opens_after_the_warm_up_and_closes_at_the_last_arrival() -> None:
    arrivals = poisson(5.0, 500)
    w = measure_window(unbounded(arrivals, e2e=2.0))
    span = arrivals[-1] - arrivals[0]
    assert w.steady and w.reason == ""
    assert w.start_s == pytest.approx(0.1 * span)  # 10% of ~100 s beats one lifetime (2 s)
    assert w.end_s == arrivals[-1]
    assert w.requests == sum(w.start_s <= t <= w.end_s for t in arrivals)
    # a lifetime longer than 10% of the span sets the warm-up instead
    w = measure_window(unbounded(arrivals, e2e=30.0))
    assert w.start_s == pytest.approx(30.0) and w.steady


def test_a_short_run_is_dominated_by_its_drain_but_its_window_is_not() -> None:
    """The failure the window exists for: 24 req/s offered, each request living 3 s. Over the whole run
    (vllm bench serve's duration, the drain included) a long run still reads a little low and a short
    one far too low; the window gives the offered rate, and refuses the short run."""
    long = unbounded(poisson(24.0, 2400), e2e=3.0)
    whole = summarize(long, max(r.start_s + (r.e2e_s or 0) for r in long))
    w = measure_window(long)
    inside = window_summary(long, w)
    assert w.steady
    assert inside.request_rate == pytest.approx(24.0, rel=0.05)
    assert offered_rate(long, w) == pytest.approx(24.0, rel=0.05)
    assert whole.request_rate < inside.request_rate
    short = unbounded(poisson(24.0, 40), e2e=3.0)
    assert summarize(short, max(r.start_s + (r.e2e_s or 0) for r in short)).request_rate < 10.0
    w = measure_window(short)
    assert not w.steady and "warm-up" in w.reason


def test_offered_far_above_capacity_the_window_reads_the_capacity() -> None:
    capacity = 8 / 0.5  # 8 slots of 0.5 s: 16 req/s
    records = slots(poisson(4 * capacity, 1600), slots=8, service_s=0.5)
    w = measure_window(records)
    s = window_summary(records, w)
    assert w.steady
    assert s.request_rate == pytest.approx(capacity, rel=0.02)
    assert saturated(s, offered_rate(records, w))
    # below capacity it is not saturated, and serves what it is offered
    light = slots(poisson(0.5 * capacity, 800), slots=8, service_s=0.5)
    w = measure_window(light)
    s = window_summary(light, w)
    assert s.request_rate == pytest.approx(offered_rate(light, w), rel=0.05)
    assert not saturated(s, offered_rate(light, w))


def test_long_tailed_lifetimes_are_waited_out_before_completions_are_counted() -> None:
    """Chat-like lengths: lognormal lifetimes (mean 3 s, sigma 0.5), 15 s of arrivals at 24 req/s. The
    completion rate reaches the offered rate only once the longest-lived first requests have ended: a
    warm-up of one median lifetime reads about 5% low on average, one of a 90th-percentile lifetime
    reads the offered rate (12 runs, to average out the Poisson noise of each)."""
    ratios = []
    for seed in range(12):
        rng = random.Random(100 + seed)
        arrivals = poisson(24.0, 24 * 15, seed=200 + seed)
        mu = math.log(3.0) - 0.125
        records = [record(i, t, rng.lognormvariate(mu, 0.5)) for i, t in enumerate(arrivals)]
        w = measure_window(records)
        assert w.lifetime_s is not None and w.lifetime_s > w.start_s - w.first_arrival_s - 1e-9
        ratios.append(window_summary(records, w).request_rate / offered_rate(records, w))
    assert sum(ratios) / len(ratios) == pytest.approx(1.0, abs=0.02)


def test_a_point_too_short_is_marked_with_its_reason() -> None:
    few = unbounded(poisson(10.0, MIN_REQUESTS // 2), e2e=0.1)
    w = measure_window(few)
    assert not w.steady and f"fewer than {MIN_REQUESTS}" in w.reason
    assert "too short" in w.describe()
    brief = unbounded(poisson(100.0, 400), e2e=3.5)  # ~4 s of arrivals, each request lives 3.5 s
    w = measure_window(brief)
    assert not w.steady and "shorter than the first requests' p90 lifetime" in w.reason
    burst = unbounded([0.0] * 100, e2e=1.0)
    w = measure_window(burst)
    assert not w.steady and "at once" in w.reason
    assert window_summary(burst, w).requests == 100  # no window: the whole run's figures
    failed = [RequestRecord(index=i, start_s=i * 0.1, input_tokens=5, status=500, error="http_500") for i in range(60)]
    assert measure_window(failed).reason == "no request completed"


def test_latencies_and_attainment_cover_the_requests_that_arrived_in_the_window() -> None:
    arrivals = poisson(10.0, 1000)
    records = unbounded(arrivals, e2e=1.0)
    for r in records[:50]:  # a cold start: the first requests wait
        r.ttft_s = 2.0
        r.e2e_s = 3.0
    w = measure_window(records)
    s = window_summary(records, w, Slo(ttft_s=0.5))
    assert s.requests == w.requests and s.slo_met == w.requests  # the cold start lies in the warm-up
    assert s.ttft.p99 == pytest.approx(0.05)
    assert summarize(records, 100.0, Slo(ttft_s=0.5)).slo_met == 950


def test_streamed_tokens_are_counted_where_they_arrived() -> None:
    records = unbounded(poisson(10.0, 1000), e2e=1.0)
    w = measure_window(records)
    s = window_summary(records, w)
    assert s.output_tokens_per_s == pytest.approx(10.0 * 10, rel=0.05)
    assert s.tokens_per_chunk == 1.0


def test_saturation_needs_more_than_counting_noise() -> None:
    """12% fewer completions than arrivals: chance over 200 arrivals, saturation over 2,000."""
    for n, expected in ((240, False), (2400, True)):
        records = unbounded(poisson(24.0, n), e2e=0.5)
        w = measure_window(records)
        s = window_summary(records, w)
        assert saturated(s, s.request_rate * 1.12) is expected
        assert not saturated(s, s.request_rate)


def ramping(arrivals: list[float], first_s: float, settled_s: float, ramp_s: float) -> list[RequestRecord]:
    """A server that keeps up but whose answers lengthen as its batches fill: a request arriving at ``t``
    lives ``first_s`` at the start, rising evenly to ``settled_s`` at ``ramp_s`` into the run, then
    ``settled_s``."""
    return [record(i, t, first_s + (settled_s - first_s) * min(1.0, t / ramp_s)) for i, t in enumerate(arrivals)]


def test_a_window_of_few_lifetimes_under_a_ramp_is_flagged_short_to_settle() -> None:
    """Answers going from 6 s to 14 s over the first 20 s of the run (as 8B chat's did at 144 req/s, when
    the decode batches filled). Over 20 s of arrivals the window spans about two lifetimes and reads far
    less served than offered, as if saturated: it is flagged short to settle. Over 120 s the same server
    serves what it is offered, and the window spans ten lifetimes."""
    from pdrouter.bench.window import SETTLE_LIFETIMES

    short = ramping(poisson(50.0, 50 * 20), 6.0, 14.0, 20.0)
    w = measure_window(short)
    s = window_summary(short, w)
    assert w.steady and w.lifetimes is not None and 1.5 < w.lifetimes < SETTLE_LIFETIMES
    assert w.short_to_settle and w.to_dict()["short_to_settle"] is True
    assert s.request_rate < 0.8 * offered_rate(short, w) and saturated(s, offered_rate(short, w))
    long = ramping(poisson(50.0, 50 * 120), 6.0, 14.0, 20.0)
    w = measure_window(long)
    s = window_summary(long, w)
    assert w.steady and w.lifetimes is not None and w.lifetimes > 3 * SETTLE_LIFETIMES
    assert not w.short_to_settle and w.to_dict()["lifetimes"] == w.lifetimes
    assert s.request_rate > 0.9 * offered_rate(long, w) and not saturated(s, offered_rate(long, w))
    # four lifetimes of arrivals give three in the window (the warm-up takes one), rounded up to 10 s
    from pdrouter.bench.window import settling_span_s

    assert settling_span_s(13.1) == 60.0 and settling_span_s(5.0) == 20.0 and settling_span_s(0.2) == 10.0
    span = settling_span_s(6.0)
    ramp = ramping(poisson(50.0, int(50 * span)), 6.0, 6.0, 1.0)
    assert not measure_window(ramp).short_to_settle
    # a window that is not steady is too short already: not flagged twice
    brief = unbounded(poisson(100.0, 400), e2e=3.5)
    assert not measure_window(brief).short_to_settle
