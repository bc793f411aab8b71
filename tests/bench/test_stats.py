"""Metrics: per-request TPOT/ITL, SLOs, percentiles and a run's summary, on hand-made records."""

from __future__ import annotations

import itertools
import json
import math
import statistics

import pytest
from hypothesis import given
from hypothesis import strategies as st

from pdrouter.bench.stats import Percentiles, RequestRecord, Slo, percentile, summarize
from pdrouter.core.errors import ConfigError


def make_record(index: int = 0, *, ttft: float | None = 0.1, e2e: float | None = 0.2, output: int = 4,
                itl: list[float] | None = None, status: int = 200, error: str = "", input_tokens: int = 10,
                start: float = 0.0) -> RequestRecord:
    """A record; the defaults make a completed one of 4 output tokens."""
    return RequestRecord(index=index, start_s=start, input_tokens=input_tokens, output_tokens=output, ttft_s=ttft,
                         itl_s=list(itl or []), e2e_s=e2e, status=status, error=error)


def test_tpot_and_itl_from_known_token_times() -> None:
    # Sent at 0; tokens arrive at 0.10, 0.12, 0.15, 0.20; the stream ends with the last.
    arrivals = [0.10, 0.12, 0.15, 0.20]
    r = make_record(ttft=arrivals[0], e2e=arrivals[-1], output=4,
                    itl=[b - a for a, b in itertools.pairwise(arrivals)])
    assert r.itl_s == pytest.approx([0.02, 0.03, 0.05])
    assert r.tpot_s == pytest.approx(0.1 / 3)
    assert r.tpot_s == pytest.approx(statistics.fmean(r.itl_s))  # one token per chunk: TPOT = mean ITL
    assert r.ok


def test_tpot_undefined_below_two_tokens_or_without_times() -> None:
    assert make_record(output=1).tpot_s is None
    assert make_record(output=0).tpot_s is None
    assert make_record(ttft=None).tpot_s is None
    assert make_record(e2e=None).tpot_s is None
    assert make_record(ttft=0.1, e2e=0.3, output=2).tpot_s == pytest.approx(0.2)


def test_ok_and_error_kind() -> None:
    assert make_record().ok and make_record().error_kind == ""
    assert not make_record(status=429, error="http_429").ok
    assert make_record(status=503).error_kind == "http_503"
    assert make_record(status=0).error_kind == "no_response"
    assert make_record(status=200, error="protocol").error_kind == "protocol"
    assert make_record(status=0, error="timeout").error_kind == "timeout"


def test_scaled_divides_every_time() -> None:
    r = make_record(ttft=0.2, e2e=1.0, itl=[0.1, 0.3], start=4.0)
    s = r.scaled(2.0)
    assert (s.start_s, s.ttft_s, s.e2e_s, s.itl_s) == (2.0, 0.1, 0.5, [0.05, 0.15])
    assert (s.index, s.input_tokens, s.output_tokens, s.status) == (r.index, r.input_tokens, r.output_tokens, 200)
    assert r.ttft_s == 0.2  # the original is untouched
    for unchanged in (1.0, 0.0):
        copy = r.scaled(unchanged)
        assert copy == r and copy.itl_s is not r.itl_s
    assert make_record(ttft=None, e2e=None).scaled(4.0).ttft_s is None
    with pytest.raises(ConfigError, match="time scale"):
        r.scaled(-1.0)


def test_record_to_dict_is_json_ready() -> None:
    r = make_record(itl=[0.02])
    r.cached_tokens = 3
    d = r.to_dict()
    assert d == {"index": 0, "start_s": 0.0, "input_tokens": 10, "output_tokens": 4, "ttft_s": 0.1,
                 "itl_s": [0.02], "e2e_s": 0.2, "status": 200, "error": "", "cached_tokens": 3, "detail": "",
                 "prompt_digest": "", "ok": True, "tpot_s": pytest.approx(0.1 / 3)}
    json.dumps(d)


@pytest.mark.parametrize(("text", "expected"), [
    ("ttft=500ms,tpot=50ms", Slo(ttft_s=0.5, tpot_s=0.05)),
    ("ttft=500", Slo(ttft_s=0.5)),  # a bare number is milliseconds
    ("e2e=2s", Slo(e2e_s=2.0)),
    ("e2el=1.5s", Slo(e2e_s=1.5)),
    (" itl = 20 ms , TTFT=0.25s ", Slo(ttft_s=0.25, itl_s=0.02)),
    ("ttft=1s,tpot=1,itl=2ms,e2e=3000", Slo(1.0, 0.001, 0.002, 3.0)),
])
def test_slo_parse(text: str, expected: Slo) -> None:
    assert Slo.parse(text) == expected


@pytest.mark.parametrize(("text", "fragment"), [
    ("", "empty"),
    ("   ", "empty"),
    ("ttft", "expected KEY=TIME"),
    ("ttft=", "expected KEY=TIME"),
    ("=5ms", "expected KEY=TIME"),
    ("ttft=1,,tpot=2", "expected KEY=TIME"),
    ("latency=5ms", "unknown key 'latency'"),
    ("ttft=abc", "ttft: expected a time such as 500ms"),
    ("ttft=5min", "ttft: expected a time"),
    ("ttft=-5ms", "ttft: a bound must be a positive finite time"),
    ("tpot=0", "tpot: a bound must be a positive"),
    ("itl=inf", "itl: a bound must be a positive finite"),
    ("ttft=1,ttft=2", "ttft given twice"),
    ("e2e=1s,e2el=2s", "e2el given twice"),
])
def test_slo_parse_errors(text: str, fragment: str) -> None:
    with pytest.raises(ConfigError) as err:
        Slo.parse(text)
    assert err.value.message.startswith("--slo: ")
    assert fragment in err.value.message


def test_slo_direct_construction_is_checked() -> None:
    with pytest.raises(ConfigError, match="--slo: e2e: a bound must be a positive"):
        Slo(e2e_s=-1.0)


def test_slo_describe() -> None:
    assert Slo.parse("tpot=50ms,ttft=0.5s").describe() == "ttft <= 500 ms, tpot <= 50 ms"
    assert Slo.parse("itl=2.5").describe() == "itl <= 2.5 ms"
    assert Slo().describe() == "no bounds"


def test_slo_met_bound_by_bound() -> None:
    slo = Slo(ttft_s=0.25, tpot_s=0.05, itl_s=0.125, e2e_s=1.0)
    assert slo.met(make_record(ttft=0.25, e2e=0.37, output=4, itl=[0.125, 0.05]))  # bounds are inclusive
    assert not slo.met(make_record(ttft=0.26))
    assert not slo.met(make_record(ttft=None))
    assert not slo.met(make_record(ttft=0.1, e2e=0.4, output=2))  # tpot 0.3
    assert not slo.met(make_record(itl=[0.01, 0.13]))  # the largest ITL counts
    assert not slo.met(make_record(ttft=0.1, e2e=1.2, output=1000))  # tpot fine, e2e not
    assert not slo.met(make_record(e2e=None, output=1))
    assert slo.met(make_record(ttft=0.2, e2e=0.2, output=1))  # one token: no TPOT, no ITL
    assert not slo.met(make_record(status=500, error="http_500"))
    assert Slo().met(make_record()) and not Slo().met(make_record(status=0, error="connect"))


def test_percentile_linear_interpolation() -> None:
    values = [1.0, 2.0, 3.0, 4.0, 10.0]
    assert percentile(values, 0) == 1.0
    assert percentile(values, 50) == 3.0
    assert percentile(values, 90) == pytest.approx(7.6)  # rank 3.6: 4 + 0.6 * (10 - 4)
    assert percentile(values, 99) == pytest.approx(9.76)  # rank 3.96
    assert percentile(values, 100) == 10.0
    assert percentile([7.0], 99) == 7.0
    assert percentile([1.0, 2.0], 25) == pytest.approx(1.25)
    assert math.isnan(percentile([], 50))
    with pytest.raises(ValueError):
        percentile(values, 101)


@given(st.lists(st.floats(-1e6, 1e6), min_size=2, max_size=50), st.integers(1, 99))
def test_percentile_matches_the_inclusive_quantiles(values: list[float], q: int) -> None:
    # statistics.quantiles(method="inclusive") is the same linear interpolation between closest ranks.
    expected = statistics.quantiles(values, n=100, method="inclusive")[q - 1]
    assert percentile(sorted(values), q) == pytest.approx(expected, rel=1e-9, abs=1e-6)


def test_percentiles_of() -> None:
    p = Percentiles.of([10.0, 1.0, 4.0, 3.0, 2.0])
    assert (p.mean, p.p50, p.p90, p.p99, p.count) == pytest.approx((4.0, 3.0, 7.6, 9.76, 5))
    empty = Percentiles.of([])
    assert empty.count == 0 and all(math.isnan(v) for v in (empty.mean, empty.p50, empty.p90, empty.p99))


RECORDS = [
    make_record(0, ttft=0.1, e2e=0.2, output=4, itl=[0.02, 0.03, 0.05], input_tokens=10),  # tpot 1/30
    make_record(1, ttft=0.3, e2e=0.4, output=2, itl=[0.1], input_tokens=20),  # tpot 0.1
    make_record(2, ttft=0.2, e2e=0.2, output=1, itl=[], input_tokens=30),  # no tpot
    make_record(3, ttft=None, e2e=None, output=0, status=429, error="http_429", input_tokens=40),
    make_record(4, ttft=0.05, e2e=None, output=3, itl=[0.5, 0.5], status=0, error="timeout", input_tokens=50),
]


def test_summarize_counts_and_throughputs() -> None:
    s = summarize(RECORDS, 2.0)
    assert (s.duration_s, s.requests, s.completed, s.failed) == (2.0, 5, 3, 2)
    assert s.errors == {"http_429": 1, "timeout": 1}
    assert s.request_rate == 1.5
    assert s.input_tokens_per_s == 30.0  # (10 + 20 + 30) / 2: completed requests only
    assert s.output_tokens_per_s == 3.5  # (4 + 2 + 1) / 2
    assert s.goodput is None and s.slo_met is None


def test_summarize_latencies_over_completed_requests() -> None:
    s = summarize(RECORDS, 2.0)
    # TTFT 0.1, 0.2, 0.3
    assert (s.ttft.mean, s.ttft.p50, s.ttft.p90, s.ttft.p99, s.ttft.count) == pytest.approx((0.2, 0.2, 0.28, 0.298, 3))
    # TPOT per request: 1/30, 0.1
    third = 1 / 30
    assert (s.tpot.mean, s.tpot.p50, s.tpot.p90, s.tpot.p99, s.tpot.count) == pytest.approx(
        ((third + 0.1) / 2, (third + 0.1) / 2, third + 0.9 * (0.1 - third), third + 0.99 * (0.1 - third), 2))
    # ITL: every gap of every completed request: 0.02, 0.03, 0.05, 0.1 (the timed-out request's are left out)
    assert (s.itl.mean, s.itl.p50, s.itl.p90, s.itl.p99, s.itl.count) == pytest.approx((0.05, 0.04, 0.085, 0.0985, 4))
    # E2E 0.2, 0.2, 0.4
    assert (s.e2e.mean, s.e2e.p50, s.e2e.p90, s.e2e.p99, s.e2e.count) == pytest.approx((0.8 / 3, 0.2, 0.36, 0.396, 3))


def test_goodput_counts_exactly_the_records_meeting_every_bound() -> None:
    records = [
        make_record(0, ttft=0.1, e2e=0.2, output=4),  # meets: ttft 0.1, tpot 0.033
        make_record(1, ttft=0.3, e2e=0.35, output=2),  # ttft misses
        make_record(2, ttft=0.1, e2e=0.4, output=3),  # tpot 0.15 misses
        make_record(3, ttft=0.05, e2e=None, status=500, error="http_500"),  # failed
        make_record(4, ttft=0.2, e2e=0.2, output=1),  # meets: one token, no TPOT
        make_record(5, ttft=0.25, e2e=0.37, output=4),  # meets: ttft at the bound, tpot 0.04
    ]
    s = summarize(records, 4.0, Slo.parse("ttft=250ms,tpot=50ms"))
    assert s.slo_met == 3
    assert s.goodput == 0.75
    assert s.completed == 5 and s.request_rate == 1.25


def test_summarize_nothing() -> None:
    s = summarize([], 1.0, Slo(ttft_s=1.0))
    assert (s.requests, s.completed, s.failed, s.errors, s.request_rate, s.slo_met, s.goodput) == (0, 0, 0, {}, 0.0,
                                                                                                   0, 0.0)
    assert s.ttft.count == 0 and math.isnan(s.ttft.p99)
    zero = summarize([], 0.0)
    assert math.isnan(zero.request_rate) and math.isnan(zero.output_tokens_per_s)
    with pytest.raises(ValueError):
        summarize([], -1.0)


def test_summary_to_dict_and_lines() -> None:
    s = summarize(RECORDS, 2.0, Slo(ttft_s=0.25))
    d = s.to_dict()
    assert d["completed"] == 3 and d["errors"] == {"http_429": 1, "timeout": 1} and d["slo_met"] == 2
    assert d["ttft"] == {"mean": pytest.approx(0.2), "p50": 0.2, "p90": pytest.approx(0.28),
                         "p99": pytest.approx(0.298), "count": 3}
    assert set(d) == {"duration_s", "requests", "completed", "failed", "errors", "request_rate", "input_tokens_per_s",
                      "output_tokens_per_s", "ttft", "tpot", "itl", "e2e", "goodput", "slo_met", "tokens_per_chunk"}
    json.dumps(d)
    lines = s.lines()
    assert lines[:11] == ["duration: 2 s", "requests: 5", "completed: 3", "failed: 2", "errors_http_429: 1",
                          "errors_timeout: 1", "request_throughput: 1.5 req/s", "input_token_throughput: 30 tok/s",
                          "output_token_throughput: 3.5 tok/s", "goodput: 1 req/s", "slo_met: 2"]
    assert "ttft_p90: 280 ms" in lines and "itl_p50: 40 ms" in lines and "e2e_p99: 396 ms" in lines
    assert all(": " in line for line in lines)
    assert not any(line.startswith("goodput") for line in summarize(RECORDS, 2.0).lines())
