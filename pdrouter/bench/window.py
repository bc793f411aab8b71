"""The steady state of a run: which stretch of it is measured, and the figures over that stretch.

A run's first requests meet an idle server (empty batches, cold caches) and its last ones a server
that no longer receives work (the batches drain). ``vllm bench serve`` divides by the whole run,
from the first send to the last answer, so on a short run the drain dominates: a server offered more
than it can serve looks as if it served less, and any layout "saturates" near the same rate. DistServe
scores SLO attainment over a fixed number of requests per rate, all of them. Here every point is
measured over a **window** of its arrivals, with this rule:

* the window opens after the warm-up: ``WARMUP_SHARE`` (10%) of the arrival span, and at least the
  90th percentile of the lifetimes (E2E) of the requests that arrived in that first tenth
  (``LIFETIME_PERCENTILE``). Requests arrive at the offered rate from the start, but they end at
  that rate only once the longest-lived of the first ones have ended: a request lives its E2E, so
  the completion rate t seconds in is the rate times the share of lifetimes under t (90% one
  90th-percentile lifetime in; with chat's lognormal lengths a median lifetime in, only about
  55%). The first requests' lifetimes are the server's before any queue formed (under overload
  later lifetimes grow with the queue, and would push the window out of the run);
* the window closes at the last arrival: after it the offered load stops and the server drains;
* latencies, SLO attainment and the prefix hit rate cover the requests that **arrived** in the
  window (failures count as misses), wherever they ended;
* throughput, goodput and token rates count what **ended** in the window (completions, the good ones,
  the streamed tokens) ÷ its length. While requests still arrive, a server offered more than it can
  serve keeps serving at its capacity, and that is what these give;
* the window is **steady** when it spans at least that lifetime and holds at least
  ``MIN_REQUESTS`` (50) arrivals; otherwise the point is marked too short, with the reason (its
  figures are then the short window's, or the whole run's when there is no window at all: no
  completion, a burst, arrivals that end within the warm-up). A burst has no steady state.
* a steady window that spans fewer than ``SETTLE_LIFETIMES`` (3) of those lifetimes is **short to
  settle**: kept, but flagged. Under a load that grows the batches, the answers lengthen, so requests
  in flight and KV occupancy keep rising for a lifetime or two after the window opens; a shortfall
  in what was served, or KV room not yet run out, may be the ramp's, and a longer point tells.

Times are those of the records: simulated seconds once ``RequestRecord.scaled`` divided them.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from pdrouter.bench.stats import RequestRecord, Slo, Summary, counts, latencies, percentile

WARMUP_SHARE = 0.1
"""Share of the arrival span left out at the start (at least the first requests' p90 lifetime is)."""

LIFETIME_PERCENTILE = 90.0
"""The percentile of the first requests' lifetimes the warm-up lasts at least."""

MIN_REQUESTS = 50
"""Arrivals a steady window holds at least (below it, a p90 moves by a request or two)."""

SETTLE_LIFETIMES = 3.0
"""A steady window spanning fewer of its first requests' p90 lifetimes than this is short to judge a load
by: a server whose batches (and answers) grow under the load takes several lifetimes to settle, and what
it served, its latencies and its KV room until then are the ramp's (``docs/benchmarks.md``, "How long a
point must last")."""


def settling_span_s(lifetime_s: float) -> float:
    """Seconds of arrivals that give a window ``SETTLE_LIFETIMES`` lifetimes of ``lifetime_s``: the warm-up
    takes one (while it is over a tenth of the span), the window the rest; rounded up to 10 s."""
    return 10.0 * math.ceil((SETTLE_LIFETIMES + 1) * lifetime_s / 10.0)


SATURATED = 0.9
"""A window that served less than this share of the rate it was offered (and less by more than
counting noise) is saturated."""


@dataclass(frozen=True)
class Window:
    """The measured stretch of a run (see the module docstring), in the records' seconds."""

    start_s: float
    end_s: float
    first_arrival_s: float
    last_arrival_s: float
    lifetime_s: float | None
    """The ``LIFETIME_PERCENTILE`` of the lifetimes (E2E) of the completed requests that arrived in
    the first ``WARMUP_SHARE`` of the arrival span (of all completed ones when none of those
    completed; None: none did)."""
    requests: int
    """Requests that arrived in the window (the measured ones)."""
    steady: bool
    reason: str
    """Why the window is not steady ("" when it is)."""

    @property
    def length_s(self) -> float:
        return max(self.end_s - self.start_s, 0.0)

    @property
    def warmup_s(self) -> float:
        return self.start_s - self.first_arrival_s

    @property
    def lifetimes(self) -> float | None:
        """The window's length in its first requests' p90 lifetimes (None: no lifetime)."""
        return self.length_s / self.lifetime_s if self.lifetime_s else None

    @property
    def short_to_settle(self) -> bool:
        """Steady, but spanning fewer than ``SETTLE_LIFETIMES`` lifetimes: a longer point may read otherwise."""
        lifetimes = self.lifetimes
        return self.steady and lifetimes is not None and lifetimes < SETTLE_LIFETIMES

    def describe(self) -> str:
        """E.g. ``"3.1–28.7 s (25.6 s, 612 requests)"``, or the reason it is not steady."""
        text = f"{self.start_s:.3g}–{self.end_s:.3g} s ({self.length_s:.3g} s, {self.requests} requests)"
        return text if self.steady else f"{text}; too short: {self.reason}"

    def to_dict(self) -> dict[str, object]:
        return {"start_s": self.start_s, "end_s": self.end_s, "length_s": self.length_s,
                "warmup_s": self.warmup_s, "first_arrival_s": self.first_arrival_s,
                "last_arrival_s": self.last_arrival_s, "lifetime_s": self.lifetime_s, "requests": self.requests,
                "steady": self.steady, "reason": self.reason, "warmup_share": WARMUP_SHARE,
                "lifetime_percentile": LIFETIME_PERCENTILE, "min_requests": MIN_REQUESTS,
                "lifetimes": self.lifetimes, "short_to_settle": self.short_to_settle,
                "settle_lifetimes": SETTLE_LIFETIMES}


def _end_s(r: RequestRecord) -> float | None:
    return None if r.e2e_s is None else r.start_s + r.e2e_s


def measure_window(records: Sequence[RequestRecord], *, warmup_share: float = WARMUP_SHARE,
                   min_requests: int = MIN_REQUESTS) -> Window:
    """The window of ``records`` by the rule of the module docstring."""
    if not records:
        return Window(0.0, 0.0, 0.0, 0.0, None, 0, False, "no request was sent")
    arrivals = sorted(r.start_s for r in records)
    first, last = arrivals[0], arrivals[-1]
    span = last - first
    done = [r for r in records if r.ok and r.e2e_s is not None]
    early = [r.e2e_s for r in done if r.start_s <= first + warmup_share * span and r.e2e_s is not None]
    lifetimes = sorted(early or [r.e2e_s for r in done if r.e2e_s is not None])
    e2e = percentile(lifetimes, LIFETIME_PERCENTILE) if lifetimes else None
    ends = [e for r in records if (e := _end_s(r)) is not None]
    whole_end = max([last, *ends])

    def whole(reason: str) -> Window:
        return Window(first, whole_end, first, last, e2e, len(records), False, reason)

    if e2e is None:
        return whole("no request completed")
    if span <= 0:
        return whole("every request was sent at once: a burst has no steady state")
    start = first + max(warmup_share * span, e2e)
    if start >= last:
        return whole(f"the arrivals ({span:.3g} s) end within the warm-up (the first requests' p90 lifetime, "
                     f"{e2e:.3g} s): send more requests")
    inside = sum(start <= t <= last for t in arrivals)
    if last - start < e2e:
        return Window(start, last, first, last, e2e, inside, False,
                      f"the window ({last - start:.3g} s) is shorter than the first requests' p90 lifetime "
                      f"({e2e:.3g} s)")
    if inside < min_requests:
        return Window(start, last, first, last, e2e, inside, False,
                      f"{inside} requests arrived in the window, fewer than {min_requests}")
    return Window(start, last, first, last, e2e, inside, True, "")


def _tokens_in(r: RequestRecord, start: float, end: float) -> float:
    """Output tokens of ``r`` streamed within [start, end]: its chunks' times, each chunk carrying an
    equal share of the request's tokens."""
    if r.ttft_s is None or not r.output_tokens:
        return 0.0
    t = r.start_s + r.ttft_s
    times = [t]
    for gap in r.itl_s:
        t += gap
        times.append(t)
    inside = sum(start <= x <= end for x in times)
    return r.output_tokens * inside / len(times)


def window_summary(records: Sequence[RequestRecord], window: Window, slo: Slo | None = None) -> Summary:
    """The figures over ``window`` (see the module docstring): latencies and SLO counts over the
    requests that arrived in it, rates over what ended in it ÷ its length."""
    start, end = window.start_s, window.end_s
    length = window.length_s
    measured = [r for r in records if start <= r.start_s <= end]
    done = [r for r in measured if r.ok]
    ended = [r for r in records if r.ok and (e := _end_s(r)) is not None and start <= e <= end]

    def rate(x: float) -> float:
        return x / length if length > 0 else math.nan

    slo_met = sum(slo.met(r) for r in measured) if slo is not None else None
    good_ended = sum(slo.met(r) for r in ended) if slo is not None else None
    return Summary(
        duration_s=length,
        request_rate=rate(len(ended)),
        input_tokens_per_s=rate(sum(r.input_tokens for r in ended)),
        output_tokens_per_s=rate(sum(_tokens_in(r, start, end) for r in records if r.ok)),
        goodput=None if good_ended is None else rate(good_ended),
        slo_met=slo_met,
        **counts(measured),
        **latencies(done),
    )


def offered_rate(records: Sequence[RequestRecord], window: Window) -> float:
    """Requests/s that arrived in the window (the load it was offered, as sent)."""
    return window.requests / window.length_s if window.length_s > 0 else math.nan


def saturated(summary: Summary, offered: float) -> bool:
    """The window served under ``SATURATED`` of the rate it was offered, by more than counting noise
    explains (two standard deviations of a Poisson count of its arrivals): the load exceeded what the
    server could do, and ``summary.request_rate`` is its capacity. Over a short window the two counts
    differ by chance by several percent, so the ratio alone would flag servers that kept up."""
    if not (offered > 0 and summary.duration_s > 0):
        return False
    arrived = offered * summary.duration_s
    ended = summary.request_rate * summary.duration_s
    return bool(ended < SATURATED * arrived and arrived - ended > 2 * math.sqrt(arrived))
