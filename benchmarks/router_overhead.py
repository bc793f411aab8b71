"""Router overhead: short requests straight to the workers vs through the router, in one run.

Redis, the workers and the router run as separate processes (the router is ``pdrouter router``);
this script is the load generator. For each mode it measures, at concurrency 1 and 32:

* ``direct``: a client driving the workers itself over the router's worker transport
  (``--worker-transport``: the workers' lanes by default, or gRPC): colocated ``Generate``; or
  disaggregated ``Allocate`` → ``Prefill`` → ``Generate`` from the first token, the three calls a
  client makes to put a request through the prefill and decode pools. (The router makes one,
  ``DecodeWorker.Serve``, and the decode worker calls the prefill worker; the router runs with
  ``--local-prefill-tokens 0`` so the prompt is computed on the prefill worker, as here);
* ``grpc``: the same prompt ids through the router's gRPC front door (``pdrouter.v1.Router``), with a
  minimal gRPC client on one HTTP/2 connection (``_load.GrpcGenerate``; ``--grpc-client grpcio``: a
  ``grpc.aio`` channel, which costs the load generator several times the router's CPU per call);
* ``http``: the same prompt ids through the OpenAI front door (``POST /v1/completions``) over
  persistent keep-alive connections, with a minimal HTTP/1.1 client (little client-side noise).

Short requests: a 13-token prompt (``--prompt``) and ``--max-tokens`` (2) greedy tokens; each
worker runs one torch thread (``--torch-threads 1``: this machine's cores are shared with the
router and the load generator). At
concurrency 1 the kinds take turns request by request; at 32, phases alternate (direct, grpc,
http, then the reverse); either way drift hits every kind alike. Figures per mode,
concurrency and kind: p50 / p99 latency, requests/s; through the router also the added p50 (router
p50 minus direct p50) and the router's CPU time per request (all its threads, from the router
process's CPU-time clock over its measured phases, to the nanosecond; the load generator is this
process, not the router's). A streaming check compares the first chunk's latency through each door with the
worker's own on warm connections (``stream_first_chunk_*``): ``..._extra`` is what the router
adds to a first chunk beyond what it adds to a whole short request, where a Nagle / delayed-ACK
stall would show as tens of milliseconds. ``target_met_*`` compare with the targets (added p50 at
concurrency 1 ≤ 0.4 ms colocated and ≤ 0.5 ms disaggregated, router CPU ≤ 250 µs per request at
concurrency 32; first-chunk extra ≤ 1 ms).

The token path (``peers_*``), on the workload the peer routers were measured with: OpenAI
``/v1/completions`` with text prompts at concurrency 32, the router in colocated mode over two
workers; prompts short (``PEER_SHORT_PROMPT``, ≈ 20 characters) or long (one of
``PEER_GROUPS`` shared ≈ 2,000-character prefixes plus a unique suffix), 2, 16 and 64 output
tokens, streamed and not (and the gRPC door streaming the short prompt). Per line: the router's CPU
per request; for non-streamed requests its growth from 16 to 64 tokens as a ratio
(``..._growth_16_to_64``, target ≤ ``TARGET_PEER_GROWTH``); for streamed ones the CPU each further
token costs, ``(cpu(64) - cpu(16)) / 48`` (``..._per_token``, target ≤ ``TARGET_STREAM_TOKEN_US``,
half of ``BEFORE_STREAM_TOKEN_US``, what it cost before, measured here; both the median over the
rounds, so that a burst of other load on the machine moves one round only), and
the tokens per response write (``..._tokens_per_write``: 1 when every token leaves on its own,
more when the router, behind its workers, merged the chunks that were already waiting; with
simulated workers in instant mode it is behind, so this is the router at its limit). Kinds take
turns phase by phase, the order reversed every round. At a fixed concurrency a longer request
also means fewer requests a second: the router sleeps more between them and the same work costs
it a few per cent more CPU (a 16-token request made to last as long as a 64-token one costs what
the 64-token one does), which the growth figure includes.

The gRPC door's floor (``grpc_floor`` in colocated mode): a bare ``grpc.aio`` server answering
``Router/Generate`` with the tokens in one message and no other work (``_grpc_floor.py``), measured
like the doors, its own process's CPU in place of the router's. ``colocated_c32_grpc_floor_vs_http_cpu``
is that floor over the HTTP door's whole cost per request: above 1, no gRPC door built on grpcio's
asyncio server can cost less than the HTTP door.

``--vs REV`` also starts the router of commit ``REV`` (its ``pdrouter`` package exported with ``git
archive`` and run from ``PYTHONPATH``) beside this tree's, on the same workers and Redis, for the
short requests: its doors are the kinds ``grpc_vs`` and ``http_vs``, taking turns with the others
(so drift hits both routers alike), and ``<mode>_c<n>_<door>_cpu_vs_ratio`` is this tree's router
CPU per request over ``REV``'s (under 1: this tree costs less).

``--backend sim`` runs the workers as simulated GPUs in instant mode (``--time-scale 0``: no
sleeping, no model compute), so the figures are the router's and the transport's own, without the
tiny model's compute (on the tiny model's geometry; tokens are the simulator's).

    python benchmarks/router_overhead.py [--quick] [--json] [--max-tokens N] [--prompt TEXT]
                                         [--worker-transport lane|grpc] [--backend torch|sim]
                                         [--workloads all|short|peers] [--vs REV]
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import os
import random
import secrets
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import grpc
from _load import GRPC_CLIENTS, GrpcGenerate, HttpCompletions, RouterGenerate, cpu_seconds
from _report import Report, base_parser
from tracing_overhead import export_tree, tree_environment

from pdrouter.cli.local_cluster import ManagedProcess, worker_args
from pdrouter.cli.serve import freeze_startup_heap
from pdrouter.core.model_spec import get_model_preset
from pdrouter.core.sampling import SamplingParams
from pdrouter.core.tokenizer import load_tokenizer
from pdrouter.core.tokens import pack_token_ids
from pdrouter.engine.model_io import make_model, write_random_model
from pdrouter.state.embedded_redis import EmbeddedRedis
from pdrouter.wire.convert import sampling_to_pb
from pdrouter.wire.grpc_util import CHANNEL_OPTIONS
from pdrouter.wire.lane import LaneChannel, request_stubs
from pdrouter.wire.v1 import common_pb2, worker_pb2, worker_pb2_grpc

MODEL = "tiny"
PROMPT = "Hello, world"
"""13 tokens with <bos>: under one 16-token block, so nothing is looked up or hit in a prefix cache."""
STREAM_PROMPT = "abc"
"""The tiny model's first greedy token after it is a byte, so the first SSE event carries text."""
STREAM_TOKENS = 8
TARGET_ADDED_MS = {"colocated": 0.4, "disaggregated": 0.5}
TARGET_CPU_US = 250.0
TARGET_STREAM_EXTRA_MS = 1.0
PEER_SHORT_PROMPT = "Tell me about cats."
"""The peers' short prompt: ≈ 20 characters (a counter makes each one unique)."""
PEER_PREFIX_CHARS = 2_000
PEER_GROUPS = 4
"""Shared ≈ 2,000-character prefixes; each long prompt is one of them plus a unique suffix."""
PEER_TOKENS = (2, 16, 64)
PEER_CONTEXT = 4096
"""The long prompts are ≈ 2,050 byte-level tokens: the peers' model is the tiny one with this context."""
PEER_BLOCKS = 8192
"""Blocks per peers' worker: admission books prompt + output blocks for each of the 32 in flight."""
TARGET_PEER_GROWTH = 1.10
BEFORE_STREAM_TOKEN_US = 43.0
"""Router CPU per streamed token before non-streamed requests left the per-token path and chunks
were merged (this script, simulated workers, lane; 42.6–44.8 µs short and long, one run)."""
TARGET_STREAM_TOKEN_US = 0.5 * BEFORE_STREAM_TOKEN_US


class Client(Protocol):
    """One way of sending the benchmark's request; ``slot`` names the caller's connection."""

    async def once(self, slot: int) -> tuple[float, float]:
        """Send one request; (seconds to the last byte, seconds to the first token)."""
        ...

    async def close(self) -> None: ...


def _channel(address: str) -> grpc.aio.Channel:
    return grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS)


async def _drain(call: AsyncIterator[object], start: float) -> tuple[float, float]:
    first = 0.0
    async for _ in call:
        if not first:
            first = time.perf_counter() - start
    return time.perf_counter() - start, first


class WorkerLink:
    """One worker's request stubs over the transport under test, and how to close them."""

    def __init__(self, info: common_pb2.WorkerInfo, transport: str) -> None:
        self._lane = LaneChannel(info.lane_address) if transport == "lane" else None
        self._channel = _channel(info.address) if self._lane is None else None
        self.prefill, self.decode, self.colocated = request_stubs(self._channel, self._lane)

    async def close(self) -> None:
        for closable in (self._lane, self._channel):
            if closable is not None:
                await closable.close()


async def worker_info(address: str) -> common_pb2.WorkerInfo:
    async with _channel(address) as channel:
        info: common_pb2.WorkerInfo = await worker_pb2_grpc.WorkerInfoServiceStub(channel).GetInfo(
            worker_pb2.GetInfoRequest())
    return info


class ColocatedDirect:
    """``ColocatedWorker.Generate`` on the worker itself."""

    def __init__(self, worker: WorkerLink, ids: list[int], sampling: SamplingParams) -> None:
        self._link = worker
        self._stub = worker.colocated
        self._ids, self._sampling = ids, sampling_to_pb(sampling)
        self._seq = itertools.count()

    async def once(self, slot: int) -> tuple[float, float]:
        start = time.perf_counter()
        msg = worker_pb2.WorkerGenerateRequest(request_id=f"direct-{next(self._seq)}",
                                               prompt_token_bytes=pack_token_ids(self._ids), sampling=self._sampling)
        return await _drain(self._stub.Generate(msg), start)

    async def close(self) -> None:
        await self._link.close()


class PdDirect:
    """Allocate (decode) → Prefill (prefill) → Generate (decode), as the router sends them."""

    def __init__(self, prefill: WorkerLink, decode: WorkerLink, ids: list[int], sampling: SamplingParams,
                 compat: str) -> None:
        self._links = [prefill, decode]
        self._prefill = prefill.prefill
        self._decode = decode.decode
        self._ids, self._sampling, self._compat = ids, sampling_to_pb(sampling), compat
        self._max_tokens = sampling.max_tokens
        self._seq = itertools.count()

    async def once(self, slot: int) -> tuple[float, float]:
        start = time.perf_counter()
        rid = f"direct-{next(self._seq)}"
        alloc = await self._decode.Allocate(worker_pb2.AllocateRequest(
            request_id=rid, prompt_token_ids=self._ids, max_tokens=self._max_tokens, model_compat_hash=self._compat,
            lease_ms=30_000, sampling=self._sampling))
        resp = await self._prefill.Prefill(worker_pb2.PrefillRequest(
            request_id=rid, prompt_token_bytes=pack_token_ids(self._ids), sampling=self._sampling, target=alloc.target,
            model_compat_hash=self._compat))
        first = time.perf_counter() - start
        total, _ = await _drain(self._decode.Generate(worker_pb2.DecodeRequest(
            request_id=rid, sampling=self._sampling, first_token_id=resp.first_token_id)), start)
        return total, first

    async def close(self) -> None:
        for link in self._links:
            await link.close()


@dataclass
class Samples:
    """Latencies of one kind of request over all its phases, and the router CPU they cost."""

    totals: list[float] = field(default_factory=list)
    firsts: list[float] = field(default_factory=list)
    seconds: float = 0.0
    cpu_seconds: float = 0.0

    def p(self, q: float, firsts: bool = False) -> float:
        values = sorted(self.firsts if firsts else self.totals)
        return values[min(len(values) - 1, int(q * len(values)))]

    @property
    def rps(self) -> float:
        return len(self.totals) / self.seconds


async def run_phase(client: Client, concurrency: int, n: int, into: Samples, router_pid: int | None) -> None:
    left = n

    async def slot(i: int) -> None:
        nonlocal left
        while left > 0:
            left -= 1
            total, first = await client.once(i)
            into.totals.append(total)
            into.firsts.append(first)

    cpu0 = cpu_seconds(router_pid) if router_pid else 0.0
    start = time.perf_counter()
    await asyncio.gather(*(slot(i) for i in range(concurrency)))
    into.seconds += time.perf_counter() - start
    if router_pid:
        into.cpu_seconds += cpu_seconds(router_pid) - cpu0


@dataclass(frozen=True)
class Plan:
    """How many requests each phase sends."""

    warmup: int
    c1: int
    c32: int
    rounds: int
    stream: int
    peers: int
    """Requests per phase of the token-path workload, streamed kinds."""
    peers_unary: int
    """Requests per phase of the token-path workload, non-streamed kinds (cheap, and their growth
    from 16 to 64 tokens is a few per cent: more of them, for a steadier ratio)."""
    peer_rounds: int
    """Phases of each kind of the token-path workload: many short ones, so drift hits every kind alike."""


QUICK = Plan(warmup=48, c1=50, c32=160, rounds=2, stream=30, peers=32, peers_unary=128, peer_rounds=3)
FULL = Plan(warmup=200, c1=150, c32=640, rounds=4, stream=100, peers=96, peers_unary=192, peer_rounds=6)


@dataclass
class Bench:
    """What every measurement of one run shares."""

    model: Path
    redis_url: str
    ids: list[int]
    stream_ids: list[int]
    max_tokens: int
    plan: Plan
    transport: str = "lane"
    backend: str = "torch"
    report: Report = field(default_factory=Report)
    vs_tree: Path | None = None
    """``--vs``: the exported package of the commit whose router runs beside this tree's."""

    @property
    def sampling(self) -> SamplingParams:
        return SamplingParams(max_tokens=self.max_tokens, temperature=0.0, ignore_eos=True)

    def figure(self, name: str) -> float:
        return float(next(value for key, value, _ in self.report.figures if key == name))

    def router_args(self, mode: str) -> list[str]:
        # --local-prefill-tokens 0: the router always takes the prefill pool, as the direct client does.
        return ["router", "--model", str(self.model), "--redis", self.redis_url, "--mode", mode,
                "--http-port", "0", "--grpc-port", "0", "--local-prefill-tokens", "0", "--log-level", "WARNING",
                "--worker-transport", self.transport]

    def worker_args(self, role: str) -> list[str]:
        # One torch thread per worker: the workers, the router and this load generator share the
        # machine's cores, and torch's default (a thread per core) spins on the cores the others need.
        return self.worker_args_for(role, self.model, self.redis_url, 2048)

    def worker_args_for(self, role: str, model: Path, redis_url: str, num_blocks: int) -> list[str]:
        sim = ["--gpu", "h100", "--time-scale", "0"] if self.backend == "sim" else None
        return worker_args(role, model, redis_url=redis_url, num_blocks=num_blocks, torch_threads=1, sim=sim)


async def run_interleaved(clients: dict[str, Client], n: int, samples: dict[str, Samples],
                          pids: dict[str, int]) -> None:
    """Concurrency 1, one request of each kind in turn (the order rotating), ``n`` of each.

    Every kind sees the same machine at the same moments, so drift (other jobs, frequency,
    caches) cancels out of the differences. The serving process's CPU (``pids``, by kind) is read
    around each request it serves.
    """
    kinds = list(clients)
    for i in range(n):
        for kind in kinds[i % len(kinds):] + kinds[:i % len(kinds)]:
            s = samples[kind]
            pid = pids.get(kind)
            cpu0 = cpu_seconds(pid) if pid else 0.0
            start = time.perf_counter()
            total, first = await clients[kind].once(0)
            s.seconds += time.perf_counter() - start
            if pid:
                s.cpu_seconds += cpu_seconds(pid) - cpu0
            s.totals.append(total)
            s.firsts.append(first)


async def measure_mode(bench: Bench, mode: str, clients: dict[str, Client], router_pid: int,
                       other_pids: dict[str, int] | None = None) -> None:
    """Concurrency 1: the kinds interleaved request by request; concurrency 32: alternating
    direct / grpc / http phases. Report each kind. A kind's CPU is the router's, or the process
    ``other_pids`` names for it."""
    plan, report = bench.plan, bench.report
    pids = {kind: (other_pids or {}).get(kind, router_pid) for kind in clients if kind != "direct"}
    for client in clients.values():
        await run_phase(client, 32, plan.warmup, Samples(), None)
    freeze_startup_heap()  # this process's full collections (~70 ms with torch loaded) would land on any kind
    for concurrency, n in ((1, plan.c1), (32, plan.c32)):
        samples = {kind: Samples() for kind in clients}
        if concurrency == 1:
            await run_interleaved(clients, n * plan.rounds, samples, pids)
        for r in range(plan.rounds if concurrency > 1 else 0):
            for kind in (list(clients) if r % 2 == 0 else list(reversed(clients))):
                await run_phase(clients[kind], concurrency, n, samples[kind], pids.get(kind))
        direct = samples["direct"].p(0.5)
        for kind, s in samples.items():
            name = f"{mode}_c{concurrency}_{kind}"
            report.add(f"{name}_p50", s.p(0.5) * 1e3, "ms")
            report.add(f"{name}_p99", s.p(0.99) * 1e3, "ms")
            report.add(f"{name}_rps", s.rps, "req/s")
            if kind != "direct":
                report.add(f"{name}_added_p50", (s.p(0.5) - direct) * 1e3, "ms")
                report.add(f"{name}_router_cpu", s.cpu_seconds / len(s.totals) * 1e6, "us/req")


async def measure_stream(bench: Bench, clients: dict[str, Client]) -> None:
    """First-chunk latency of streamed requests on warm connections, direct vs each door.

    What the router adds to the first chunk should be what it adds to a whole short request
    (admission, one more hop): a chunk held back by Nagle's algorithm or a delayed ACK would add
    tens of milliseconds on top. ``..._extra`` is that difference.
    """
    samples = {kind: Samples() for kind in clients}
    for client in clients.values():
        await run_phase(client, 1, bench.plan.warmup // 4, Samples(), None)
    for r in range(bench.plan.rounds):
        for kind in (list(clients) if r % 2 == 0 else list(reversed(clients))):
            await run_phase(clients[kind], 1, bench.plan.stream, samples[kind], None)
    direct = samples["direct"]
    bench.report.add("stream_first_chunk_direct_p50", direct.p(0.5, firsts=True) * 1e3, "ms")
    for kind in ("grpc", "http"):
        s = samples[kind]
        added = (s.p(0.5, firsts=True) - direct.p(0.5, firsts=True)) * 1e3
        bench.report.add(f"stream_first_chunk_{kind}_added_p50", added, "ms")
        bench.report.add(f"stream_first_chunk_{kind}_added_p99",
                         (s.p(0.99, firsts=True) - direct.p(0.99, firsts=True)) * 1e3, "ms")
        bench.report.add(f"stream_first_chunk_{kind}_extra",
                         added - bench.figure(f"colocated_c1_{kind}_added_p50"), "ms")


@contextlib.contextmanager
def started(name: str, args: list[str], env: dict[str, str] | None = None) -> Iterator[ManagedProcess]:
    proc = ManagedProcess(name, args, env=env)
    try:
        proc.wait_ready()
        yield proc
    finally:
        proc.stop()


@contextlib.contextmanager
def all_started(named: dict[str, list[str]]) -> Iterator[list[ManagedProcess]]:
    """Start every process at once, then wait for each (they start side by side)."""
    procs: list[ManagedProcess] = []
    try:
        for name, args in named.items():
            procs.append(ManagedProcess(name, args))
        for proc in procs:
            proc.wait_ready()
        yield procs
    finally:
        for proc in procs:
            proc.stop()


def _split(address: str | None) -> tuple[str, int]:
    assert address is not None
    host, _, port = address.rpartition(":")
    return host, int(port)


async def _closing(clients: dict[str, Client]) -> None:
    for client in clients.values():
        await client.close()


@contextlib.contextmanager
def grpc_floor() -> Iterator[tuple[int, str]]:
    """A bare ``grpc.aio`` server answering ``Router/Generate`` (``_grpc_floor.py``): (pid, address)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    proc = subprocess.Popen([sys.executable, str(Path(__file__).with_name("_grpc_floor.py")), "--port", str(port)])
    try:
        deadline = time.monotonic() + 30
        while True:
            with socket.socket() as sock:
                if sock.connect_ex(("127.0.0.1", port)) == 0:
                    break
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the bare gRPC server did not start (exit {proc.poll()})")
            time.sleep(0.1)
        yield proc.pid, f"127.0.0.1:{port}"
    finally:
        proc.terminate()
        proc.wait(10)


@contextlib.contextmanager
def vs_router(bench: Bench, mode: str) -> Iterator[ManagedProcess | None]:
    """``--vs``: the other commit's router on the same workers and Redis (None without ``--vs``)."""
    if bench.vs_tree is None:
        yield None
        return
    with started("router-vs", bench.router_args(mode), env=tree_environment(bench.vs_tree)) as router:
        yield router


def vs_clients(bench: Bench, router: ManagedProcess | None) -> tuple[dict[str, Client], dict[str, int]]:
    """The ``--vs`` router's doors as kinds ``grpc_vs`` and ``http_vs``, and its pid for each."""
    if router is None:
        return {}, {}
    assert router.grpc_address is not None
    host, port = _split(router.address)
    clients: dict[str, Client] = {
        "grpc_vs": GRPC_CLIENT(router.grpc_address, MODEL, bench.ids, bench.max_tokens),
        "http_vs": HttpCompletions(host, port, MODEL, bench.ids, bench.max_tokens, stream=False)}
    return clients, {kind: router.proc.pid for kind in clients}


def add_vs_ratios(bench: Bench, mode: str) -> None:
    """This tree's router CPU per request over the ``--vs`` commit's, per door and concurrency."""
    if bench.vs_tree is None:
        return
    for concurrency in (1, 32):
        for door in ("grpc", "http"):
            name = f"{mode}_c{concurrency}_{door}"
            bench.report.add(f"{name}_cpu_vs_ratio", bench.figure(f"{name}_router_cpu")
                             / bench.figure(f"{name}_vs_router_cpu"), "x")


async def colocated(bench: Bench) -> None:
    with started("worker", bench.worker_args("worker")) as worker, \
            started("router", bench.router_args("colocated")) as router, \
            vs_router(bench, "colocated") as other:
        assert worker.address is not None and router.grpc_address is not None
        info = await worker_info(worker.address)
        host, port = _split(router.address)
        with grpc_floor() as (floor_pid, floor_address):
            vs, vs_pids = vs_clients(bench, other)
            clients: dict[str, Client] = {
                "direct": ColocatedDirect(WorkerLink(info, bench.transport), bench.ids, bench.sampling),
                "grpc": GRPC_CLIENT(router.grpc_address, MODEL, bench.ids, bench.max_tokens),
                "http": HttpCompletions(host, port, MODEL, bench.ids, bench.max_tokens, stream=False),
                "grpc_floor": GRPC_CLIENT(floor_address, MODEL, bench.ids, bench.max_tokens), **vs}
            await measure_mode(bench, "colocated", clients, router.proc.pid, {"grpc_floor": floor_pid, **vs_pids})
            await _closing(clients)
        add_vs_ratios(bench, "colocated")
        bench.report.add("colocated_c32_grpc_vs_http_cpu", bench.figure("colocated_c32_grpc_router_cpu")
                         / bench.figure("colocated_c32_http_router_cpu"), "x")
        bench.report.add("colocated_c32_grpc_floor_vs_http_cpu", bench.figure("colocated_c32_grpc_floor_router_cpu")
                         / bench.figure("colocated_c32_http_router_cpu"), "x")
        sampling = SamplingParams(max_tokens=STREAM_TOKENS, temperature=0.0, ignore_eos=True)
        clients = {"direct": ColocatedDirect(WorkerLink(info, bench.transport), bench.stream_ids, sampling),
                   "grpc": GRPC_CLIENT(router.grpc_address, MODEL, bench.stream_ids, STREAM_TOKENS),
                   "http": HttpCompletions(host, port, MODEL, bench.stream_ids, STREAM_TOKENS, stream=True)}
        await measure_stream(bench, clients)
        await _closing(clients)


async def disaggregated(bench: Bench) -> None:
    with started("prefill", bench.worker_args("prefill")) as prefill, \
            started("decode", bench.worker_args("decode")) as decode, \
            started("router", bench.router_args("disaggregated")) as router, \
            vs_router(bench, "disaggregated") as other:
        assert prefill.address and decode.address and router.grpc_address
        p_info, d_info = await worker_info(prefill.address), await worker_info(decode.address)
        host, port = _split(router.address)
        vs, vs_pids = vs_clients(bench, other)
        clients: dict[str, Client] = {
            "direct": PdDirect(WorkerLink(p_info, bench.transport), WorkerLink(d_info, bench.transport), bench.ids,
                               bench.sampling, d_info.model_compat_hash),
            "grpc": GRPC_CLIENT(router.grpc_address, MODEL, bench.ids, bench.max_tokens),
            "http": HttpCompletions(host, port, MODEL, bench.ids, bench.max_tokens, stream=False), **vs}
        await measure_mode(bench, "disaggregated", clients, router.proc.pid, vs_pids)
        await _closing(clients)
        add_vs_ratios(bench, "disaggregated")


def peer_prompts(kind: str, seed: int) -> Iterator[str]:
    """The peers' prompts of ``kind`` ("short" or "long"), each one unique."""
    rng = random.Random(seed)
    words = ["".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(2, 9))) for _ in range(400)]
    prefixes = []
    for g in range(PEER_GROUPS):
        text = f"Document {g}:"
        while len(text) < PEER_PREFIX_CHARS:
            text += " " + rng.choice(words)
        prefixes.append(text[:PEER_PREFIX_CHARS])
    for i in itertools.count():
        if kind == "short":
            yield f"{PEER_SHORT_PROMPT} {i % 1000:03d}"
        else:
            yield f"{prefixes[i % PEER_GROUPS]}\nQuestion {i}: {' '.join(rng.choices(words, k=6))}?"


async def peers(bench: Bench, tmp: Path) -> None:
    """The token path on the peers' workload (see the module docstring); its own model, Redis, workers, router."""
    spec = dataclasses.replace(get_model_preset(MODEL), max_context=PEER_CONTEXT)
    model = write_random_model(spec, 0, tmp / "peers" / MODEL)
    plan, report = bench.plan, bench.report
    with EmbeddedRedis() as redis_server, all_started({
            "worker-a": bench.worker_args_for("worker", model, redis_server.url, PEER_BLOCKS),
            "worker-b": bench.worker_args_for("worker", model, redis_server.url, PEER_BLOCKS),
            "router": ["router", "--model", str(model), "--redis", redis_server.url, "--mode", "colocated",
                       "--http-port", "0", "--grpc-port", "0", "--log-level", "WARNING",
                       "--worker-transport", bench.transport]}) as (_, _, router):
        assert router.grpc_address is not None
        host, port = _split(router.address)
        await _wait_for_workers(host, port, 2)
        clients: dict[str, Client] = {}
        connections: dict[int, tuple[asyncio.StreamReader, asyncio.StreamWriter]] = {}  # one per slot, shared
        for prompt in ("short", "long"):
            for tokens in PEER_TOKENS:
                for stream in (False, True):
                    name = f"{prompt}_{'stream' if stream else 'unary'}_{tokens}"
                    clients[name] = HttpCompletions(host, port, MODEL, [], tokens, stream,
                                                    prompts=peer_prompts(prompt, len(clients)), connections=connections)
        for tokens in PEER_TOKENS[1:]:
            clients[f"grpc_short_stream_{tokens}"] = GRPC_CLIENT(
                router.grpc_address, MODEL, [], tokens, texts=peer_prompts("short", len(clients)))
        for kind, client in clients.items():  # the HTTP kinds share their connections: warm them once
            if kind.startswith("grpc_") or kind in ("short_unary_2", "short_stream_2", "long_unary_2"):
                await run_phase(client, 32, 32, Samples(), None)
        freeze_startup_heap()
        samples = {kind: Samples() for kind in clients}
        per_round: dict[str, list[float]] = {kind: [] for kind in clients}
        writes = dict.fromkeys(clients, 0)
        for r in range(plan.peer_rounds):
            for kind in (list(clients) if r % 2 == 0 else list(reversed(clients))):
                client = clients[kind]
                before, phase = _writes(client), Samples()
                n = plan.peers_unary if "_unary_" in kind else plan.peers
                await run_phase(client, 32, n, phase, router.proc.pid)
                writes[kind] += _writes(client) - before
                per_round[kind].append(phase.cpu_seconds / len(phase.totals) * 1e6)
                whole = samples[kind]
                whole.totals += phase.totals
                whole.firsts += phase.firsts
                whole.seconds += phase.seconds
                whole.cpu_seconds += phase.cpu_seconds
        await _closing(clients)
    cpu = {kind: s.cpu_seconds / len(s.totals) * 1e6 for kind, s in samples.items()}
    report.add("peers_stream_router_cpu_per_token_before_recorded", BEFORE_STREAM_TOKEN_US, "us/token")
    report.add("peers_prompt_short_chars", len(PEER_SHORT_PROMPT) + 4, "chars")
    report.add("peers_prompt_long_chars", len(next(peer_prompts("long", 0))), "chars")
    for door, prompts in (("", ("short", "long")), ("grpc_", ("short",))):
        for prompt in prompts:
            for stream in (("unary", "stream") if not door else ("stream",)):
                base = f"{door}{prompt}_{stream}"
                for tokens in PEER_TOKENS if not door else PEER_TOKENS[1:]:
                    kind = f"{base}_{tokens}"
                    report.add(f"peers_{kind}_router_cpu", cpu[kind], "us/req")
                    report.add(f"peers_{kind}_p50", samples[kind].p(0.5) * 1e3, "ms")
                    if stream == "stream" and tokens == PEER_TOKENS[-1]:
                        # Tokens per response write: 1 when each token goes out on its own; more when
                        # the router, behind its workers, merged the chunks that were waiting.
                        per_write = tokens * len(samples[kind].totals) / max(writes[kind], 1)
                        report.add(f"peers_{kind}_tokens_per_write", per_write, "tokens")
                # The median over the rounds: a burst of other load on the machine moves one round only.
                lo, hi = PEER_TOKENS[1], PEER_TOKENS[2]
                pairs = list(zip(per_round[f"{base}_{lo}"], per_round[f"{base}_{hi}"], strict=True))
                per_token = statistics.median((b - a) / (hi - lo) for a, b in pairs)
                report.add(f"peers_{base}_router_cpu_per_token", per_token, "us/token")
                if stream == "unary":
                    report.add(f"peers_{base}_growth_16_to_64", statistics.median(b / a for a, b in pairs), "x")


def _writes(client: Client) -> int:
    """Streamed writes (HTTP chunks, gRPC messages) a client received so far."""
    return int(getattr(client, "events", 0) or getattr(client, "messages", 0))


async def _wait_for_workers(host: str, port: int, n: int, timeout: float = 30.0) -> None:
    """Until ``n`` requests in a row were served (the router has seen the workers register)."""
    deadline = time.monotonic() + timeout
    served = 0
    while served < n:
        probe = HttpCompletions(host, port, MODEL, [1, 2, 3], 1, stream=False)
        try:
            await probe.once(0)
            served += 1
        except (RuntimeError, OSError, asyncio.IncompleteReadError):
            served = 0  # (a refusal's body is left unread: the next probe takes a new connection)
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.1)
        finally:
            await probe.close()


def add_targets(bench: Bench, workloads: str) -> None:
    if workloads in ("all", "peers"):
        growth = all(bench.figure(f"peers_{p}_unary_growth_16_to_64") <= TARGET_PEER_GROWTH for p in ("short", "long"))
        bench.report.add("target_met_peers_unary_growth", int(growth), "bool")
        per_token = all(bench.figure(f"peers_{p}_stream_router_cpu_per_token") <= TARGET_STREAM_TOKEN_US
                        for p in ("short", "long"))
        bench.report.add("target_met_peers_stream_token", int(per_token), "bool")
    if workloads == "peers":
        return
    for kind in ("grpc", "http"):
        met = all(bench.figure(f"{mode}_c1_{kind}_added_p50") <= limit
                  and bench.figure(f"{mode}_c32_{kind}_router_cpu") <= TARGET_CPU_US
                  for mode, limit in TARGET_ADDED_MS.items())
        bench.report.add(f"target_met_{kind}", int(met), "bool")
    # The gRPC door against the HTTP door, and the floor of any grpc.aio server (module docstring).
    bench.report.add("target_met_grpc_door",
                     int(bench.figure("colocated_c32_grpc_router_cpu") <= bench.figure("colocated_c32_http_router_cpu")
                         and bench.figure("colocated_c32_grpc_added_p50")
                         <= 1.5 * bench.figure("colocated_c32_http_added_p50")), "bool")
    stall_free = all(bench.figure(f"stream_first_chunk_{kind}_extra") <= TARGET_STREAM_EXTRA_MS
                     for kind in ("grpc", "http"))
    bench.report.add("target_met_stream", int(stall_free), "bool")


GRPC_CLIENT: type[GrpcGenerate] | type[RouterGenerate] = GrpcGenerate
"""The load generator's gRPC client (``--grpc-client``)."""


async def main_async() -> None:
    parser = base_parser(__doc__ or "")
    parser.add_argument("--max-tokens", type=int, default=2, help="tokens per short request (1 or 2)")
    parser.add_argument("--prompt", default=PROMPT, help="prompt text of the short requests")
    parser.add_argument("--worker-transport", choices=["lane", "grpc"], default="lane",
                        help="how the router (and the direct client) reach the workers")
    parser.add_argument("--backend", choices=["torch", "sim"], default="torch",
                        help="the workers' engine: the tiny torch model, or simulated GPUs in instant mode")
    parser.add_argument("--workloads", choices=["all", "short", "peers"], default="all",
                        help="the short requests (colocated, disaggregated, streaming check), the token path "
                             "on the peers' workload, or both")
    parser.add_argument("--vs", default=None, metavar="REV",
                        help="also run the router of commit REV beside this tree's on the short requests")
    parser.add_argument("--grpc-client", choices=sorted(GRPC_CLIENTS), default="minimal",
                        help="the load generator's gRPC client: minimal (one HTTP/2 connection, little "
                             "client-side CPU) or grpcio (a grpc.aio channel)")
    args = parser.parse_args()
    global GRPC_CLIENT
    GRPC_CLIENT = GRPC_CLIENTS[args.grpc_client]
    # Prefill and decode workers refuse to start without the deployment's KV secret: the ones
    # started here (they inherit this environment) share one made for the run.
    if not (os.environ.get("PDROUTER_KV_TOKEN") or os.environ.get("PDROUTER_KV_TOKEN_FILE")):
        os.environ["PDROUTER_KV_TOKEN"] = secrets.token_hex(16)
    with tempfile.TemporaryDirectory(prefix="router-overhead-") as tmp, EmbeddedRedis() as redis_server:
        model = make_model(MODEL, 0, Path(tmp) / MODEL)
        tokenizer = load_tokenizer(model)
        bench = Bench(model, redis_server.url, tokenizer.encode(args.prompt), tokenizer.encode(STREAM_PROMPT),
                      args.max_tokens, QUICK if args.quick else FULL, args.worker_transport, args.backend,
                      vs_tree=None if args.vs is None else export_tree(args.vs, Path(tmp) / "vs"))
        bench.report.add("prompt_tokens", len(bench.ids), "tokens")
        bench.report.add("max_tokens", args.max_tokens, "tokens")
        bench.report.add("worker_transport_lane", int(args.worker_transport == "lane"), "bool")
        bench.report.add("backend_sim", int(args.backend == "sim"), "bool")
        if args.workloads in ("all", "short"):
            await colocated(bench)
            await disaggregated(bench)
        if args.workloads in ("all", "peers"):
            await peers(bench, Path(tmp))
    add_targets(bench, args.workloads)
    bench.report.emit(args.json)


if __name__ == "__main__":
    asyncio.run(main_async())
