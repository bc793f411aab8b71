"""Router replicas on one Redis: throughput per replica count, and what each replica costs.

``measure_replicas`` starts one embedded Redis and ``DECODE_WORKERS`` simulated decode workers
(``--backend sim --time-scale 0``: no modeled GPU time, so a worker costs only its own CPU: gRPC,
scheduling, the simulated step), then, for 1, 2 and 4 router replicas (``pdrouter router``, one
OS process each, as a deployment runs them, all on that Redis), drives a fixed closed-loop load
through their OpenAI doors: ``CONCURRENCY`` requests in flight in all, slot ``i`` on replica
``i % N``, a 20-token prompt (the decode worker prefills it itself) and ``OUTPUT_TOKENS`` tokens
each, not streamed. The pool is small (``DECODE_BLOCKS`` per worker; a request needs
``ceil(36 / 16) = 3``): the load books about 3/4 of it, so credit chunks stop at half the pool
and the bookings of all replicas together run close to the pool's size, where an over-booking
would show.

Every figure is named ``replicas_<figure>_r<N>`` (N replicas):

* ``throughput_rps``: requests answered with 200 per second; ``errors``: requests answered
  otherwise (429 / 503 / a broken connection), which must stay 0 at this load;
* ``overcommit_violations``: polls in which a worker's bookings (or its ``kv:used``) exceeded its
  registered ``capacity_blocks``: must be 0. The poller is a process of its own that reads Redis
  every 2 ms (``poll_interval_ms``: the interval it kept), one ``MULTI`` per poll (each worker
  incarnation's bookings hash and ``kv:used``); ``ledger_mismatches``: polls in which ``kv:used``
  was not the sum of the bookings (must be 0); ``peak_booked_share``: the largest share of a
  worker's pool it saw booked; ``bookings_left``: blocks still booked once the replicas stopped
  (must be 0);
* ``router_rss_mib``: resident memory of one replica (mean) after the run; ``router_idle_cores``:
  CPU one replica uses with nothing to serve (pool refresh, metrics, lease renewal), per second;
  ``router_cpu_us_per_req``: CPU of all replicas together (utime + stime, read through each
  process's CPU clock) per request; ``worker_cpu_us_per_req``, ``redis_cpu_us_per_req``
  (``INFO cpu``; the poller's reads included) and ``client_cpu_us_per_req`` (this process, the
  load generator) likewise; ``router_cores``, ``worker_cores``, ``redis_cores``: the same as cores
  busy; ``cpu_busy_cores``: all of it and the poller; ``machine_busy_cores``: the machine's
  (``/proc/stat``), whatever else runs on it included; ``cpu_us_per_req``: replicas + workers +
  Redis + load generator per request, and ``cpu_bound_rps``: the cores ÷ that, the throughput
  this machine would allow if nothing else ran on it (steadier than ``throughput_rps`` on a
  shared machine);
* ``admitted_per_s`` and ``admitted_on_credit_share``: admissions the replicas made (their
  ``pdrouter_admission_admitted_total``) and the share made in memory from credit;
  ``bookings_per_s``: reservations the booking script made in Redis (``INCRBY`` calls in
  ``INFO commandstats``: the script's only use of it, once per request booked alone or credit
  chunk); ``script_calls_per_s``: every script call (booking and release batches, lease
  renewals, the workers' heartbeats).

Then ``replicas_throughput_ratio_r<N>`` (÷ the 1-replica throughput) and ``replicas_limit``, what
bounds the throughput at 4 replicas in words: the cores when the machine is busy, with each
part's share, else the load's concurrency or the pool.
"""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import os
import secrets
import socket
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import hiredis
import httpx
import redis.asyncio as aioredis
from _load import HttpCompletions, cpu_seconds
from _report import Report

from pdrouter.cli.local_cluster import ManagedProcess, worker_args
from pdrouter.core.model_spec import get_model_preset
from pdrouter.core.workers import WorkerRole
from pdrouter.engine.model_folder import write_config_folder
from pdrouter.state.embedded_redis import EmbeddedRedis
from pdrouter.state.keys import PoolKeys
from pdrouter.state.registry import WorkerRegistry
from pdrouter.wire.security import INTERNAL_TOKEN_ENV

MODEL = "tiny"
REPLICAS = (1, 2, 4)
DECODE_WORKERS = 2
DECODE_BLOCKS = 64
CONCURRENCY = 32
PROMPT_IDS = list(range(100, 120))
OUTPUT_TOKENS = 16
POLL_INTERVAL_S = 0.002
REQUEST_TIMEOUT_S = 30.0


@dataclass(frozen=True)
class Watched:
    """One decode worker incarnation the poller reads: its bookings hash, its used counter, its pool."""

    worker_id: str
    book_key: str
    used_key: str
    capacity: int


@dataclass
class PollResult:
    """What the poller saw in all."""

    polls: int
    seconds: float
    violations: int
    """Polls in which a worker's bookings or its ``kv:used`` exceeded its capacity."""
    mismatches: int
    """Polls in which a worker's ``kv:used`` was not the sum of its bookings."""
    peak_share: float
    first_violation: str
    error: str = ""
    """Why the poller stopped early (empty: it ran until told to stop)."""


def _resp(*args: str) -> bytes:
    """One Redis command in RESP."""
    out = [f"*{len(args)}\r\n".encode()]
    for arg in args:
        data = arg.encode()
        out.append(b"$%d\r\n%s\r\n" % (len(data), data))
    return b"".join(out)


def _poll(url: str, watched: list[Watched], interval: float, stop: Any, out: Any) -> None:
    """The poller process: read every watched worker's bookings every ``interval`` until ``stop``.

    One transaction per poll (``MULTI``: ``HVALS`` of the bookings hash and ``GET`` of ``kv:used``
    per worker), so each poll sees the ledger between two scripts, never inside one. The commands
    are encoded once and sent on a bare socket (replies parsed by hiredis): a poll then costs the
    poller ~40 µs of CPU, where a redis-py pipeline took ~400 µs (a fifth of a core at 2 ms).
    """
    host, port = url.split("//", 1)[1].split("/", 1)[0].rsplit(":", 1)
    request = _resp("MULTI") + b"".join(_resp("HVALS", w.book_key) + _resp("GET", w.used_key) for w in watched) \
        + _resp("EXEC")
    replies = 2 + 2 * len(watched)  # +OK, a +QUEUED per command, then EXEC's array
    sock = socket.create_connection((host, int(port)))
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    reader = hiredis.Reader()
    polls = violations = mismatches = 0
    peak = 0.0
    first = ""
    error = ""
    start = next_at = time.monotonic()
    try:
        while not stop.is_set():
            sock.sendall(request)
            got: list[Any] = []
            while len(got) < replies:
                reply = reader.gets()
                if reply is False:
                    data = sock.recv(65536)
                    if not data:
                        raise ConnectionError("Redis closed the poller's connection")
                    reader.feed(data)
                    continue
                if isinstance(reply, hiredis.ReplyError):
                    raise reply
                got.append(reply)
            values = got[-1]
            polls += 1
            for i, w in enumerate(watched):
                booked = sum(int(v) for v in values[2 * i])
                used = int(values[2 * i + 1] or 0)
                peak = max(peak, booked / w.capacity)
                mismatches += booked != used
                if booked > w.capacity or used > w.capacity:
                    violations += 1
                    first = first or f"{w.worker_id}: {booked} booked, used {used}, capacity {w.capacity}"
            next_at += interval
            time.sleep(max(0.0, next_at - time.monotonic()))
    except Exception as exc:  # reported, so that a poller that died never reads as "no violation"
        error = f"{type(exc).__name__}: {exc}"
    finally:
        sock.close()
        out.put(PollResult(polls, time.monotonic() - start, violations, mismatches, peak, first, error))


class Poller:
    """The over-commit poller, in a process of its own (its 2 ms loop then neither slows nor is
    slowed by the load generator)."""

    def __init__(self, url: str, watched: list[Watched]) -> None:
        ctx = mp.get_context("spawn")
        self._stop = ctx.Event()
        self._out: Any = ctx.Queue()
        self.proc = ctx.Process(target=_poll, args=(url, watched, POLL_INTERVAL_S, self._stop, self._out),
                                daemon=True)
        self.proc.start()

    def finish(self) -> PollResult:
        self._stop.set()
        result: PollResult = self._out.get(timeout=30)
        self.proc.join(10)
        return result

    def kill(self) -> None:
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(5)


def _machine_busy_s() -> float:
    """CPU seconds every core of the machine spent busy so far (``/proc/stat``: all but idle and iowait)."""
    fields = [int(x) for x in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    return (sum(fields) - fields[3] - fields[4]) / os.sysconf("SC_CLK_TCK")


def _rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


async def _redis_figures(client: aioredis.Redis) -> tuple[float, int, int]:
    """Redis's CPU seconds so far, and its INCRBY and EVALSHA calls so far."""
    cpu = await client.info("cpu")
    stats = await client.info("commandstats")
    return (float(cpu["used_cpu_sys"]) + float(cpu["used_cpu_user"]),
            int(stats.get("cmdstat_incrby", {}).get("calls", 0)),
            int(stats.get("cmdstat_evalsha", {}).get("calls", 0)))


async def _admitted(http: httpx.AsyncClient, addresses: list[str]) -> tuple[float, float]:
    """Admissions so far, and those on credit, summed over the replicas' ``/metrics``."""
    total = credit = 0.0
    for address in addresses:
        text = (await http.get(f"http://{address}/metrics")).text
        for line in text.splitlines():
            if line.startswith("pdrouter_admission_admitted_total "):
                total += float(line.split()[1])
            elif line.startswith("pdrouter_admission_admitted_on_credit_total "):
                credit += float(line.split()[1])
    return total, credit


@dataclass
class Door:
    """One replica's OpenAI door, and the keep-alive connections of the slots sent to it."""

    client: HttpCompletions
    connections: dict[int, tuple[asyncio.StreamReader, asyncio.StreamWriter]]


def _door(address: str) -> Door:
    host, port = address.rsplit(":", 1)
    connections: dict[int, tuple[asyncio.StreamReader, asyncio.StreamWriter]] = {}
    return Door(HttpCompletions(host, int(port), MODEL, PROMPT_IDS, OUTPUT_TOKENS, stream=False,
                                connections=connections), connections)


async def _drive(doors: list[Door], seconds: float) -> tuple[int, int]:
    """Closed loop over the replicas for ``seconds``: (requests answered 200, others)."""
    ok = failed = 0
    deadline = time.perf_counter() + seconds

    async def slot(i: int) -> None:
        nonlocal ok, failed
        door = doors[i % len(doors)]
        while time.perf_counter() < deadline:
            try:
                async with asyncio.timeout(REQUEST_TIMEOUT_S):  # a hung replica fails the request, not the run
                    await door.client.once(i)
                ok += 1
            except (RuntimeError, OSError, asyncio.IncompleteReadError, TimeoutError):
                failed += 1
                conn = door.connections.pop(i, None)  # its unread reply must not be taken for the next
                if conn is not None:
                    conn[1].close()
                await asyncio.sleep(0.01)

    await asyncio.gather(*(slot(i) for i in range(CONCURRENCY)))
    return ok, failed


def _router(model: Path, url: str, env: dict[str, str], name: str) -> ManagedProcess:
    return ManagedProcess(name, ["router", "--model", str(model), "--redis", url, "--http-port", "0",
                                 "--grpc-port", "0", "--log-level", "WARNING"], env=env)


async def _watched(client: aioredis.Redis) -> list[Watched]:
    """The live decode worker incarnations and their pools, from the registry (waits for all of them)."""
    registry, keys = WorkerRegistry(client, MODEL), PoolKeys("pdr", MODEL)
    for _ in range(200):
        live = await registry.live_workers(WorkerRole.DECODE)
        if len(live) == DECODE_WORKERS:
            break
        await asyncio.sleep(0.05)
    else:
        raise RuntimeError(f"only {len(live)} of {DECODE_WORKERS} decode workers registered")
    return [Watched(w.record.worker_id, keys.kv_bookings(w.record.worker_id, w.record.epoch),
                    keys.kv_used(w.record.worker_id, w.record.epoch), w.record.capacity_blocks) for w in live]


async def _booked(client: aioredis.Redis, watched: list[Watched]) -> int:
    return sum(int(v or 0) for v in await client.mget([w.used_key for w in watched]))


async def _run_replicas(n: int, model: Path, url: str, env: dict[str, str], workers: list[ManagedProcess],
                     watched: list[Watched], seconds: float, warm_s: float, idle_s: float,
                     report: Report) -> Figures:
    """Measure ``n`` replicas and report their figures (``replicas_<name>_r<n>``)."""
    client = aioredis.Redis.from_url(url)
    routers = [_router(model, url, env, f"router-{i}") for i in range(n)]  # started at once
    poller: Poller | None = None
    doors: list[Door] = []
    try:
        addresses = [r.wait_ready() for r in routers]
        doors = [_door(a) for a in addresses]
        poller = Poller(url, watched)
        pids, wpids = [r.proc.pid for r in routers], [w.proc.pid for w in workers]
        ppid = poller.proc.pid or 0

        def cpus() -> tuple[float, float, float, float]:
            """CPU seconds so far: the replicas, the workers, this process, the poller."""
            return (sum(cpu_seconds(p) for p in pids), sum(cpu_seconds(p) for p in wpids), time.process_time(),
                    cpu_seconds(ppid))

        idle0 = cpus()[0]
        await asyncio.sleep(idle_s)  # what the replicas cost with nothing to serve
        idle = (cpus()[0] - idle0) / idle_s / n
        async with httpx.AsyncClient(timeout=30) as http:
            await _drive(doors, warm_s)  # connections open, workers discovered, credit booked
            adm0, cred0 = await _admitted(http, addresses)
            redis0 = await _redis_figures(client)
            cpu0, m0, t0 = cpus(), _machine_busy_s(), time.perf_counter()
            ok, failed = await _drive(doors, seconds)
            cpu1, m1, t1 = cpus(), _machine_busy_s(), time.perf_counter()
            redis1 = await _redis_figures(client)
            adm1, cred1 = await _admitted(http, addresses)
        rss = sum(_rss_mib(p) for p in pids) / n
        polled = poller.finish()
        if polled.error:
            raise RuntimeError(f"the over-commit poller failed after {polled.polls} polls: {polled.error}")
    finally:
        for d in doors:
            await d.client.close()
        if poller is not None:
            poller.kill()
        for r in routers:
            r.stop()
    left = -1
    for _ in range(100):  # a replica that stops gives its bookings and credit back
        left = await _booked(client, watched)
        if left == 0:
            break
        await asyncio.sleep(0.05)
    await client.aclose()
    wall = t1 - t0
    served = max(ok, 1)
    f = Figures(rps=ok / wall, routers=(cpu1[0] - cpu0[0]) / wall, workers=(cpu1[1] - cpu0[1]) / wall,
                client=(cpu1[2] - cpu0[2]) / wall, poller=(cpu1[3] - cpu0[3]) / wall,
                redis=(redis1[0] - redis0[0]) / wall, machine=(m1 - m0) / wall)
    per_req = wall / served * 1e6  # cores -> µs per request

    def add(name: str, value: float | int | str, unit: str = "") -> None:
        report.add(f"replicas_{name}_r{n}", value, unit)

    add("throughput_rps", f.rps, "req/s")
    add("errors", failed, "requests")
    add("overcommit_violations", polled.violations, "polls")
    if polled.first_violation:
        add("first_violation", polled.first_violation)
    add("ledger_mismatches", polled.mismatches, "polls")
    add("polls", polled.polls, "polls")
    add("poll_interval_ms", polled.seconds / max(polled.polls, 1) * 1e3, "ms")
    add("peak_booked_share", polled.peak_share, "ratio")
    add("bookings_left", left, "blocks")
    add("router_rss_mib", rss, "MiB")
    add("router_idle_cores", idle, "cores")
    add("router_cpu_us_per_req", f.routers * per_req, "us")
    add("worker_cpu_us_per_req", f.workers * per_req, "us")
    add("redis_cpu_us_per_req", f.redis * per_req, "us")
    add("client_cpu_us_per_req", f.client * per_req, "us")
    add("cpu_us_per_req", f.serving * per_req, "us")
    add("cpu_bound_rps", _cores() / max(f.serving * per_req, 1e-9) * 1e6, "req/s")
    add("admitted_per_s", (adm1 - adm0) / wall, "1/s")
    add("admitted_on_credit_share", (cred1 - cred0) / max(adm1 - adm0, 1), "ratio")
    add("bookings_per_s", (redis1[1] - redis0[1]) / wall, "1/s")
    add("script_calls_per_s", (redis1[2] - redis0[2]) / wall, "1/s")
    add("router_cores", f.routers, "cores")
    add("worker_cores", f.workers, "cores")
    add("redis_cores", f.redis, "cores")
    add("cpu_busy_cores", f.busy, "cores")
    add("machine_busy_cores", f.machine, "cores")
    return f


@dataclass(frozen=True)
class Figures:
    """What one replica count's run used: throughput, and cores per part (CPU seconds per wall second)."""

    rps: float
    routers: float
    workers: float
    client: float
    poller: float
    redis: float
    machine: float
    """The whole machine's busy cores meanwhile (``/proc/stat``), other work on it included."""

    @property
    def serving(self) -> float:
        """Cores the requests took: replicas, workers, Redis and the load generator (not the poller)."""
        return self.routers + self.workers + self.client + self.redis

    @property
    def busy(self) -> float:
        return self.serving + self.poller


def _cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def _limit(figures: Figures, replicas: int, cores: int) -> str:
    """What bounds the throughput at ``replicas`` replicas, in words."""
    parts = (f"routers {figures.routers:.2f} + workers {figures.workers:.2f} + Redis {figures.redis:.2f} + "
             f"load generator {figures.client:.2f} + poller {figures.poller:.2f} = {figures.busy:.2f} cores")
    others = max(0.0, figures.machine - figures.busy)
    parts += f", other work on the machine {others:.2f}"
    if figures.machine >= 0.85 * cores:
        return f"the {cores} cores at {replicas} replicas: {parts}"
    return (f"not the cores ({parts}; {figures.machine:.2f} of {cores} busy at {replicas} replicas): the "
            f"{CONCURRENCY} requests in flight or the pool's {DECODE_WORKERS * DECODE_BLOCKS} blocks")


async def measure_replicas(report: Report, *, quick: bool) -> None:
    """Router replicas on one Redis (1, 2, 4 processes): the figures the module docstring lists,
    each named ``replicas_<figure>_r<replicas>``, then ``replicas_throughput_ratio_r<N>`` and
    ``replicas_limit``.

    ``quick``: 2 s measured per replica count (under 30 s in all), else 10 s (under 2 minutes).
    Every process it starts (Redis, workers, replicas, the poller) is stopped before it returns.
    """
    seconds, warm_s, idle_s = (2.0, 1.0, 0.5) if quick else (10.0, 2.0, 1.0)
    cores = _cores()
    env = {"PDROUTER_KV_TOKEN": secrets.token_hex(16), "PDROUTER_KV_TOKEN_FILE": "",
           INTERNAL_TOKEN_ENV: secrets.token_hex(16)}
    report.add("replicas_cpu_cores", cores, "cores")
    report.add("replicas_concurrency", CONCURRENCY, "requests")
    report.add("replicas_pool_blocks", DECODE_WORKERS * DECODE_BLOCKS, "blocks")
    with tempfile.TemporaryDirectory(prefix="replicas-") as tmp, EmbeddedRedis() as server:
        model = write_config_folder(get_model_preset(MODEL), Path(tmp) / MODEL)
        sim = ["--gpu", "h100", "--time-scale", "0"]
        workers = [ManagedProcess(f"decode-{i}", worker_args("decode", model, redis_url=server.url,
                                                             num_blocks=DECODE_BLOCKS, sim=sim,
                                                             extra=("--worker-id", f"decode-{i}")), env=env)
                   for i in range(DECODE_WORKERS)]
        try:
            for w in workers:
                w.wait_ready()
            client = aioredis.Redis.from_url(server.url)
            watched = await _watched(client)
            await client.aclose()
            runs = {n: await _run_replicas(n, model, server.url, env, workers, watched, seconds, warm_s, idle_s,
                                          report)
                    for n in REPLICAS}
        finally:
            for w in workers:
                w.stop()
    for n in REPLICAS[1:]:
        report.add(f"replicas_throughput_ratio_r{n}", runs[n].rps / runs[REPLICAS[0]].rps, "x")
    report.add("replicas_limit", _limit(runs[REPLICAS[-1]], REPLICAS[-1], cores))
