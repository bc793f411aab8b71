"""One load-test run: send a workload by an arrival process, record every request, scrape the router.

Arrivals, as ``vllm bench serve`` offers them:

* ``rate``: open loop, Poisson at that many requests/s (``burstiness`` ≠ 1: gamma gaps of the same
  mean); ``max_concurrency`` optionally caps the requests in flight (later arrivals wait);
* a trace: each ``RequestSpec.arrival_s`` (a JSONL workload's timestamps);
* ``concurrency`` alone: closed loop, that many requests in flight, each slot sending its next
  request when its previous one ends.

Rates, trace timestamps and ``duration_s`` are in simulated seconds when ``time_scale`` is not 1
(simulated workers running that many times slower than the wall clock): the run sends at
``rate ÷ time_scale`` per wall second. The records stay in wall time (``RequestRecord.scaled``
turns them into simulated time).

A run ends when every request was sent and answered, or ``duration_s`` after the start (nothing is
sent after it; requests in flight are awaited). Cancelling the run (Ctrl-C) keeps what was
measured: requests in flight end as ``cancelled``.

Beside the requests, the run samples this machine's CPU once a second (``pdrouter.bench.host``): a
run can only be trusted as a measure of its server while the machine sending it keeps up.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from pdrouter.bench.arrivals import arrival_times
from pdrouter.bench.client import CompletionsClient
from pdrouter.bench.host import HostSample, HostSampler, cluster_parts
from pdrouter.bench.progress import Progress
from pdrouter.bench.scrape import MetricsSample, MetricsScraper
from pdrouter.bench.stats import RequestRecord
from pdrouter.bench.workload import RequestSpec
from pdrouter.core.errors import ConfigError


@dataclass(frozen=True)
class RunConfig:
    """How to drive one run (the workload itself is the list of ``RequestSpec`` s)."""

    base_url: str
    model: str
    rate: float | None = None
    burstiness: float = 1.0
    concurrency: int | None = None
    max_concurrency: int | None = None
    duration_s: float | None = None
    seed: int = 0
    metrics_url: str | None = None
    api_key: str | None = None
    timeout_s: float = 600.0
    time_scale: float = 1.0
    """The simulated workers' time scale (0 or 1: wall time)."""
    cluster_pid: int | None = None
    """The pid of the ``pdrouter up`` serving ``base_url`` on this machine, when known (``pdrouter bench
    compare``'s own cluster): its router's, workers' and Redis's CPU is sampled with the machine's
    (``pdrouter.bench.host``)."""

    @property
    def wall_per_sim_s(self) -> float:
        return self.time_scale if self.time_scale > 0 else 1.0

    def __post_init__(self) -> None:
        if self.rate is not None and not self.rate > 0:
            raise ConfigError(f"--rate must be > 0 requests/s, got {self.rate}")
        if self.concurrency is not None and self.concurrency <= 0:
            raise ConfigError(f"--concurrency must be >= 1, got {self.concurrency}")
        if self.max_concurrency is not None and self.max_concurrency <= 0:
            raise ConfigError(f"--max-concurrency must be >= 1, got {self.max_concurrency}")
        if self.duration_s is not None and not self.duration_s > 0:
            raise ConfigError(f"--duration must be > 0 seconds, got {self.duration_s}")
        if not self.base_url.startswith(("http://", "https://")):
            raise ConfigError(f"--url must be an http(s) URL such as http://127.0.0.1:8000/v1, got {self.base_url!r}")


@dataclass
class RunResult:
    records: list[RequestRecord]
    duration_s: float
    samples: list[MetricsSample] = field(default_factory=list)
    interrupted: bool = False
    host: list[HostSample] = field(default_factory=list)
    """This machine's CPU readings (``pdrouter.bench.host``), a second apart."""
    client: dict[str, int] = field(default_factory=dict)
    """The client's connection pool over the run (``ClientFigures.to_dict``)."""


async def run(config: RunConfig, specs: Sequence[RequestSpec], *,
              progress: Progress | None = None,
              on_record: Callable[[RequestRecord], None] | None = None) -> RunResult:
    """Drive ``specs`` against ``config.base_url``; every request ends as a record (see the module docstring)."""
    client = CompletionsClient(config.base_url, config.model, api_key=config.api_key, timeout_s=config.timeout_s)
    scraper = MetricsScraper(config.metrics_url, api_key=config.api_key) if config.metrics_url else None
    records: list[RequestRecord] = []
    zero = time.perf_counter()
    stretch = config.wall_per_sim_s
    deadline = zero + config.duration_s * stretch if config.duration_s else None
    in_flight: dict[int, tuple[RequestSpec, float]] = {}
    gate = asyncio.Semaphore(config.max_concurrency) if config.max_concurrency else None

    def finish(record: RequestRecord) -> None:
        records.append(record)
        if progress is not None:
            progress.update(record.ok)
        if on_record is not None:
            on_record(record)

    async def one(spec: RequestSpec) -> None:
        async with gate if gate is not None else contextlib.nullcontext():
            start = time.perf_counter() - zero
            in_flight[spec.index] = (spec, start)
            try:
                finish(await client.send(spec, start, zero))
            finally:
                in_flight.pop(spec.index, None)

    def past_deadline() -> bool:
        return deadline is not None and time.perf_counter() >= deadline

    async def open_loop(offsets: Sequence[float]) -> None:
        tasks: list[asyncio.Task[None]] = []
        try:
            for spec, offset in zip(specs, offsets, strict=True):
                delay = zero + offset - time.perf_counter()
                if delay > 0:
                    await asyncio.sleep(delay)
                if past_deadline():
                    break
                tasks.append(asyncio.create_task(one(spec)))
            await asyncio.gather(*tasks)
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def closed_loop(slots: int) -> None:
        queue = iter(specs)  # drawn as the slots free up: a long (lazy) sequence is never copied

        async def slot() -> None:
            while not past_deadline():
                spec = next(queue, None)
                if spec is None:
                    return
                await one(spec)

        workers = [asyncio.create_task(slot()) for _ in range(slots)]
        try:
            await asyncio.gather(*workers)
        finally:
            for t in workers:
                t.cancel()
            await asyncio.gather(*workers, return_exceptions=True)

    async def ticker(p: Progress) -> None:
        while True:  # a line off a terminal even while no request ends
            await asyncio.sleep(1.0)
            p.tick()

    interrupted = False
    host = HostSampler(cluster_parts(config.cluster_pid) if config.cluster_pid is not None else None)
    host.start(zero)
    if scraper is not None:
        scraper.start(zero)
    ticking = asyncio.create_task(ticker(progress)) if progress is not None else None
    try:
        if config.rate is not None:
            offsets = arrival_times(config.rate, len(specs), burstiness=config.burstiness, seed=config.seed)
            assert offsets is not None
            await open_loop([t * stretch for t in offsets])
        elif specs and all(s.arrival_s is not None for s in specs):
            await open_loop([(s.arrival_s or 0.0) * stretch for s in specs])
        else:
            await closed_loop(config.concurrency or len(specs) or 1)
    except asyncio.CancelledError:
        interrupted = True
    finally:
        duration = time.perf_counter() - zero
        for spec, start in list(in_flight.values()):
            records.append(RequestRecord(index=spec.index, start_s=start, input_tokens=spec.input_tokens,
                                         prompt_digest=spec.digest, error="cancelled"))
        if ticking is not None:
            ticking.cancel()
            await asyncio.gather(ticking, return_exceptions=True)
        if scraper is not None:
            await scraper.stop()
        await host.stop()
        await client.close()
    records.sort(key=lambda r: r.index)
    return RunResult(records, duration, scraper.samples if scraper is not None else [], interrupted, host.samples,
                     client.figures.to_dict())
