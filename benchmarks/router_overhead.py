"""Router overhead: short requests straight to the workers vs through the router, in one run.

Redis, the workers and the router run as separate processes (the router is ``pdrouter router``);
this script is the load generator. For each mode it measures, at concurrency 1 and 32:

* ``direct``: a client driving the workers itself over the router's worker transport
  (``--worker-transport``: the workers' lanes by default, or gRPC): colocated ``Generate``; or
  disaggregated ``Allocate`` → ``Prefill`` → ``Generate`` from the first token, the three calls a
  client makes to put a request through the prefill and decode pools. (The router makes one,
  ``DecodeWorker.Serve``, and the decode worker calls the prefill worker; the router runs with
  ``--local-prefill-tokens 0`` so the prompt is computed on the prefill worker, as here);
* ``grpc``: the same prompt ids through the router's gRPC front door (``pdrouter.v1.Router``);
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

``--backend sim`` runs the workers as simulated GPUs in instant mode (``--time-scale 0``: no
sleeping, no model compute), so the figures are the router's and the transport's own, without the
tiny model's compute (on the tiny model's geometry; tokens are the simulator's).

    python benchmarks/router_overhead.py [--quick] [--json] [--max-tokens N] [--prompt TEXT]
                                         [--worker-transport lane|grpc] [--backend torch|sim]
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import tempfile
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import grpc
from _load import HttpCompletions, RouterGenerate, cpu_seconds
from _report import Report, base_parser

from pdrouter.cli.local_cluster import ManagedProcess, worker_args
from pdrouter.cli.serve import freeze_startup_heap
from pdrouter.core.sampling import SamplingParams
from pdrouter.core.tokenizer import load_tokenizer
from pdrouter.engine.model_io import make_model
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
        msg = worker_pb2.WorkerGenerateRequest(request_id=f"direct-{next(self._seq)}", prompt_token_ids=self._ids,
                                               sampling=self._sampling)
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
            request_id=rid, prompt_token_ids=self._ids, sampling=self._sampling, target=alloc.target,
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


QUICK = Plan(warmup=48, c1=50, c32=160, rounds=2, stream=30)
FULL = Plan(warmup=200, c1=150, c32=640, rounds=4, stream=100)


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
        sim = ["--gpu", "h100", "--time-scale", "0"] if self.backend == "sim" else None
        return worker_args(role, self.model, redis_url=self.redis_url, num_blocks=2048, torch_threads=1, sim=sim)


async def run_interleaved(clients: dict[str, Client], n: int, samples: dict[str, Samples], router_pid: int) -> None:
    """Concurrency 1, one request of each kind in turn (the order rotating), ``n`` of each.

    Every kind sees the same machine at the same moments, so drift (other jobs, frequency,
    caches) cancels out of the differences. The router's CPU is read around each request it
    serves.
    """
    kinds = list(clients)
    for i in range(n):
        for kind in kinds[i % len(kinds):] + kinds[:i % len(kinds)]:
            s = samples[kind]
            cpu0 = cpu_seconds(router_pid) if kind != "direct" else 0.0
            start = time.perf_counter()
            total, first = await clients[kind].once(0)
            s.seconds += time.perf_counter() - start
            if kind != "direct":
                s.cpu_seconds += cpu_seconds(router_pid) - cpu0
            s.totals.append(total)
            s.firsts.append(first)


async def measure_mode(bench: Bench, mode: str, clients: dict[str, Client], router_pid: int) -> None:
    """Concurrency 1: the kinds interleaved request by request; concurrency 32: alternating
    direct / grpc / http phases. Report each kind."""
    plan, report = bench.plan, bench.report
    for client in clients.values():
        await run_phase(client, 32, plan.warmup, Samples(), None)
    freeze_startup_heap()  # this process's full collections (~70 ms with torch loaded) would land on any kind
    for concurrency, n in ((1, plan.c1), (32, plan.c32)):
        samples = {kind: Samples() for kind in clients}
        if concurrency == 1:
            await run_interleaved(clients, n * plan.rounds, samples, router_pid)
        for r in range(plan.rounds if concurrency > 1 else 0):
            for kind in (list(clients) if r % 2 == 0 else list(reversed(clients))):
                await run_phase(clients[kind], concurrency, n, samples[kind], None if kind == "direct" else router_pid)
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
def started(name: str, args: list[str]) -> Iterator[ManagedProcess]:
    proc = ManagedProcess(name, args)
    try:
        proc.wait_ready()
        yield proc
    finally:
        proc.stop()


def _split(address: str | None) -> tuple[str, int]:
    assert address is not None
    host, _, port = address.rpartition(":")
    return host, int(port)


async def _closing(clients: dict[str, Client]) -> None:
    for client in clients.values():
        await client.close()


async def colocated(bench: Bench) -> None:
    with started("worker", bench.worker_args("worker")) as worker, \
            started("router", bench.router_args("colocated")) as router:
        assert worker.address is not None and router.grpc_address is not None
        info = await worker_info(worker.address)
        host, port = _split(router.address)
        clients: dict[str, Client] = {
            "direct": ColocatedDirect(WorkerLink(info, bench.transport), bench.ids, bench.sampling),
            "grpc": RouterGenerate(router.grpc_address, MODEL, bench.ids, bench.max_tokens),
            "http": HttpCompletions(host, port, MODEL, bench.ids, bench.max_tokens, stream=False)}
        await measure_mode(bench, "colocated", clients, router.proc.pid)
        await _closing(clients)
        sampling = SamplingParams(max_tokens=STREAM_TOKENS, temperature=0.0, ignore_eos=True)
        clients = {"direct": ColocatedDirect(WorkerLink(info, bench.transport), bench.stream_ids, sampling),
                   "grpc": RouterGenerate(router.grpc_address, MODEL, bench.stream_ids, STREAM_TOKENS),
                   "http": HttpCompletions(host, port, MODEL, bench.stream_ids, STREAM_TOKENS, stream=True)}
        await measure_stream(bench, clients)
        await _closing(clients)


async def disaggregated(bench: Bench) -> None:
    with started("prefill", bench.worker_args("prefill")) as prefill, \
            started("decode", bench.worker_args("decode")) as decode, \
            started("router", bench.router_args("disaggregated")) as router:
        assert prefill.address and decode.address and router.grpc_address
        p_info, d_info = await worker_info(prefill.address), await worker_info(decode.address)
        host, port = _split(router.address)
        clients: dict[str, Client] = {
            "direct": PdDirect(WorkerLink(p_info, bench.transport), WorkerLink(d_info, bench.transport), bench.ids,
                               bench.sampling, d_info.model_compat_hash),
            "grpc": RouterGenerate(router.grpc_address, MODEL, bench.ids, bench.max_tokens),
            "http": HttpCompletions(host, port, MODEL, bench.ids, bench.max_tokens, stream=False)}
        await measure_mode(bench, "disaggregated", clients, router.proc.pid)
        await _closing(clients)


def add_targets(bench: Bench) -> None:
    for kind in ("grpc", "http"):
        met = all(bench.figure(f"{mode}_c1_{kind}_added_p50") <= limit
                  and bench.figure(f"{mode}_c32_{kind}_router_cpu") <= TARGET_CPU_US
                  for mode, limit in TARGET_ADDED_MS.items())
        bench.report.add(f"target_met_{kind}", int(met), "bool")
    stall_free = all(bench.figure(f"stream_first_chunk_{kind}_extra") <= TARGET_STREAM_EXTRA_MS
                     for kind in ("grpc", "http"))
    bench.report.add("target_met_stream", int(stall_free), "bool")


async def main_async() -> None:
    parser = base_parser(__doc__ or "")
    parser.add_argument("--max-tokens", type=int, default=2, help="tokens per short request (1 or 2)")
    parser.add_argument("--prompt", default=PROMPT, help="prompt text of the short requests")
    parser.add_argument("--worker-transport", choices=["lane", "grpc"], default="lane",
                        help="how the router (and the direct client) reach the workers")
    parser.add_argument("--backend", choices=["torch", "sim"], default="torch",
                        help="the workers' engine: the tiny torch model, or simulated GPUs in instant mode")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="router-overhead-") as tmp, EmbeddedRedis() as redis_server:
        model = make_model(MODEL, 0, Path(tmp) / MODEL)
        tokenizer = load_tokenizer(model)
        bench = Bench(model, redis_server.url, tokenizer.encode(args.prompt), tokenizer.encode(STREAM_PROMPT),
                      args.max_tokens, QUICK if args.quick else FULL, args.worker_transport, args.backend)
        bench.report.add("prompt_tokens", len(bench.ids), "tokens")
        bench.report.add("max_tokens", args.max_tokens, "tokens")
        bench.report.add("worker_transport_lane", int(args.worker_transport == "lane"), "bool")
        bench.report.add("backend_sim", int(args.backend == "sim"), "bool")
        await colocated(bench)
        await disaggregated(bench)
    add_targets(bench)
    bench.report.emit(args.json)


if __name__ == "__main__":
    asyncio.run(main_async())
