"""Front-door overhead: the router's CPU per request in its HTTP and gRPC doors, over an in-process echo model.

A child process serves both front doors built as ``pdrouter.router.server.RouterProcess`` builds them
(``create_app`` / ``make_server`` / ``bind_socket`` for HTTP, ``RouterServicer`` on a
``GrpcServer`` for gRPC), over ``EchoOrchestrator`` instead of the real orchestrator, so nothing
but the doors (parsing, tokenizing, metrics, response shaping, the HTTP and gRPC stacks) costs CPU.
This process drives load and reads the child's CPU time (user + system, all threads) from
``/proc/<pid>/stat`` around each measured phase.

Short requests: a 13-token prompt given as token ids, ``--max-tokens`` (2) greedy tokens. Kinds:

* ``http``: ``POST /v1/completions`` with ``stream: false`` over keep-alive connections (one per
  concurrent caller), with a minimal HTTP/1.1 client;
* ``http_stream``: the same request with ``stream: true`` (SSE, chunked);
* ``grpc``: ``pdrouter.v1.Router.Generate`` with the same token ids (a server stream: one message
  per token);
* ``grpc_bare``: the same call to a bare servicer in the same process, on its own ``GrpcServer``,
  that writes ready-made messages (as many, of the same shape) and does nothing else: what
  grpc.aio itself costs per call of this shape, the floor under the ``grpc`` figures.

Each kind runs at concurrency 1 and 32; phases alternate between kinds over several rounds so
drift hits every kind alike. Figures per kind and concurrency: ``_cpu`` (child CPU per request),
``_cpu_sys`` (the part of it spent in the kernel: sockets, polling), ``_p50`` / ``_p99`` latency
and ``_rps``. With both gRPC kinds, ``grpc_own_c{1,32}_cpu`` is the gRPC door's CPU above that
floor: its own Python (validation, tokenizing, the request's path, metrics, messages).

``--profile PATH`` runs the child under cProfile and writes its stats to PATH (the CPU figures
are then inflated by the profiler); ``--kinds`` measures a subset.

    python benchmarks/frontdoor_bench.py [--quick] [--json] [--kinds http,grpc] [--profile out.pstats]
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol, TypeVar

import grpc
from _load import HttpCompletions, RouterGenerate, cpu_times
from _report import Report, base_parser

from pdrouter.cli.serve import freeze_startup_heap, tune_allocator
from pdrouter.core.tokenizer import ByteTokenizer
from pdrouter.router.frontdoor.grpc_api import SERVICE_NAME, RouterServicer
from pdrouter.router.frontdoor.http_api import bind_socket, create_app, make_server
from pdrouter.router.metrics import RouterMetrics
from pdrouter.router.request import RouterRequest
from pdrouter.router.served_models import FrontdoorConfig
from pdrouter.testing.echo import ECHO, TINY, EchoOrchestrator
from pdrouter.wire.grpc_util import GrpcServer
from pdrouter.wire.v1 import common_pb2, router_pb2, router_pb2_grpc

MODEL = ECHO.name
PROMPT = "Hello, world"
"""13 tokens with the byte tokenizer's <bos>."""
HOST = "127.0.0.1"
KINDS = ("http", "http_stream", "grpc", "grpc_bare")
_READY = "frontdoor-bench ready"
_PROFILE_ENV = "FRONTDOOR_BENCH_PROFILE"
T = TypeVar("T")


# -- the child: both front doors over the echo orchestrator ------------------------------------


async def serve() -> None:
    """Serve both doors and the bare gRPC servicer until SIGTERM; print
    ``<ready> <http port> <grpc address> <bare grpc address>`` once up."""
    logging.basicConfig(level="WARNING", format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    profile_path = os.environ.get(_PROFILE_ENV)
    profiler = cProfile.Profile() if profile_path else None
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    loop.add_signal_handler(signal.SIGTERM, stop.set)
    orchestrator = EchoOrchestrator([ECHO, TINY])
    tokenizers = {ECHO.name: ByteTokenizer(ECHO.vocab_size), TINY.name: ByteTokenizer(TINY.vocab_size)}
    metrics = RouterMetrics()
    config = FrontdoorConfig()
    grpc_server = GrpcServer(HOST, 0)
    grpc_server.add(router_pb2_grpc.add_RouterServicer_to_server,
                    RouterServicer(orchestrator, tokenizers, metrics=metrics, config=config), SERVICE_NAME)
    await grpc_server.start()
    bare_server = GrpcServer(HOST, 0)
    bare_server.add(router_pb2_grpc.add_RouterServicer_to_server, _BareRouter(), SERVICE_NAME)
    await bare_server.start()
    app = create_app(orchestrator, tokenizers, metrics=metrics, config=config)
    sock = bind_socket(HOST, 0)
    sock.listen(1024)
    sock.setblocking(False)
    http_port = sock.getsockname()[1]
    server = make_server(app, HOST, http_port)
    http_task = asyncio.create_task(server.serve(sockets=[sock]))
    while not server.started:
        if http_task.done():
            await http_task
        await asyncio.sleep(0.01)
    # The fake keeps every request it saw; a long run must not grow the heap without bound.
    orchestrator.requests = _Discard[RouterRequest]()
    orchestrator.completed = _Discard[str]()
    freeze_startup_heap()  # as every pdrouter server process does after start-up
    print(f"{_READY} {http_port} {grpc_server.address} {bare_server.address}", flush=True)
    if profiler is not None:
        profiler.enable()
    await stop.wait()
    if profiler is not None and profile_path:
        profiler.disable()
        profiler.dump_stats(profile_path)
    server.should_exit = True
    await grpc_server.stop(0)
    await bare_server.stop(0)
    await http_task


class _BareRouter(router_pb2_grpc.RouterServicer):
    """``Generate`` that writes ready-made messages, one per token asked for, and nothing else."""

    def __init__(self) -> None:
        self._replies: dict[int, list[router_pb2.GenerateResponse]] = {}

    async def Generate(self, request: router_pb2.GenerateRequest, context: grpc.aio.ServicerContext) -> None:
        n = max(1, request.sampling.max_tokens)
        replies = self._replies.get(n)
        if replies is None:
            replies = [router_pb2.GenerateResponse(request_id="bare", token_ids=[65], text="A") for _ in range(n)]
            replies[-1].finish_reason = common_pb2.FINISH_REASON_LENGTH
            replies[-1].usage.prompt_tokens = len(request.token_ids.ids)
            replies[-1].usage.completion_tokens = n
            self._replies[n] = replies
        for reply in replies:
            await context.write(reply)


class _Discard(list[T]):
    """A list that forgets what is appended to it."""

    def append(self, item: T) -> None:
        pass


# -- the load generator ------------------------------------------------------------------------


class Client(Protocol):
    async def once(self, slot: int) -> tuple[float, float]:
        """Send one request on the caller's connection ``slot``; (seconds to its last byte, to its first)."""
        ...

    async def close(self) -> None: ...


@dataclass
class Samples:
    """Latencies of one kind at one concurrency over all its phases, and the child CPU they cost."""

    latencies: list[float] = field(default_factory=list)
    seconds: float = 0.0
    cpu_seconds: float = 0.0
    sys_seconds: float = 0.0

    def p(self, q: float) -> float:
        values = sorted(self.latencies)
        return values[min(len(values) - 1, int(q * len(values)))]


async def run_phase(client: Client, concurrency: int, n: int, into: Samples, pid: int) -> None:
    """``n`` requests from ``concurrency`` callers; latencies, wall and child CPU go into ``into``."""
    left = n

    async def caller(slot: int) -> None:
        nonlocal left
        while left > 0:
            left -= 1
            into.latencies.append((await client.once(slot))[0])

    user0, sys0 = cpu_times(pid)
    start = time.perf_counter()
    await asyncio.gather(*(caller(i) for i in range(concurrency)))
    into.seconds += time.perf_counter() - start
    user1, sys1 = cpu_times(pid)
    into.cpu_seconds += user1 - user0 + sys1 - sys0
    into.sys_seconds += sys1 - sys0


@dataclass(frozen=True)
class Plan:
    """Requests per phase; each kind runs ``rounds`` phases per concurrency."""

    warmup: int
    c1: int
    c32: int
    rounds: int


QUICK = Plan(warmup=500, c1=1000, c32=3000, rounds=2)
FULL = Plan(warmup=1000, c1=2000, c32=6000, rounds=4)


async def measure(clients: dict[str, Client], plan: Plan, pid: int, report: Report) -> None:
    for client in clients.values():
        await run_phase(client, 32, plan.warmup, Samples(), pid)
    freeze_startup_heap()  # as the servers do: this process's full collections would land on any kind
    for concurrency, n in ((1, plan.c1), (32, plan.c32)):
        samples = {kind: Samples() for kind in clients}
        for r in range(plan.rounds):
            for kind in (list(clients) if r % 2 == 0 else list(reversed(clients))):
                await run_phase(clients[kind], concurrency, n, samples[kind], pid)
        for kind, s in samples.items():
            name = f"{kind}_c{concurrency}"
            report.add(f"{name}_cpu", s.cpu_seconds / len(s.latencies) * 1e6, "us/req")
            report.add(f"{name}_cpu_sys", s.sys_seconds / len(s.latencies) * 1e6, "us/req")
            report.add(f"{name}_p50", s.p(0.5) * 1e3, "ms")
            report.add(f"{name}_p99", s.p(0.99) * 1e3, "ms")
            report.add(f"{name}_rps", len(s.latencies) / s.seconds, "req/s")
        if "grpc" in samples and "grpc_bare" in samples:
            own = (samples["grpc"].cpu_seconds / len(samples["grpc"].latencies)
                   - samples["grpc_bare"].cpu_seconds / len(samples["grpc_bare"].latencies))
            report.add(f"grpc_own_c{concurrency}_cpu", own * 1e6, "us/req")


def start_child(profile: str | None) -> tuple[subprocess.Popen[str], int, str, str]:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    if profile:
        env[_PROFILE_ENV] = str(Path(profile).resolve())
    child = subprocess.Popen([sys.executable, __file__, "--serve"], stdout=subprocess.PIPE, text=True, env=env)
    assert child.stdout is not None
    line = child.stdout.readline()
    if not line.startswith(_READY):
        child.kill()
        raise RuntimeError(f"front-door child did not start: {line!r}")
    _, port, address, bare_address = line.rsplit(" ", 3)
    return child, int(port), address, bare_address.strip()


async def main_async() -> None:
    parser = base_parser(__doc__ or "")
    parser.add_argument("--max-tokens", type=int, default=2, help="tokens per request")
    parser.add_argument("--kinds", default=",".join(KINDS), help=f"comma-separated subset of {','.join(KINDS)}")
    parser.add_argument("--profile", metavar="PATH", help="run the child under cProfile, stats to PATH")
    parser.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)  # the child mode
    args = parser.parse_args()
    if args.serve:
        tune_allocator()  # as every pdrouter server process does
        await serve()
        return
    kinds = [k for k in args.kinds.split(",") if k]
    if unknown := set(kinds) - set(KINDS):
        parser.error(f"unknown kinds {sorted(unknown)}")
    ids = ByteTokenizer(ECHO.vocab_size).encode(PROMPT)
    report = Report()
    report.add("prompt_tokens", len(ids), "tokens")
    report.add("max_tokens", args.max_tokens, "tokens")
    child, port, address, bare_address = start_child(args.profile)
    try:
        make: dict[str, Callable[[], Client]] = {
            "http": lambda: HttpCompletions(HOST, port, MODEL, ids, args.max_tokens, stream=False),
            "http_stream": lambda: HttpCompletions(HOST, port, MODEL, ids, args.max_tokens, stream=True),
            "grpc": lambda: RouterGenerate(address, MODEL, ids, args.max_tokens),
            "grpc_bare": lambda: RouterGenerate(bare_address, MODEL, ids, args.max_tokens)}
        clients: dict[str, Client] = {kind: make[kind]() for kind in kinds}
        await measure(clients, QUICK if args.quick else FULL, child.pid, report)
        for client in clients.values():
            await client.close()
    finally:
        child.send_signal(signal.SIGTERM)
        try:
            child.wait(30)
        except subprocess.TimeoutExpired:
            child.kill()
    report.emit(args.json)


if __name__ == "__main__":
    asyncio.run(main_async())
