"""The router's ``/metrics`` during a run: KV water level, prefix hit rate, admission queue, KV bytes moved.

Sampled once a second (``MetricsScraper``) with the Prometheus text parser of ``prometheus_client``.
An endpoint without these metrics (another server, or none) just yields samples without them:
a load test of vLLM or SGLang runs the same, with latency figures only.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import httpx
from prometheus_client.parser import text_string_to_metric_families

from pdrouter.bench.host import enclosing


@dataclass(frozen=True)
class MetricsSample:
    """One scrape: seconds after the run's start and what the router reported."""

    t_s: float
    reserved_blocks: dict[str, float] = field(default_factory=dict)
    """KV blocks booked per decode worker (``pdrouter_kv_reserved_blocks``)."""
    capacity_blocks: dict[str, float] = field(default_factory=dict)
    queue_length: float | None = None
    prefix_query_tokens: float | None = None
    prefix_hit_tokens: float | None = None
    kv_transfer_bytes: float | None = None
    sim_modeled_s: float | None = None
    """Simulated GPUs' modeled step seconds, summed over workers (``pdrouter_worker_sim_modeled_seconds``)."""
    sim_late_s: float | None = None
    """Of which late because the machine was too slow (``pdrouter_worker_sim_late_seconds``)."""
    ttft_buckets: dict[float, float] = field(default_factory=dict)
    """The router's own time to first token so far, as its histogram's cumulative counts by upper bound
    (``pdrouter_time_to_first_token_seconds``, both doors together); empty where it exports none."""

    @property
    def water_level(self) -> dict[str, float]:
        """Booked ÷ capacity per decode worker."""
        return {w: self.reserved_blocks.get(w, 0.0) / c for w, c in self.capacity_blocks.items() if c > 0}

    def to_dict(self) -> dict[str, object]:
        return {"t_s": self.t_s, "water_level": self.water_level, "reserved_blocks": self.reserved_blocks,
                "capacity_blocks": self.capacity_blocks, "queue_length": self.queue_length,
                "prefix_query_tokens": self.prefix_query_tokens, "prefix_hit_tokens": self.prefix_hit_tokens,
                "kv_transfer_bytes": self.kv_transfer_bytes, "sim_modeled_s": self.sim_modeled_s,
                "sim_late_s": self.sim_late_s}


def parse_metrics(text: str, t_s: float) -> MetricsSample:
    """The figures of one ``/metrics`` page (missing ones stay empty / None; a counter the page declares
    but shows no sample of yet reads 0)."""
    reserved: dict[str, float] = {}
    capacity: dict[str, float] = {}
    scalars: dict[str, float] = {}
    ttft: dict[float, float] = {}
    wanted = {"pdrouter_admission_queue_length": "queue", "pdrouter_prefix_cache_query_tokens_total": "query",
              "pdrouter_prefix_cache_hit_tokens_total": "hit", "pdrouter_kv_transfer_bytes_total": "bytes",
              "pdrouter_worker_sim_modeled_seconds": "modeled", "pdrouter_worker_sim_late_seconds": "late"}
    for family in text_string_to_metric_families(text):
        if family.type == "counter" and not family.samples and f"{family.name}_total" in wanted:
            # Declared but not yet moved (a labelled counter before its first child): 0, as counters start.
            scalars.setdefault(wanted[f"{family.name}_total"], 0.0)
        for s in family.samples:
            if s.name == "pdrouter_kv_reserved_blocks":
                reserved[s.labels.get("worker", "")] = s.value
            elif s.name == "pdrouter_kv_capacity_blocks":
                capacity[s.labels.get("worker", "")] = s.value
            elif s.name == "pdrouter_time_to_first_token_seconds_bucket":
                le = float(s.labels.get("le", "inf"))
                ttft[le] = ttft.get(le, 0.0) + s.value
            elif s.name in wanted:
                key = wanted[s.name]
                scalars[key] = scalars.get(key, 0.0) + s.value
    return MetricsSample(t_s, reserved, capacity, scalars.get("queue"), scalars.get("query"), scalars.get("hit"),
                         scalars.get("bytes"), scalars.get("modeled"), scalars.get("late"), ttft)


def _growth(samples: Iterable[MetricsSample], part: str, whole: str) -> float | None:
    """How much counter ``part`` grew over the run ÷ how much ``whole`` did (first to last sample that
    has both); None with fewer than two such samples or no growth of ``whole``."""
    seen = [s for s in samples if getattr(s, part) is not None and getattr(s, whole) is not None]
    if len(seen) < 2:
        return None
    grown = getattr(seen[-1], whole) - getattr(seen[0], whole)
    return (getattr(seen[-1], part) - getattr(seen[0], part)) / grown if grown > 0 else None


def counter_growth(samples: Sequence[MetricsSample], name: str) -> float | None:
    """How much counter ``name`` grew from the first sample to the last. A counter that a page does
    not show yet counts as 0 there, as Prometheus counters start at 0 (a labelled one is exported
    only once it moved: a fresh router shows no KV bytes until its first transfer). None when no
    sample shows it, or fewer than two samples were taken."""
    values = [getattr(s, name) for s in samples]
    if len(values) < 2 or all(v is None for v in values):
        return None
    return (values[-1] or 0.0) - (values[0] or 0.0)


def prefix_hit_rate(samples: Iterable[MetricsSample]) -> float | None:
    """Hit tokens ÷ queried tokens over the run (the counters' growth from the first to the last sample)."""
    return _growth(samples, "prefix_hit_tokens", "prefix_query_tokens")


def sim_late_share(samples: Iterable[MetricsSample]) -> float | None:
    """Of the simulated GPUs' modeled step time during the run, the share by which steps ended late
    because this machine could not keep up (0: the simulated timings held; None: no simulated workers)."""
    return _growth(samples, "sim_late_s", "sim_modeled_s")


def histogram_quantiles(samples: Sequence[MetricsSample], start_s: float, end_s: float,
                        qs: Sequence[float] = (0.5, 0.9, 0.99)) -> dict[str, float]:
    """The router's own TTFT over ``start_s`` … ``end_s`` (seconds after the run's start), from the two
    samples that enclose it most closely: ``count`` (requests whose first token left the router
    between them) and ``p50_s``… for each of ``qs``, interpolated within the histogram's buckets the
    way Prometheus's ``histogram_quantile`` does (a quantile past the last finite bound reads that
    bound). Empty without two such samples or without a request between them."""
    seen = [s for s in samples if s.ttft_buckets]
    if len(seen) < 2:
        return {}
    a, b = enclosing(seen, start_s, end_s)
    bounds = sorted(b.ttft_buckets)
    counts = [b.ttft_buckets[le] - a.ttft_buckets.get(le, 0.0) for le in bounds]
    total = counts[-1] if counts else 0.0
    if b.t_s <= a.t_s or total <= 0:
        return {}
    out = {"count": total}
    for q in qs:
        rank = q * total
        i = next(k for k, c in enumerate(counts) if c >= rank)
        if math.isinf(bounds[i]):
            value = bounds[i - 1] if i > 0 else 0.0
        else:
            low, below = (bounds[i - 1], counts[i - 1]) if i > 0 else (0.0, 0.0)
            inside = counts[i] - below
            value = low + (bounds[i] - low) * ((rank - below) / inside if inside > 0 else 1.0)
        out[f"p{100 * q:g}_s"] = value
    return out


def _wanted_lines(text: str) -> str:
    """The lines of a page that :func:`parse_metrics` reads (a router's page is mostly histograms it
    does not): a few hundred microseconds to parse instead of tens of milliseconds."""
    return "\n".join(line for line in text.splitlines() if line.startswith(_PREFIXES)
                     or (line.startswith("# ") and any(name in line for name in _PREFIXES)))


_PREFIXES = ("pdrouter_kv_reserved_blocks", "pdrouter_kv_capacity_blocks", "pdrouter_admission_queue_length",
             "pdrouter_prefix_cache_query_tokens_total", "pdrouter_prefix_cache_hit_tokens_total",
             "pdrouter_kv_transfer_bytes", "pdrouter_worker_sim_modeled_seconds", "pdrouter_worker_sim_late_seconds",
             "pdrouter_time_to_first_token_seconds_bucket")


class MetricsScraper:
    """Scrapes ``url`` every ``interval_s`` in the background until ``stop``.

    The pages are kept as text during the run and parsed when it stops: parsing runs in the load
    generator's own event loop, where a whole router page (tens of milliseconds of Python) would
    delay the timestamps of the tokens arriving meanwhile."""

    def __init__(self, url: str, interval_s: float = 1.0, timeout_s: float = 2.0, api_key: str | None = None) -> None:
        self.url = url
        self.interval_s = interval_s
        self.samples: list[MetricsSample] = []
        self._pages: list[tuple[float, str]] = []
        self.errors = 0
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else None  # a router's /metrics behind its key
        self._http = httpx.AsyncClient(timeout=timeout_s, headers=headers)
        self._task: asyncio.Task[None] | None = None
        self._zero = time.perf_counter()

    def start(self, clock_zero: float) -> None:
        self._zero = clock_zero
        self._task = asyncio.create_task(self._loop(), name="bench-metrics")

    async def scrape_once(self) -> None:
        try:
            response = await self._http.get(self.url)
            if response.status_code == 200:
                self._pages.append((time.perf_counter() - self._zero, response.text))
                return
        except (httpx.HTTPError, ValueError):
            pass
        self.errors += 1

    async def _loop(self) -> None:
        while True:
            await self.scrape_once()
            await asyncio.sleep(self.interval_s)

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        await self.scrape_once()  # the counters' final values
        await self._http.aclose()
        for t_s, text in self._pages:
            try:
                self.samples.append(parse_metrics(_wanted_lines(text), t_s))
            except ValueError:  # not the Prometheus text format
                self.errors += 1
        self._pages.clear()
