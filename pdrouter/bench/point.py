"""One measured point of a run, a sweep or a comparison: its requests sent, written and scored.

:func:`run_point` sends a point's requests (``pdrouter.bench.runner``), writes the run's JSON and
Markdown (``pdrouter.bench.report``) and scores its measured window
(``pdrouter.bench.window``). :func:`point_size` and :func:`check_point_sizes` say how many requests
a point at a rate sends, and refuse, before anything runs, points too short to reach steady state.
:func:`point_entry` and :func:`point_line` are a point as a sweep's or comparison's record holds
it and as one printed line; :func:`failure_hint` says what to do about a point whose requests all
failed.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import math
import signal
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pdrouter.core.aio import run_on_event_loop
from pdrouter.core.errors import ConfigError

if TYPE_CHECKING:
    from pdrouter.bench.progress import Progress
    from pdrouter.bench.runner import RunConfig
    from pdrouter.bench.stats import Slo, Summary
    from pdrouter.bench.window import Window
    from pdrouter.bench.workload import PointSource, RequestSpec, Workload

API_KEY_ENV = "OPENAI_API_KEY"
"""Where the bench reads the endpoint's API key when none is given."""


def metrics_url_beside(url: str) -> str:
    """The ``/metrics`` beside an OpenAI base URL (``http://h:p/v1`` → ``http://h:p/metrics``)."""
    base = url.rstrip("/")
    return (base[:-3] if base.endswith("/v1") else base) + "/metrics"


@dataclass
class Outcome:
    """One run as written: its summaries, its document and where it went."""

    summary: Summary
    """The whole run, with ``vllm bench serve``'s definitions."""
    steady: Summary
    """The measured window's figures."""
    window: Window
    document: dict[str, Any]
    path: Path
    interrupted: bool


@dataclass
class Prepared:
    """What every run of one command shares: the workload (and the points drawn from it), the model,
    the SLO, the API key."""

    workload: Workload
    source: PointSource
    model: str
    slo: Slo | None
    api_key: str | None

    @property
    def label(self) -> str:
        return self.workload.label


def run_point(run_config: RunConfig, out: Path, prep: Prepared, rate: float | None, stem: str, *, point: int,
              specs: list[RequestSpec], progress: Progress | None = None) -> Outcome:
    """Point ``point`` at ``rate`` (None: closed loop) with ``specs``, sent as ``run_config`` says (its
    seed moved by the point), written as ``{stem}.json`` / ``.md`` under ``out``."""
    from pdrouter.bench.host import host_figures
    from pdrouter.bench.report import (
        markdown,
        measured_hit_rate,
        prefix_figures,
        run_document,
        steady_figures,
        write_json,
    )
    from pdrouter.bench.runner import run
    from pdrouter.bench.scrape import histogram_quantiles
    from pdrouter.bench.stats import summarize
    from pdrouter.bench.window import measure_window, offered_rate, window_summary
    from pdrouter.bench.workload import expected_hit_rate

    s = run_config
    config = dataclasses.replace(s, rate=rate, seed=s.seed + 7919 * point)
    result = run_on_event_loop(interruptible(run(config, specs, progress=progress)))
    scale = s.time_scale or 1.0
    records = [r.scaled(scale) for r in result.records]
    summary = summarize(records, result.duration_s / scale, prep.slo)
    window = measure_window(records)
    steady = window_summary(records, window, prep.slo)
    measured = [r for r in records if window.start_s <= r.start_s <= window.end_s]
    by_index = {spec.index: spec for spec in specs}
    prefix = prefix_figures(expected_hit_rate([by_index[r.index] for r in measured if r.index in by_index]),
                            measured_hit_rate(measured))
    arrivals = (f"Poisson {rate:g}/s" + (f", burstiness {s.burstiness}" if s.burstiness != 1 else "")
                if rate else f"closed loop, {s.concurrency or len(specs)} in flight")
    cfg = {"base_url": s.base_url, "model": prep.model, "workload": prep.label, "arrivals": arrivals,
           "num_requests": len(specs), "rate": rate, "burstiness": s.burstiness, "point": point,
           "concurrency": s.concurrency, "max_concurrency": s.max_concurrency, "duration_s": s.duration_s,
           "slo": prep.slo.describe() if prep.slo else None, "time_scale": s.time_scale, "seed": s.seed,
           "started_at": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    wall = s.wall_per_sim_s  # the window is in the records' (simulated) seconds; the host's samples in wall ones
    host = host_figures(result.host, window.start_s * wall, window.end_s * wall)
    router_ttft = {k: v if k == "count" else v / wall for k, v in  # (in the records' seconds, as the client's)
                   histogram_quantiles(result.samples, window.start_s * wall, window.end_s * wall).items()}
    document = run_document(cfg, summary, [r.to_dict() for r in records], result.samples, result.interrupted,
                            steady=steady_figures(window, steady, offered_rate(records, window), router_ttft),
                            prefix=prefix, host=host, client=result.client)
    path = write_json(out / f"{stem}.json", document)
    (out / f"{stem}.md").write_text(markdown(document))
    return Outcome(summary, steady, window, document, path, result.interrupted)


async def interruptible(coro: Any) -> Any:
    """Run ``coro``; SIGINT/SIGTERM cancel it (the run then returns what it measured)."""
    task = asyncio.ensure_future(coro)
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError, RuntimeError):
            loop.add_signal_handler(sig, task.cancel)
    try:
        return await task
    finally:
        for sig in (signal.SIGINT, signal.SIGTERM):
            with contextlib.suppress(NotImplementedError, RuntimeError):
                loop.remove_signal_handler(sig)


def point_size(rate: float, num_requests: int | None, point_duration: float | None) -> int:
    """Requests of a point at ``rate``: ``rate × point_duration`` (simulated seconds of arrivals), at least
    ``num_requests``; ``num_requests`` alone without a duration."""
    by_time = math.ceil(rate * point_duration) if point_duration else 0
    return max(num_requests or 0, by_time, 1)


def check_point_sizes(sizes: dict[float, int]) -> None:
    """Refuse, before anything runs, points too small to leave ``MIN_REQUESTS`` in their window."""
    from pdrouter.bench.window import MIN_REQUESTS, WARMUP_SHARE

    small = {rate: n for rate, n in sizes.items() if n * (1 - WARMUP_SHARE) < MIN_REQUESTS}
    if small:
        need = math.ceil(MIN_REQUESTS / (1 - WARMUP_SHARE))
        rate, n = min(small.items())
        raise ConfigError(f"a point of {n} requests at {rate:g} req/s is too short to reach steady state: its "
                          f"measured window (after a {100 * WARMUP_SHARE:g}% warm-up) would hold fewer than "
                          f"{MIN_REQUESTS}; send at least {need} a point (--num-requests, or --point-duration "
                          f"{need / rate:.3g} at that rate)")


def point_line(name: str, outcome: Outcome) -> str:
    """A point in one line: goodput, throughput, the tails, failures, and whether its window is usable."""
    from pdrouter.bench.report import kv_full_count

    s, w = outcome.steady, outcome.window
    share = 100.0 * (s.slo_met or 0) / s.requests if s.requests and s.slo_met is not None else None
    text = (f"{name}: goodput {s.goodput if s.goodput is not None else float('nan'):.3g} req/s, throughput "
            f"{s.request_rate:.3g} req/s, TTFT p99 {s.ttft.p99 * 1e3:.1f} ms, TPOT p99 {s.tpot.p99 * 1e3:.1f} ms, "
            f"ITL p99 {s.itl.p99 * 1e3:.1f} ms" + (f", {share:.0f}% within the SLO" if share is not None else ""))
    if s.failed:
        text += f", failed {s.failed} (" + ", ".join(f"{k}: {v}" for k, v in sorted(s.errors.items())) + ")"
    if not w.steady:
        text += f" [too short: {w.reason}]"
    elif w.short_to_settle:
        text += f" [short to settle: {w.lifetimes:.2g} lifetimes of {w.lifetime_s:.3g} s]"
    full = kv_full_count(outcome.document.get("router") or {})
    if full:
        text += f" [KV full on {full[0]} of {full[1]} workers]"
    prefix = outcome.document["prefix"]
    if prefix.get("flagged"):
        text += (f" [prefix hits {100 * prefix['measured_hit_rate']:.1f}% above the workload's "
                 f"{100 * prefix['expected_hit_rate']:.1f}%]")
    waited = (outcome.document.get("client") or {}).get("waited_for_a_connection")
    if waited:
        text += f" [{waited} requests waited for a client connection]"
    host = outcome.document.get("host") or {}
    if host.get("host_bound"):
        text += f" [host-bound: {host['reason']}]"
    return text


def point_entry(rate: float, outcome: Outcome, point: int) -> dict[str, Any]:
    """A sweep's or comparison's record of one point (its steady figures first)."""
    from pdrouter.bench.compare import slo_attainment

    doc = outcome.document
    return {"rate": rate, "point": point, "requests": doc["config"]["num_requests"],
            "summary": doc["steady"]["summary"], "run_summary": doc["summary"], "window": doc["steady"]["window"],
            "offered_rate": doc["steady"]["offered_rate"], "saturated": doc["steady"]["saturated"],
            "prefix": doc["prefix"], "router": doc["router"], "host": doc.get("host") or {},
            "slo_met_percent": slo_attainment(doc["steady"]["summary"]), "file": str(outcome.path)}


def first_failure(outcome: Outcome) -> tuple[str, str]:
    """The kind and the server's reason of the point's first failed request."""
    for r in outcome.document["requests"]:
        if r.get("error"):
            return str(r["error"]), str(r.get("detail") or "")
    return "no request", ""


def key_hint(url: str) -> str:
    return (f"the server at {url} wants an API key: give --api-key or set {API_KEY_ENV} (`pdrouter up` prints "
            "its key in its banner)")


def failure_hint(kind: str, detail: str, url: str, model: str) -> str:
    """What to do about a run whose requests all failed with ``kind`` (``http_401``, ``connect``…),
    the server's own reason (``detail``) first."""
    reason = f": {detail}" if detail else ""
    if kind in ("http_401", "http_403"):
        return f"{kind}{reason}; {key_hint(url)}"
    if kind == "connect":
        return f"connect{reason}; nothing answers at {url}: check --url"
    if kind == "http_404":
        return f"http_404{reason}; check --url (the OpenAI base URL) and --model ({model})"
    if kind in ("http_400", "http_422", "stream_error"):
        return f"{kind}{reason}; the server refused the request: check the workload against the model (context " \
               f"length, vocabulary)"
    if kind == "http_429":
        return f"http_429{reason}; the server had no room: lower the rate or the concurrency"
    return f"{kind}{reason}; is {url} serving {model}?"
