"""Fair queuing under a flood: three tenants on one simulated pool, with FIFO beside it, in one run.

One simulated disaggregated pool (``--backend sim`` on Llama-3-8B's geometry, H100s, ``--time-scale``
S: modeled time runs S times slower than the wall clock): ``--prefill`` prefill workers (one fleet
process) and ``--decode`` decode workers whose KV pools hold about a hundred requests each. Requests
have ``--prompt`` random token ids (never a prefix hit) and ``--output`` tokens. The pool is
decode-bound: prefill workers have room to spare, so requests wait for decode KV, in the admission
queue, which is where fairness is decided.

Two routers on the same workers and Redis: ``fair``, with a tenants file (tenant ``a`` weight 2,
``b`` and ``c`` weight 1, ``p`` weight 1 in the ``interactive`` class), and ``fifo``, without one
(every request one flow: the queue in arrival order, as before tenants). Phases, one after another:

1. ``capacity``: a closed loop of the decode pools' requests at once (and 20 % more) through ``fifo``:
   completions per second;
2. ``solo_b``, ``solo_c``: ``b`` alone, then ``c`` alone, Poisson arrivals at their fair share
   (weight ÷ Σ weights of ``a``, ``b``, ``c``, times the capacity), through ``fair``;
3. ``share``: the same ``b`` and ``c`` beside ``a`` at its share of the pool (a closed loop of its
   weight's share of the decode pools' requests), through ``fair``: the pool as busy as beside the
   flood, with nobody over its share;
4. ``fair``: the same ``b`` and ``c`` while ``a`` floods at ``--flood`` × the capacity, through
   ``fair``: the three tenants of the fairness targets;
5. ``priority``: the same, and ``p`` sends bursts of ``--burst`` requests at once in the interactive
   class, through ``fair``. ``p`` is admitted, and its prompts computed, before any of the others:
   here ``b`` and ``c`` are owed their share of what ``p`` leaves, and send more than that, so
   their figures in this phase show what a higher class costs them, not the flood;
6. ``fifo``: the load of ``priority`` through ``fifo`` (``p``'s bursts with no priority there);
7. ``backlog``: ``a``, ``b`` and ``c`` all flooding (each at the whole capacity), through ``fair``.

Each tenant's arrivals are the same sequence in every phase (a seed per tenant). Per phase and
tenant: requests sent, answered 200, refused (429), TTFT p50 / p99 / mean of those answered (``b``,
``c`` and ``p`` stream; ``a`` does not), and, from the router's metrics over the window, its queue
wait (mean, and the p99's histogram bucket) and the decode pools' booked share when its requests
arrived (Redis, sampled every 50 ms). Per phase: the simulated GPUs' late share of their modeled
time (the machine's load showing in the model) and this process's event-loop lag. Beside the
flood (and in ``backlog``): the requests per second the pool served, and ``b``'s and ``c``'s load,
what each sent ÷ its weight's share of its class's admissions (above 1 a tenant asks for more than
any fair order owes it, and its wait has no bound).

The targets' ratios: ``ratio_ttft_p99_{b,c}`` (fair ÷ solo, the acceptance's words) and
``ratio_ttft_p99_{b,c}_vs_share`` (fair ÷ share: what the flood itself costs them; ≤ 1.5). Alone,
``b`` meets an idle pool (short prefill queues, a decode pool a fifth booked), which no tenant of a
full shared pool is owed: ``share`` is the reference fair queuing can be held to. Admitted shares
(``*_share_error`` ≤ 0.10, over the completions of requests sent in the window) are measured against
the weighted max-min fair share of what each tenant asked: its weight's share when all ask for more
(``backlog``), and all it asked when it asked less (``b`` and ``c`` beside the flood, whose Poisson
arrivals over a window of a minute vary by some 10 % around their weight's share); then
``priority_ttft_p99_over_b`` (``p``'s bursts beside ``b``'s single requests, in ``priority``) and the
same ratios under FIFO for contrast.

``--fair-headroom``, ``--fair-headroom-requests`` and ``--fair-burst`` are passed to the ``fair`` router.
``--skip fifo,backlog`` leaves those phases out (the targets' ratios need only the others; ``priority``
may be skipped too). ``--prefill-chunk`` is the prefill workers' token budget a step: a prompt
waits for at most one step of work of a lower priority already running on its worker.

    python benchmarks/tenant_fairness.py [--quick] [--json] [--time-scale S] [--phase-s T] [--skip PHASES]
"""

from __future__ import annotations

import asyncio
import bisect
import contextlib
import multiprocessing
import random
import secrets
import statistics
import sys
import tempfile
import time
import zlib
from collections.abc import Iterator
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from _report import Report, base_parser
from prometheus_client.parser import text_string_to_metric_families
from redis.asyncio import Redis

from pdrouter.cli.local_cluster import ManagedProcess, worker_args
from pdrouter.core.capacity import plan_capacity
from pdrouter.core.gpu import get_gpu_preset
from pdrouter.core.model_spec import get_model_preset
from pdrouter.engine.model_folder import write_config_folder
from pdrouter.state.embedded_redis import EmbeddedRedis
from pdrouter.wire.security import INTERNAL_TOKEN_ENV

MODEL = "llama-3-8b"
REQUEST_TIMEOUT_S = 300.0
"""A request with no answer by then is given up (the router's queue timeout is 10 s)."""
WEIGHTS = {"a": 2.0, "b": 1.0, "c": 1.0}
KEYS = {t: f"{t}-key-{'z' * 24}" for t in ("a", "b", "c", "p")}
TENANTS = """
tenants:
  a: {weight: 2}
  b: {weight: 1}
  c: {weight: 1}
  p: {weight: 1, priority: interactive}
"""


@dataclass
class Outcome:
    """One request: when it was sent (monotonic), its status, its time to first token (s; streamed ones)."""

    tenant: str
    sent: float
    status: int
    ttft: float = 0.0
    trace_id: str = ""
    """With ``--trace``, a streamed request's W3C trace id (sampled: the router and workers record it)."""


@dataclass
class Phase:
    name: str
    outcomes: list[Outcome] = field(default_factory=list)
    window: tuple[float, float] = (0.0, 0.0)
    occupancy: list[tuple[float, float]] = field(default_factory=list)
    """(monotonic time, booked share of the decode pools) samples."""
    metrics: tuple[dict[str, float], dict[str, float]] = ({}, {})
    """The router's metrics at the window's start and at the phase's end."""
    lag: list[float] = field(default_factory=list)
    """This process's event-loop lag samples (s)."""
    engines: list[dict[str, float]] = field(default_factory=list)
    """Once a second in the window: requests running and waiting in the workers' engines, by role."""

    def occupancy_at(self, at: float) -> float:
        i = bisect.bisect_right(self.occupancy, (at, float("inf"))) - 1
        return self.occupancy[i][1] if i >= 0 else float("nan")

    def bucket_quantile(self, prefix: str, q: float) -> float:
        """The upper bound of the histogram bucket (series ``prefix``…``}``) holding quantile ``q`` of
        what it counted over the window."""
        bounds = sorted((float(k[len(prefix):-1]), k) for k in self.metrics[1] if k.startswith(prefix))
        counts = [(bound, self.delta(k)) for bound, k in bounds]
        total = counts[-1][1] if counts else 0.0
        return next((bound for bound, n in counts if n >= q * total), float("nan")) if total else float("nan")

    def delta(self, name: str) -> float:
        """How much ``name`` (with its labels, or without any: all its series) grew over the window."""
        before, after = self.metrics

        def total(flat: dict[str, float]) -> float:
            return sum(v for k, v in flat.items() if k == name or ("{" not in name and k.startswith(name + "{")))

        return total(after) - total(before)

    def of(self, tenant: str) -> list[Outcome]:
        return [o for o in self.outcomes if o.tenant == tenant]

    def measured(self, tenant: str) -> list[Outcome]:
        lo, hi = self.window
        return [o for o in self.of(tenant) if lo <= o.sent < hi]


class Client:
    """Raw HTTP/1.1 requests (one connection each), cheap enough to flood the router from this process."""

    def __init__(self, host: str, port: int, prompt_tokens: int, output: int, rng: random.Random,
                 trace: bool = False) -> None:
        self.host, self.port = host, port
        self.rng = rng
        self.trace = trace
        """Send a sampled ``traceparent`` with each streamed request (the flood's go untraced)."""
        # Text of the byte tokenizer: one token a character, with the BOS ``prompt_tokens`` in all.
        self._tail = "".join(rng.choice("abcdefghijklmnopqrstuvwxyz ") for _ in range(prompt_tokens - 9))
        self._output = output

    def _request(self, tenant: str, stream: bool, trace_id: str = "") -> bytes:
        # A fresh start: no prompt shares a prefix block with another.
        prompt = f"{self.rng.getrandbits(32):08x}{self._tail}"
        body = (f'{{"model":"{MODEL}","prompt":"{prompt}","max_tokens":{self._output},"ignore_eos":true,'
                f'"stream":{"true" if stream else "false"}}}').encode()
        traced = f"traceparent: 00-{trace_id}-{secrets.token_hex(8)}-01\r\n" if trace_id else ""
        return (f"POST /v1/completions HTTP/1.1\r\nhost: {self.host}\r\nauthorization: Bearer {KEYS[tenant]}\r\n"
                f"{traced}"
                f"content-type: application/json\r\nconnection: close\r\ncontent-length: {len(body)}\r\n\r\n"
                ).encode() + body

    async def metrics(self) -> dict[str, float]:
        """The router's ``/metrics``, flat: ``name`` plus its labels (``name{k=v,...}``) → value."""
        reader, writer = await asyncio.open_connection(self.host, self.port)
        try:
            writer.write(f"GET /metrics HTTP/1.1\r\nhost: {self.host}\r\nauthorization: Bearer {KEYS['a']}\r\n"
                         f"connection: close\r\n\r\n".encode())
            raw = await reader.read()
        finally:
            writer.close()
            with contextlib.suppress(OSError):
                await writer.wait_closed()
        flat: dict[str, float] = {}
        for family in text_string_to_metric_families(raw.split(b"\r\n\r\n", 1)[1].decode()):
            for sample in family.samples:
                labels = ",".join(f"{k}={v}" for k, v in sorted(sample.labels.items()) if k != "le")
                if "le" in sample.labels:
                    labels = f"{labels},le={sample.labels['le']}" if labels else f"le={sample.labels['le']}"
                key = f"{sample.name}{{{labels}}}" if labels else sample.name
                flat[key] = flat.get(key, 0.0) + sample.value
        return flat

    async def send(self, tenant: str, stream: bool, phase: Phase) -> None:
        """One request; one that has no answer within ``REQUEST_TIMEOUT_S`` is given up (status -1),
        so that no phase waits forever on a connection."""
        outcome = Outcome(tenant, time.monotonic(), 0, trace_id=secrets.token_hex(16) if self.trace and stream else "")
        phase.outcomes.append(outcome)
        try:
            await asyncio.wait_for(self._exchange(outcome, stream), REQUEST_TIMEOUT_S)
        except TimeoutError:
            outcome.status = -1

    async def _exchange(self, outcome: Outcome, stream: bool) -> None:
        start = time.perf_counter()
        tenant = outcome.tenant
        try:
            reader, writer = await asyncio.open_connection(self.host, self.port)
        except OSError:
            outcome.status = -1
            return
        try:
            writer.write(self._request(tenant, stream, outcome.trace_id))
            head = await reader.readuntil(b"\r\n\r\n")
            outcome.status = int(head.split(b" ", 2)[1])
            if outcome.status != 200:
                return
            if not stream:
                await reader.read()
                return
            while True:  # chunked SSE: the first data event is the first token
                size = int((await reader.readuntil(b"\r\n")).split(b";", 1)[0], 16)
                if size == 0:
                    break
                chunk = await reader.readexactly(size + 2)
                if not outcome.ttft and b"data: {" in chunk:
                    outcome.ttft = time.perf_counter() - start
        except (OSError, asyncio.IncompleteReadError, ValueError):
            outcome.status = -1
        finally:
            writer.close()
            with contextlib.suppress(OSError):
                await writer.wait_closed()


async def poisson(client: Client, tenant: str, rate: float, until: float, phase: Phase, stream: bool,
                  burst: int = 1, tasks: set[asyncio.Task[None]] | None = None) -> None:
    """Open-loop arrivals of ``tenant`` at ``rate`` per second (``burst`` requests each) until ``until``."""
    held = tasks if tasks is not None else set()
    rng = random.Random(zlib.crc32(tenant.encode()))  # the same arrivals in every phase and run
    next_at = time.monotonic() + rng.expovariate(rate)
    while next_at < until:
        await asyncio.sleep(max(0.0, next_at - time.monotonic()))
        for _ in range(burst):
            task = asyncio.create_task(client.send(tenant, stream, phase))
            held.add(task)
            task.add_done_callback(held.discard)
        next_at += rng.expovariate(rate)
    if tasks is None and held:
        await asyncio.wait(held)


def flood(host: str, port: int, prompt_tokens: int, output: int, loads: list[tuple[str, float]],
          until: float) -> list[tuple[str, float, int]]:
    """Open-loop, non-streamed ``loads`` (tenant, rate) until ``until`` (monotonic, the machine's
    clock), sent from a process of its own (``Flooder``): (tenant, sent, status) of each request."""
    phase = Phase("flood")
    client = Client(host, port, prompt_tokens, output, random.Random(11))

    async def main() -> None:
        await asyncio.gather(*(poisson(client, t, rate, until, phase, False) for t, rate in loads))

    asyncio.run(main())
    return [(o.tenant, o.sent, o.status) for o in phase.outcomes]


class Flooder:
    """Sends the floods from another process: in this one they took the event loop (a loop lag of
    seconds at the 99th percentile), and every TTFT measured here with it."""

    def __init__(self, prompt_tokens: int, output: int) -> None:
        self._sizes = (prompt_tokens, output)
        self._pool = ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn"))

    async def run(self, client: Client, loads: list[tuple[str, float]], until: float, phase: Phase) -> None:
        # Bounded: every request of the flood is (REQUEST_TIMEOUT_S), so its process ends by then.
        sent = await asyncio.wait_for(asyncio.get_running_loop().run_in_executor(
            self._pool, flood, client.host, client.port, *self._sizes, loads, until),
            until - time.monotonic() + REQUEST_TIMEOUT_S + 30.0)
        phase.outcomes += [Outcome(tenant, at, status) for tenant, at, status in sent]

    def close(self) -> None:
        """Without waiting on the flood's process: one still running (a phase cut short) is killed."""
        processes = list((getattr(self._pool, "_processes", None) or {}).values())
        self._pool.shutdown(wait=False, cancel_futures=True)
        for process in processes:
            if process.is_alive():
                process.kill()


async def closed_loop(client: Client, tenant: str, concurrency: int, until: float, phase: Phase) -> None:
    async def slot() -> None:
        while time.monotonic() < until:
            await client.send(tenant, False, phase)

    await asyncio.gather(*(slot() for _ in range(concurrency)))


def fair_allocation(demand: dict[str, int], weights: dict[str, float], capacity: float) -> dict[str, float]:
    """Weighted max-min fair shares of ``capacity``: each gets what it asked for, or its weight's share
    of what those asking for more are left (water-filling)."""
    owed: dict[str, float] = {}
    left = dict(demand)
    while left:
        level = capacity / sum(weights[t] for t in left)
        content = [t for t in left if left[t] <= weights[t] * level]
        if not content:
            owed.update({t: weights[t] * level for t in left})
            break
        for t in content:
            owed[t] = left.pop(t)
            capacity -= owed[t]
    return owed


def progress(message: str) -> None:
    """A line on stderr, so that a run of many minutes shows where it is (the report is on stdout)."""
    print(f"{time.strftime('%H:%M:%S')} {message}", file=sys.stderr, flush=True)


def spans_line(sink: Any, trace_id: str) -> str:
    """One trace's spans in the order they began: each one's name (its service's), its start after
    the first span's, its duration, and its worker attributes."""
    spans = sorted((s for s in sink.spans if s.trace_id == trace_id), key=lambda s: s.start_ns)
    if not spans:
        return "no spans received"
    t0 = spans[0].start_ns
    parts = []
    for s in spans:
        where = ",".join(f"{k.rsplit('.', 1)[-1]}={v}" for k, v in sorted(s.attributes.items())
                         if "worker" in k or "priority" in k)
        parts.append(f"{s.name}[{s.service.removeprefix('pdrouter-')}] +{(s.start_ns - t0) / 1e6:.0f}"
                     f"/{(s.end_ns - s.start_ns) / 1e6:.0f}ms{f' {where}' if where else ''}")
    return "; ".join(parts)


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))]


@dataclass
class Pool:
    procs: list[ManagedProcess]
    fair: Client
    fifo: Client
    redis_url: str


@contextlib.contextmanager
def pool(args: object, tmp: Path, sink: Any = None) -> Iterator[Pool]:
    """The workers, both routers and Redis; with ``sink`` (an ``OtlpSink``), the workers and the fair
    router export the spans of the sampled requests to it (and none of the others')."""
    a = args
    model = write_config_folder(get_model_preset(MODEL), tmp / MODEL)
    (tmp / "tenants.yaml").write_text(TENANTS)
    (tmp / "keys-fair").write_text("".join(f"{key} {tenant}\n" for tenant, key in KEYS.items()))
    (tmp / "keys-fifo").write_text("".join(f"{key}\n" for key in KEYS.values()))
    token = {INTERNAL_TOKEN_ENV: secrets.token_hex(16), "PDROUTER_KV_TOKEN": secrets.token_hex(16),
             "PDROUTER_KV_TOKEN_FILE": ""}
    traced = {} if sink is None else {**sink.environment(), "OTEL_BSP_SCHEDULE_DELAY": "500",
                                      "OTEL_TRACES_SAMPLER": "parentbased_traceidratio", "OTEL_TRACES_SAMPLER_ARG": "0"}
    procs: list[ManagedProcess] = []
    with EmbeddedRedis() as redis:
        try:
            sim = ["--gpu", "h100", "--time-scale", str(a.time_scale)]  # type: ignore[attr-defined]
            prefill = ManagedProcess("prefill", worker_args(
                "prefill", model, redis_url=redis.url, sim=[*sim, "--utilization", "0.5"], count=a.prefill,  # type: ignore[attr-defined]
                extra=("--worker-id", "prefill", "--max-batched-tokens", str(a.prefill_chunk))),  # type: ignore[attr-defined]
                env={**token, **traced})
            procs.append(prefill)
            for i in range(a.decode):  # type: ignore[attr-defined]
                procs.append(ManagedProcess(f"decode-{i}", worker_args(
                    "decode", model, redis_url=redis.url, sim=[*sim, "--utilization", str(a.decode_utilization)],  # type: ignore[attr-defined]
                    extra=("--worker-id", f"decode-{i}")), env={**token, **traced}))
            prefill.wait_ready_all(a.prefill, 120.0)  # type: ignore[attr-defined]
            for proc in procs[1:]:
                proc.wait_ready(120.0)
            routers = []
            fair = ["--tenants", str(tmp / "tenants.yaml"), "--fair-headroom", str(a.fair_headroom),  # type: ignore[attr-defined]
                    "--fair-headroom-requests", str(a.fair_headroom_requests),  # type: ignore[attr-defined]
                    "--fair-burst", str(a.fair_burst)]  # type: ignore[attr-defined]
            for name, extra in (("fair", fair), ("fifo", [])):
                router = ManagedProcess(f"router-{name}", [
                    "router", "--model", str(model), "--redis", redis.url, "--http-port", "0", "--grpc-port", "0",
                    "--api-key-file", str(tmp / f"keys-{name}"), "--local-prefill-tokens", "0",
                    "--queue-timeout-s", "10", "--queue-limit", str(a.queue_limit),  # type: ignore[attr-defined]
                    "--log-level", "ERROR", *extra], env={**token, **(traced if name == "fair" else {})})
                procs.append(router)
                routers.append(router)
            for router in routers:
                router.wait_ready(120.0)
            clients = []
            for router in routers:
                assert router.address is not None
                host, port = router.address.rsplit(":", 1)
                clients.append(Client(host, int(port), a.prompt, a.output, random.Random(7),  # type: ignore[attr-defined]
                                      trace=sink is not None))
            time.sleep(1.5)  # every router's pool has every worker
            yield Pool(procs, clients[0], clients[1], redis.url)
        finally:
            for proc in reversed(procs):
                proc.stop()


async def run(args: object, report: Report) -> None:
    a = args
    flooder = Flooder(a.prompt, a.output)  # type: ignore[attr-defined]
    sink = None
    if a.trace:  # type: ignore[attr-defined]
        from pdrouter.testing.otlp import OtlpSink

        sink = OtlpSink()
    with contextlib.ExitStack() as stack:
        if sink is not None:
            stack.enter_context(sink)
        await _run(args, report, flooder, sink)


async def _run(args: object, report: Report, flooder: Flooder, sink: Any) -> None:
    a = args
    phase_s: float = a.phase_s  # type: ignore[attr-defined]
    warmup: float = a.warmup  # type: ignore[attr-defined]
    with tempfile.TemporaryDirectory() as tmp, pool(args, Path(tmp), sink) as p, contextlib.closing(flooder):
        redis = Redis.from_url(p.redis_url)
        # 1. the pool's capacity: completions per second of a closed loop that keeps it full
        cap_phase = Phase("capacity")
        until = time.monotonic() + phase_s
        cap_phase.window = (time.monotonic() + warmup, until)
        progress(f"phase capacity: {phase_s:g} s")
        await closed_loop(p.fifo, "a", a.concurrency, until, cap_phase)  # type: ignore[attr-defined]
        done = [o for o in cap_phase.measured("a") if o.status == 200]
        capacity = len(done) / (until - cap_phase.window[0])
        if not done:
            raise SystemExit(f"no request completed in the capacity phase's {phase_s - warmup:g} s: raise --phase-s")
        report.add("fairness_capacity_rps", round(capacity, 2), "requests/s")
        share = {t: w / sum(WEIGHTS.values()) for t, w in WEIGHTS.items()}
        # p's bursts (the interactive class, in ``priority`` only) are admitted before any other request.
        standard = capacity - a.burst_rate * a.burst  # type: ignore[attr-defined]
        if standard <= 0.2 * capacity:
            raise SystemExit(f"p's bursts ask for {capacity - standard:.2f} of the {capacity:.2f} requests/s: "
                             f"lower --burst-rate")
        report.add("fairness_standard_class_rps", round(standard, 2),
                   "requests/s (the capacity less p's bursts, in priority)")
        rates = {t: capacity * share[t] for t in ("b", "c")}

        async def phase(name: str, client: Client, loads: list[tuple[str, float, bool, int]],
                        closed: tuple[str, int] | None = None) -> Phase:
            """Open-loop ``loads`` (tenant, rate, streamed, burst) and, with ``closed`` (tenant,
            concurrency), a closed loop beside them."""
            ph = Phase(name)
            start = time.monotonic()
            progress(f"phase {name}: {phase_s:g} s")
            until = start + phase_s
            ph.window = (start + warmup, until)
            tasks: set[asyncio.Task[None]] = set()
            watch = asyncio.create_task(observe(client, ph))
            loops = [] if closed is None else [closed_loop(client, closed[0], closed[1], until, ph)]
            floods = [(t, rate) for t, rate, stream, _ in loads if not stream]
            if floods:
                loops.append(flooder.run(client, floods, until, ph))
            try:
                await asyncio.gather(*(poisson(client, t, rate, until, ph, stream, burst, tasks)
                                       for t, rate, stream, burst in loads if stream), *loops)
                if tasks:
                    await asyncio.wait(tasks)
            finally:
                watch.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await watch
            progress(f"phase {name}: every request answered or given up; reading the router's metrics")
            ph.metrics = (ph.metrics[0], await client.metrics())
            return ph

        async def observe(client: Client, ph: Phase) -> None:
            """Samples the decode pools' booked share (Redis, every 50 ms) and this loop's lag; the
            router's metrics once the measured window opens."""
            first = await client.metrics()
            capacity = sum(v for k, v in first.items() if k.startswith("pdrouter_kv_capacity_blocks{"))
            used_keys = [k async for k in redis.scan_iter(match="*kv:used:*")]
            scraped = False
            next_engines = ph.window[0]
            while True:
                at = time.monotonic()
                if not scraped and at >= ph.window[0]:
                    scraped = True
                    ph.metrics = (await client.metrics(), {})
                if at >= next_engines and at < ph.window[1]:
                    next_engines = at + 1.0
                    flat = await client.metrics()
                    ph.engines.append({f"{what}_{role}": sum(
                        v for k, v in flat.items() if k.startswith(f"pdrouter_worker_{what}_requests{{")
                        and f"role={role}" in k) for what in ("running", "waiting") for role in ("prefill", "decode")})
                used = sum(int(v or 0) for v in await redis.mget(used_keys)) if used_keys else 0
                ph.occupancy.append((at, used / capacity if capacity else float("nan")))
                await asyncio.sleep(0.05)
                ph.lag.append(max(0.0, time.monotonic() - at - 0.05))

        solo = {t: await phase(f"solo_{t}", p.fair, [(t, rates[t], True, 1)]) for t in ("b", "c")}
        # The reference beside the flood: the pool as busy, a no further than its share of it.
        share_phase = await phase("share", p.fair, [("b", rates["b"], True, 1), ("c", rates["c"], True, 1)],
                                  closed=("a", max(1, round(a.pool_requests * share["a"]))))  # type: ignore[attr-defined]
        flooding = ("a", a.flood * capacity, False, 1)  # type: ignore[attr-defined]
        burst = ("p", a.burst_rate, True, a.burst)  # type: ignore[attr-defined]
        fair = await phase("fair", p.fair, [flooding, ("b", rates["b"], True, 1), ("c", rates["c"], True, 1)])
        skip = set(a.skip)  # type: ignore[attr-defined]
        prio = None if "priority" in skip else \
            await phase("priority", p.fair, [flooding, ("b", rates["b"], True, 1), ("c", rates["c"], True, 1), burst])
        fifo = None if "fifo" in skip else \
            await phase("fifo", p.fifo, [flooding, ("b", rates["b"], True, 1), ("c", rates["c"], True, 1), burst])
        backlog = None if "backlog" in skip else \
            await phase("backlog", p.fair, [(t, capacity, False, 1) for t in WEIGHTS])

    def ttfts(ph: Phase, tenant: str) -> list[float]:
        return [o.ttft for o in ph.measured(tenant) if o.status == 200 and o.ttft]

    for ph in (*solo.values(), share_phase, fair, *(x for x in (prio, fifo, backlog) if x is not None)):
        for tenant in ("a", "b", "c", "p"):
            mine = ph.measured(tenant)
            if not mine:
                continue
            ok = [o for o in mine if o.status == 200]
            report.add(f"{ph.name}_{tenant}_sent", len(mine), "requests")
            report.add(f"{ph.name}_{tenant}_ok", len(ok), "requests")
            report.add(f"{ph.name}_{tenant}_refused", sum(o.status == 429 for o in mine), "requests")
            t = ttfts(ph, tenant)
            if t:
                report.add(f"{ph.name}_{tenant}_ttft_p50_ms", round(statistics.median(t) * 1e3, 1), "ms")
                report.add(f"{ph.name}_{tenant}_ttft_p99_ms", round(pct(t, 0.99) * 1e3, 1), "ms")
                report.add(f"{ph.name}_{tenant}_ttft_mean_ms", round(statistics.fmean(t) * 1e3, 1), "ms")
            waits = ph.delta(f"pdrouter_tenant_queue_wait_seconds_count{{tenant={tenant}}}")
            if waits and tenant != "a":
                report.add(f"{ph.name}_{tenant}_past_share", round(ph.delta(
                    f"pdrouter_tenant_past_share_total{{tenant={tenant}}}") / waits, 3),
                    "of its admissions (past its fair share: a lower engine priority)")
            if waits:
                wait_s = ph.delta(f"pdrouter_tenant_queue_wait_seconds_sum{{tenant={tenant}}}") / waits
                report.add(f"{ph.name}_{tenant}_queue_wait_mean_ms", round(wait_s * 1e3, 1), "ms")
                report.add(f"{ph.name}_{tenant}_queue_wait_p99_ms", round(ph.bucket_quantile(
                    f"pdrouter_tenant_queue_wait_seconds_bucket{{tenant={tenant},le=", 0.99) * 1e3, 1),
                    "ms (upper bound of its histogram bucket)")
            if ph.occupancy and t:
                at = [ph.occupancy_at(o.sent) for o in ok if o.ttft]
                report.add(f"{ph.name}_{tenant}_pool_booked_on_arrival", round(statistics.fmean(at), 3),
                           "of the decode pools (mean)")
                if ph is fair and tenant in ("b", "c"):
                    for i, o in enumerate(sorted((o for o in ok if o.ttft), key=lambda o: -o.ttft)[:3], 1):
                        booked = [v for when, v in ph.occupancy if o.sent <= when <= o.sent + o.ttft]
                        report.add(f"{ph.name}_{tenant}_slowest_{i}", f"{o.ttft * 1e3:.0f} ms, sent at "
                                   f"{o.sent - ph.window[0]:+.1f} s, the decode pools booked at most "
                                   f"{max(booked, default=float('nan')):.3f} until its first token")
                        if sink is not None and o.trace_id:
                            report.add(f"{ph.name}_{tenant}_slowest_{i}_spans", spans_line(sink, o.trace_id))
        waits = ph.delta("pdrouter_queue_time_seconds_count")
        if waits:
            report.add(f"{ph.name}_queue_wait_mean_ms",
                       round(ph.delta("pdrouter_queue_time_seconds_sum") / waits * 1e3, 1), "ms (all tenants)")
        modeled = ph.delta("pdrouter_worker_sim_modeled_seconds")
        late = ph.delta("pdrouter_worker_sim_late_seconds")
        if modeled:
            report.add(f"{ph.name}_sim_late_share", round(late / modeled, 3), "of modeled GPU time (machine load)")
        if ph.lag:
            report.add(f"{ph.name}_client_loop_lag_p99_ms", round(pct(ph.lag, 0.99) * 1e3, 1), "ms")
        for key in (ph.engines[0] if ph.engines else {}):
            report.add(f"{ph.name}_engines_{key}_mean", round(statistics.fmean(e[key] for e in ph.engines), 1),
                       "requests (workers' heartbeats, once a second)")
        if ph.occupancy:
            lo, hi = ph.window
            inside = [v for at, v in ph.occupancy if lo <= at < hi]
            if inside:
                report.add(f"{ph.name}_pool_booked_mean", round(statistics.fmean(inside), 3), "of the decode pools")
        admitted = {t: sum(o.status == 200 for o in ph.measured(t)) for t in WEIGHTS}
        total = sum(admitted.values())
        span = ph.window[1] - ph.window[0]
        if ph.name in ("fair", "priority", "fifo", "backlog") and total:
            served = sum(o.status == 200 for o in ph.outcomes if ph.window[0] <= o.sent < ph.window[1])
            report.add(f"{ph.name}_served_rps", round(served / span, 2),
                       "requests/s (all tenants' answered requests sent in the window)")
            for t in ("b", "c"):
                # What it sent ÷ its weight's share of what its class was served: above 1 it asks
                # for more than any fair order owes it, and its wait has no bound.
                report.add(f"{ph.name}_{t}_load", round(len(ph.measured(t)) / (share[t] * total), 2),
                           "× its weight's share of its class's admissions")
        if ph.name in ("fair", "priority", "fifo", "backlog") and total:
            # What each is owed: its weight's share of what was admitted, or what it asked when it
            # asked less (weighted max-min fairness over the requests each sent in the window).
            owed = fair_allocation({t: len(ph.measured(t)) for t in WEIGHTS}, WEIGHTS, total)
            for t in WEIGHTS:
                report.add(f"{ph.name}_{t}_share", round(admitted[t] / total, 3))
                report.add(f"{ph.name}_{t}_fair_share", round(owed[t] / total, 3), f"(weight share {share[t]:g})")
                report.add(f"{ph.name}_{t}_share_error", round(abs(admitted[t] - owed[t]) / owed[t], 3),
                           "of its fair share (≤ 0.10)" if ph is not prio else
                           "of its fair share (b and c ask for more than their class's share here; no target)")
    for t in ("b", "c"):
        share_p99 = pct(ttfts(share_phase, t), 0.99)
        report.add(f"ratio_ttft_p99_{t}_vs_share", round(pct(ttfts(fair, t), 0.99) / share_p99, 2),
                   "× beside a at its share (≤ 1.5)")
        solo_p99 = pct(ttfts(solo[t], t), 0.99)
        report.add(f"ratio_ttft_p99_{t}", round(pct(ttfts(fair, t), 0.99) / solo_p99, 2), "× solo (≤ 1.5)")
        if fifo is not None:
            served = ttfts(fifo, t)
            report.add(f"fifo_ratio_ttft_p99_{t}", round(pct(served, 0.99) / solo_p99, 2) if served else "none served",
                       "× solo")
    for ph in (x for x in (prio, fifo) if x is not None):
        p_ttft, b_ttft = ttfts(ph, "p"), ttfts(ph, "b")
        report.add(f"{'' if ph is prio else 'fifo_'}priority_ttft_p99_over_b",
                   round(pct(p_ttft, 0.99) / pct(b_ttft, 0.99), 2) if p_ttft and b_ttft else "none served",
                   f"(bursts of {a.burst} beside single requests)")  # type: ignore[attr-defined]


def main() -> None:
    parser = base_parser(__doc__ or "")
    parser.add_argument("--time-scale", type=float, default=10.0)
    parser.add_argument("--phase-s", type=float, default=60.0, help="seconds per phase")
    parser.add_argument("--warmup", type=float, default=20.0, help="seconds of each phase not measured")
    parser.add_argument("--prefill", type=int, default=8, help="prefill workers (one fleet process)")
    parser.add_argument("--decode", type=int, default=1, help="decode workers")
    parser.add_argument("--prompt", type=int, default=2048, help="prompt tokens")
    parser.add_argument("--output", type=int, default=64, help="output tokens")
    parser.add_argument("--prefill-chunk", type=int, default=512,
                        help="the prefill workers' token budget a step (--max-batched-tokens): a prompt waits "
                             "at most one step of lower-priority work")
    parser.add_argument("--flood", type=float, default=10.0, help="tenant a's rate, × the capacity")
    parser.add_argument("--burst", type=int, default=6, help="requests of each of p's bursts")
    parser.add_argument("--burst-rate", type=float, default=0.2, help="p's bursts per second")
    parser.add_argument("--queue-limit", type=int, default=32,
                        help="each router's admission queue (--queue-limit): a flood past it is refused at once")
    parser.add_argument("--fair-headroom", type=float, default=0.05, help="the fair router's --fair-headroom")
    parser.add_argument("--fair-headroom-requests", type=float, default=0.0,
                        help="the fair router's --fair-headroom-requests")
    parser.add_argument("--fair-burst", type=float, default=8.0, help="the fair router's --fair-burst")
    parser.add_argument("--trace", action="store_true",
                        help="trace b's, c's and p's requests (OTLP, to a receiver in this process) and print "
                             "the spans of b's and c's slowest beside the flood (needs the otel extra)")
    parser.add_argument("--skip", type=lambda v: [x for x in v.split(",") if x], default=[],
                        help="phases to leave out, comma-separated: priority, fifo, backlog (the rest give the ratios)")
    parser.add_argument("--decode-utilization", type=float, default=0.5,
                        help="the decode workers' share of an H100 (sizes their KV pools: ~90 requests at 0.5)")
    parser.add_argument("--concurrency", type=int, default=0,
                        help="the capacity phase's closed loop (0: the decode pools' requests at once, and 20 %% more)")
    args = parser.parse_args()
    if args.prefill_chunk < 1:
        parser.error(f"--prefill-chunk must be >= 1 token, got {args.prefill_chunk}")
    if set(args.skip) - {"priority", "fifo", "backlog"}:
        parser.error(f"--skip takes priority, fifo and backlog, got {','.join(args.skip)}")
    if args.quick:  # a smoke run: every phase, too short for steady state
        args.time_scale, args.phase_s, args.warmup, args.prefill, args.prompt, args.output = 3.0, 2.0, 0.5, 2, 512, 16
        args.decode_utilization = 0.25
    spec = get_model_preset(MODEL)
    blocks = plan_capacity(spec, get_gpu_preset("h100"), utilization=args.decode_utilization).num_blocks
    args.pool_requests = args.decode * (blocks // -(-(args.prompt + args.output) // 16))
    if not args.concurrency:
        args.concurrency = int(1.2 * args.pool_requests) + 1
    report = Report()
    asyncio.run(run(args, report))
    if args.quick:
        report.add("note", "quick run: phases too short for p99 figures to mean much")
    report.emit(args.json)


if __name__ == "__main__":
    main()
