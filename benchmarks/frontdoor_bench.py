"""Front-door overhead: the router's CPU per request in its HTTP and gRPC doors, over an in-process echo model.

A child process serves both front doors built as ``pdrouter.router.server.RouterProcess`` builds them
(``create_app`` / ``make_server`` / ``bind_socket`` for HTTP, ``RouterServicer`` on a
``GrpcServer`` for gRPC), over ``EchoDispatcher`` instead of the real dispatcher, so nothing
but the doors (parsing, tokenizing, metrics, response shaping, the HTTP and gRPC stacks) costs CPU.
It runs on the event loop the router runs on (``event_loop_factory``: uvloop when installed;
``PDROUTER_EVENT_LOOP=asyncio`` selects asyncio's). The same HTTP door app is also served, in the same
process, by two servers used as their documentation shows: uvicorn with ``http="httptools"`` (its
``Config`` / ``Server``, no subclass) and granian's embedded ASGI server (``granian.server.embed``),
when granian is installed. This process drives load and reads the child's CPU time (user + system,
all threads) from ``/proc/<pid>/stat`` around each measured phase.

Short requests: a 13-token prompt given as token ids, ``--max-tokens`` (2) greedy tokens. Kinds:

* ``http``: ``POST /v1/completions`` with ``stream: false`` over keep-alive connections (one per
  concurrent caller), with a minimal HTTP/1.1 client;
* ``http_stream``: the same request with ``stream: true`` (SSE, chunked);
* ``http_uvicorn``, ``http_granian``: ``http`` served by plain uvicorn (httptools) / granian instead
  of the router's server (``pdrouter.router.frontdoor.http_server``); ``http_stream_uvicorn`` and
  ``http_stream_granian`` likewise, measured only when ``--kinds`` names them;
* ``grpc``: ``pdrouter.v1.Router.Generate`` with the same token ids (a server stream: one message
  per token), on the door's own server (``pdrouter.wire.h2_grpc``, the router's default), from a
  minimal gRPC client on one HTTP/2 connection (``_load.GrpcGenerate``; ``--grpc-client grpcio``: a
  ``grpc.aio`` channel);
* ``grpc_bare``: the same call to a bare servicer in the same process, on a server of the same
  kind, that writes ready-made messages (as many, of the same shape) and does nothing else: what
  the server itself costs per call of this shape, the floor under the ``grpc`` figures;
* ``grpc_grpcio``, ``grpc_bare_grpcio``: the door and the bare servicer on grpcio's asyncio server
  (``pdrouter router --grpc-server grpcio``), measured only when ``--kinds`` names them;
* ``grpc_bare_grpclib``: the same bare servicer served by grpclib (the asyncio gRPC server on the
  ``h2`` library), measured only when ``--kinds`` names it and grpclib is installed: the floor a door
  on the other general Python gRPC server would stand on.

Each kind runs at concurrency 1 and 32; phases alternate between kinds over several rounds so
drift hits every kind alike. Figures per kind and concurrency: ``_cpu`` (child CPU per request),
``_cpu_sys`` (the part of it spent in the kernel: sockets, polling), ``_p50`` / ``_p99`` latency
and ``_rps``. With both gRPC kinds, ``grpc_own_c{1,32}_cpu`` is the gRPC door's CPU above that
floor: its own Python (validation, tokenizing, the request's path, metrics, messages) (on grpcio:
``grpc_grpcio_own_c{1,32}_cpu``); ``<kind>_vs_http_c{1,32}_cpu_ratio`` a gRPC door's CPU over the
HTTP door's.

The HTTP servers are compared last, one figure a line: ``http door cpu per request at c=32, <server>``
for each server measured, then for each plain server the CPU it adds per request (against the
250 µs the whole router may spend at c=32) and its CPU and c=1 p50 as ratios to the router's
server, measured in the same run. Without granian its kinds are skipped with a note (on stderr
with ``--json``).

``--vs REV`` also starts a child serving the doors of commit ``REV`` (its ``pdrouter`` package exported
with ``git archive`` and put first on the child's ``PYTHONPATH``): each of the router's door kinds
measured (``http``, ``http_stream``, ``grpc``) runs against it too as ``<kind>_vs``, taking turns
with the rest, and ``<kind>_c{1,32}_cpu_vs_ratio`` is this tree's door CPU per request over
``REV``'s (under 1: this tree costs less).

``--profile PATH`` runs the child under cProfile and writes its stats to PATH (the CPU figures
are then inflated by the profiler); ``--kinds`` measures a subset.

    python benchmarks/frontdoor_bench.py [--quick] [--json] [--kinds http,http_uvicorn,grpc] [--profile out.pstats]
                                         [--vs REV]
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, TypeVar

import grpc
import uvicorn
from _load import GRPC_CLIENTS, HttpCompletions, cpu_times
from _report import Report, base_parser
from tracing_overhead import export_tree, tree_environment

from pdrouter.cli.serve import freeze_startup_heap, space_young_collections, tune_allocator
from pdrouter.core.aio import event_loop_factory
from pdrouter.core.tokenizer import ByteTokenizer
from pdrouter.router.frontdoor.grpc_api import SERVICE_NAME, RouterServicer, add_to_server
from pdrouter.router.frontdoor.http_api import create_app
from pdrouter.router.frontdoor.http_server import bind_socket, make_server
from pdrouter.router.frontdoor.served_models import FrontdoorConfig
from pdrouter.router.metrics import RouterMetrics
from pdrouter.router.request import RouterRequest
from pdrouter.testing.echo import ECHO, TINY, EchoDispatcher
from pdrouter.wire.grpc_util import GrpcServer
from pdrouter.wire.v1 import common_pb2, router_pb2, router_pb2_grpc

MODEL = ECHO.name
PROMPT = "Hello, world"
"""13 tokens with the byte tokenizer's <bos>."""
HOST = "127.0.0.1"
KINDS = ("http", "http_stream", "http_uvicorn", "http_granian", "grpc", "grpc_bare",
         "http_stream_uvicorn", "http_stream_granian", "grpc_bare_grpclib", "grpc_grpcio", "grpc_bare_grpcio")
DEFAULT_KINDS = KINDS[:6]
SERVERS = {"": "hand-tuned server", "_uvicorn": "uvicorn+httptools", "_granian": "granian"}
"""Kind suffix → the HTTP server it names in the comparison figures."""
_READY = "frontdoor-bench ready"
_PROFILE_ENV = "FRONTDOOR_BENCH_PROFILE"
_START_WAIT_S = 10.0
T = TypeVar("T")


# -- the child: both front doors over the echo dispatcher ------------------------------------


async def serve() -> None:
    """Serve both doors, the door app under plain uvicorn and granian too, and the bare gRPC
    servicer until SIGTERM; print ``<ready> <JSON of addresses>`` once up (granian's address
    None, with the reason, when it cannot serve)."""
    logging.basicConfig(level="WARNING", format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    profile_path = os.environ.get(_PROFILE_ENV)
    profiler = cProfile.Profile() if profile_path else None
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    loop.add_signal_handler(signal.SIGTERM, stop.set)
    dispatcher = EchoDispatcher([ECHO, TINY])
    tokenizers = {ECHO.name: ByteTokenizer(ECHO.vocab_size), TINY.name: ByteTokenizer(TINY.vocab_size)}
    metrics = RouterMetrics()
    config = FrontdoorConfig()
    servicer = RouterServicer(dispatcher, tokenizers, metrics=metrics, config=config)
    bare = _BareRouter()
    grpc_servers = {"grpc": _door_server(), "grpc_bare": _door_server(),
                    "grpc_grpcio": GrpcServer(HOST, 0), "grpc_bare_grpcio": GrpcServer(HOST, 0)}
    for kind, server in grpc_servers.items():
        if "bare" not in kind:
            add_to_server(server, servicer)
        elif isinstance(server, GrpcServer):
            server.add(router_pb2_grpc.add_RouterServicer_to_server, bare, SERVICE_NAME)
        else:
            from pdrouter.wire.h2_grpc import UNARY_STREAM, Method
            server.add_service(SERVICE_NAME, {"Generate": Method(UNARY_STREAM, bare.Generate,
                                                                 router_pb2.GenerateRequest.FromString,
                                                                 router_pb2.GenerateResponse.SerializeToString)})
        await server.start()
    app = create_app(dispatcher, tokenizers, metrics=metrics, config=config)
    http_port, server, http_task = await _serve_uvicorn(lambda port: make_server(app, HOST, port))
    plain_port, plain, plain_task = await _serve_uvicorn(lambda port: _plain_uvicorn(app, port))
    granian, granian_note = await _serve_granian(app)
    grpclib, grpclib_note = await _serve_grpclib()
    # The fake keeps every request it saw; a long run must not grow the heap without bound.
    dispatcher.requests = _Discard[RouterRequest]()
    dispatcher.completed = _Discard[str]()
    freeze_startup_heap()  # as every pdrouter server process does after start-up
    space_young_collections()
    addresses = {"http": http_port, "http_uvicorn": plain_port, "http_granian": granian[0] if granian else None,
                 "granian_note": granian_note, **{kind: server.address for kind, server in grpc_servers.items()},
                 "grpc_bare_grpclib": f"{HOST}:{grpclib[0]}" if grpclib else None, "grpclib_note": grpclib_note,
                 "event_loop": type(loop).__module__.split(".")[0]}
    print(f"{_READY} {json.dumps(addresses)}", flush=True)
    if profiler is not None:
        profiler.enable()
    await stop.wait()
    if profiler is not None and profile_path:
        profiler.disable()
        profiler.dump_stats(profile_path)
    server.should_exit = plain.should_exit = True
    if granian is not None:
        granian[1].stop()
    for server in grpc_servers.values():
        await server.stop(0)
    if grpclib is not None:
        grpclib[1].close()
        await grpclib[1].wait_closed()
    await asyncio.gather(http_task, plain_task, *([granian[2]] if granian else []))


async def _serve_uvicorn(make: Callable[[int], uvicorn.Server]) -> tuple[int, uvicorn.Server, asyncio.Task[None]]:
    """Serve ``make(port)`` on a free port (a socket from ``bind_socket``); the port, server and its task."""
    sock = bind_socket(HOST, 0)
    sock.listen(1024)
    sock.setblocking(False)
    port = sock.getsockname()[1]
    server = make(port)
    task = asyncio.create_task(server.serve(sockets=[sock]))
    while not server.started:
        if task.done():
            await task
        await asyncio.sleep(0.01)
    return port, server, task


def _plain_uvicorn(app: Any, port: int) -> uvicorn.Server:
    """uvicorn as documented (``Config`` + ``Server``, ``http="httptools"``), with the router's other
    settings: no lifespan, no access log, no ``server`` header, no proxy headers."""
    config = uvicorn.Config(app, host=HOST, port=port, http="httptools", ws="none", lifespan="off",
                            access_log=False, log_config=None, log_level="warning", server_header=False,
                            proxy_headers=False)
    return uvicorn.Server(config)


async def _serve_granian(app: Any) -> tuple[tuple[int, Any, asyncio.Task[None]] | None, str | None]:
    """granian's embedded ASGI server for ``app`` on a free port: ((port, server, task), None), or
    (None, why not) when granian is not installed or does not start."""
    try:
        from granian.constants import HTTPModes, Interfaces
        from granian.server.embed import Server
    except ImportError as exc:
        return None, f"granian is not installed ({exc}); pip install granian to measure it"
    with socket.socket() as probe:  # granian binds its own socket: take a port that is free now
        probe.bind((HOST, 0))
        port = probe.getsockname()[1]
    try:
        server = Server(app, address=HOST, port=port, interface=Interfaces.ASGINL, http=HTTPModes.http1,
                        websockets=False, backlog=1024, log_enabled=False)
    except Exception as exc:  # a granian whose options differ from these
        return None, f"granian did not start: {exc!r}"
    task: asyncio.Task[None] = asyncio.create_task(server.serve())
    deadline = time.monotonic() + _START_WAIT_S
    while True:
        try:
            _, writer = await asyncio.open_connection(HOST, port)
        except OSError as exc:
            if task.done() or time.monotonic() > deadline:
                server.stop()
                detail = repr(task.exception()) if task.done() and not task.cancelled() else repr(exc)
                return None, f"granian did not start: {detail}"
            await asyncio.sleep(0.02)
            continue
        writer.close()
        await writer.wait_closed()
        return (port, server, task), None


class _BareRouter(router_pb2_grpc.RouterServicer):
    """``Generate`` that writes ready-made messages, one per token asked for, and nothing else."""

    def __init__(self) -> None:
        self._replies: dict[int, list[router_pb2.GenerateResponse]] = {}

    def replies(self, request: router_pb2.GenerateRequest) -> list[router_pb2.GenerateResponse]:
        n = max(1, request.sampling.max_tokens)
        replies = self._replies.get(n)
        if replies is None:
            replies = [router_pb2.GenerateResponse(request_id="bare", token_ids=[65], text="A") for _ in range(n)]
            replies[-1].finish_reason = common_pb2.FINISH_REASON_LENGTH
            replies[-1].usage.prompt_tokens = len(request.token_ids.ids)
            replies[-1].usage.completion_tokens = n
            self._replies[n] = replies
        return replies

    async def Generate(self, request: router_pb2.GenerateRequest, context: grpc.aio.ServicerContext) -> None:
        for reply in self.replies(request):
            await context.write(reply)


async def _serve_grpclib() -> tuple[tuple[int, Any] | None, str | None]:
    """``_BareRouter``'s replies served by grpclib on a free port: ((port, server), None), or (None, why
    not) when grpclib is not installed."""
    try:
        from grpclib.const import Cardinality, Handler
        from grpclib.server import Server, Stream
    except ImportError as exc:
        return None, f"grpclib is not installed ({exc}); pip install grpclib to measure it"
    bare = _BareRouter()

    class BareGrpclib:
        """grpclib's servicer protocol (``__mapping__``): the one method, unary request, streamed replies."""

        async def generate(self, stream: Stream[router_pb2.GenerateRequest, router_pb2.GenerateResponse]) -> None:
            request = await stream.recv_message()
            assert request is not None
            for reply in bare.replies(request):
                await stream.send_message(reply)

        def __mapping__(self) -> dict[str, Handler]:
            return {f"/{SERVICE_NAME}/Generate": Handler(self.generate, Cardinality.UNARY_STREAM,
                                                           router_pb2.GenerateRequest, router_pb2.GenerateResponse)}

    sock = bind_socket(HOST, 0)
    server = Server([BareGrpclib()])
    await server.start(sock=sock)
    return (sock.getsockname()[1], server), None


def _door_server() -> Any:
    """The door's own server, or grpcio's in a tree from before it had one (``--vs``)."""
    try:
        from pdrouter.wire.h2_grpc import H2GrpcServer
    except ImportError:
        return GrpcServer(HOST, 0)
    return H2GrpcServer(HOST, 0)


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


QUICK = Plan(warmup=300, c1=600, c32=2000, rounds=2)
FULL = Plan(warmup=600, c1=1500, c32=5000, rounds=4)


VS_KINDS = ("http", "http_stream", "grpc")
"""The router's own doors: the kinds ``--vs`` measures against the other commit's too."""


async def measure(clients: dict[str, Client], plan: Plan, pids: dict[str, int], report: Report) -> None:
    """Each kind's phases in turn; a kind's CPU is that of the child ``pids`` names for it."""
    for kind, client in clients.items():
        await run_phase(client, 32, plan.warmup, Samples(), pids[kind])
    freeze_startup_heap()  # as the servers do: this process's full collections would land on any kind
    for concurrency, n in ((1, plan.c1), (32, plan.c32)):
        samples = {kind: Samples() for kind in clients}
        for r in range(plan.rounds):
            for kind in (list(clients) if r % 2 == 0 else list(reversed(clients))):
                await run_phase(clients[kind], concurrency, n, samples[kind], pids[kind])
        for kind, s in samples.items():
            name = f"{kind}_c{concurrency}"
            report.add(f"{name}_cpu", s.cpu_seconds / len(s.latencies) * 1e6, "us/req")
            report.add(f"{name}_cpu_sys", s.sys_seconds / len(s.latencies) * 1e6, "us/req")
            report.add(f"{name}_p50", s.p(0.5) * 1e3, "ms")
            report.add(f"{name}_p99", s.p(0.99) * 1e3, "ms")
            report.add(f"{name}_rps", len(s.latencies) / s.seconds, "req/s")
        for door, floor in (("grpc", "grpc_bare"), ("grpc_grpcio", "grpc_bare_grpcio")):
            if door in samples and floor in samples:
                own = (samples[door].cpu_seconds / len(samples[door].latencies)
                       - samples[floor].cpu_seconds / len(samples[floor].latencies))
                report.add(f"{door}_own_c{concurrency}_cpu", own * 1e6, "us/req")
        for kind in ("grpc", "grpc_grpcio"):
            if kind in samples and "http" in samples:
                report.add(f"{kind}_vs_http_c{concurrency}_cpu_ratio",
                           (samples[kind].cpu_seconds / len(samples[kind].latencies))
                           / (samples["http"].cpu_seconds / len(samples["http"].latencies)), "x")
        for kind in VS_KINDS:
            if kind in samples and f"{kind}_vs" in samples:
                mine, theirs = samples[kind], samples[f"{kind}_vs"]
                report.add(f"{kind}_c{concurrency}_cpu_vs_ratio", (mine.cpu_seconds / len(mine.latencies))
                           / (theirs.cpu_seconds / len(theirs.latencies)), "x")


def start_child(profile: str | None, tree: Path | None = None) -> tuple[subprocess.Popen[str], dict[str, Any]]:
    """The serving child and what it printed once up (its addresses, see :func:`serve`); with
    ``tree``, serving that exported ``pdrouter`` package (``--vs``)."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    if tree is not None:  # the package of the tree first; this folder's helpers after it (PYTHONSAFEPATH drops it)
        env.update(tree_environment(tree))
        env["PYTHONPATH"] += os.pathsep + str(Path(__file__).resolve().parent)
    if profile:
        env[_PROFILE_ENV] = str(Path(profile).resolve())
    child = subprocess.Popen([sys.executable, __file__, "--serve"], stdout=subprocess.PIPE, text=True, env=env)
    assert child.stdout is not None
    line = child.stdout.readline()
    if not line.startswith(_READY):
        child.kill()
        raise RuntimeError(f"front-door child did not start: {line!r}")
    return child, json.loads(line[len(_READY):])


def compare_servers(report: Report) -> None:
    """Per HTTP server measured: its c=32 CPU per request; per plain server, what that adds to the
    router's own server, and that CPU and the c=1 p50 as ratios to it (same kind of request, same run)."""
    figures = {name: value for name, value, _ in report.figures}
    for stream in ("", "_stream"):
        what = "streamed " if stream else ""
        base = f"http{stream}"
        if stream and not any(f"{base}{suffix}_c32_cpu" in figures for suffix in SERVERS if suffix):
            continue  # streamed requests through the router's server alone: nothing to compare
        for suffix, server in SERVERS.items():
            cpu = figures.get(f"{base}{suffix}_c32_cpu")
            if isinstance(cpu, float):
                report.add(f"http door cpu per {what}request at c=32, {server}", cpu, "us")
        ours = figures.get(f"{base}_c32_cpu")
        for suffix, server in SERVERS.items():
            theirs = figures.get(f"{base}{suffix}_c32_cpu")
            if suffix and isinstance(ours, float) and isinstance(theirs, float):
                report.add(f"http door cpu per {what}request at c=32, {server} over hand-tuned server",
                           theirs - ours, "us")
        for suffix, server in SERVERS.items():
            for figure, label in (("c32_cpu", f"cpu per {what}request at c=32"), ("c1_p50", f"{what}p50 at c=1")):
                mine, theirs = figures.get(f"{base}_{figure}"), figures.get(f"{base}{suffix}_{figure}")
                if suffix and isinstance(mine, float) and isinstance(theirs, float) and mine > 0:
                    report.add(f"http door {label}, {server} / hand-tuned server", theirs / mine, "x")


async def drive(args: argparse.Namespace, kinds: list[str]) -> None:
    ids = ByteTokenizer(ECHO.vocab_size).encode(PROMPT)
    report = Report()
    report.add("prompt_tokens", len(ids), "tokens")
    report.add("max_tokens", args.max_tokens, "tokens")
    # The other commit exported first: a bad REV stops the run before any child starts.
    vs_tree = None if args.vs is None else export_tree(args.vs, Path(tempfile.mkdtemp(prefix="frontdoor-vs-")))
    child, where = start_child(args.profile)
    other: tuple[subprocess.Popen[str], dict[str, Any]] | None = None
    if vs_tree is not None:
        try:
            other = start_child(None, vs_tree)
        except BaseException:
            child.kill()
            raise
    report.add("event_loop", where["event_loop"])
    if where["http_granian"] is None and (skipped := [k for k in kinds if k.endswith("_granian")]):
        print(f"note: skipping {', '.join(skipped)}: {where['granian_note']}", file=sys.stderr if args.json else None,
              flush=True)
        kinds = [k for k in kinds if k not in skipped]
    if where["grpc_bare_grpclib"] is None and "grpc_bare_grpclib" in kinds:
        print(f"note: skipping grpc_bare_grpclib: {where['grpclib_note']}", file=sys.stderr if args.json else None,
              flush=True)
        kinds.remove("grpc_bare_grpclib")
    grpc_client = GRPC_CLIENTS[args.grpc_client]
    try:
        def http(port_of: str, stream: bool) -> Callable[[], Client]:
            return lambda: HttpCompletions(HOST, where[port_of], MODEL, ids, args.max_tokens, stream=stream)

        make: dict[str, Callable[[], Client]] = {
            "grpc": lambda: grpc_client(where["grpc"], MODEL, ids, args.max_tokens),
            "grpc_bare": lambda: grpc_client(where["grpc_bare"], MODEL, ids, args.max_tokens),
            "grpc_bare_grpclib": lambda: grpc_client(where["grpc_bare_grpclib"], MODEL, ids, args.max_tokens),
            "grpc_grpcio": lambda: grpc_client(where["grpc_grpcio"], MODEL, ids, args.max_tokens),
            "grpc_bare_grpcio": lambda: grpc_client(where["grpc_bare_grpcio"], MODEL, ids, args.max_tokens)}
        for suffix in SERVERS:
            make[f"http{suffix}"] = http(f"http{suffix}", stream=False)
            make[f"http_stream{suffix}"] = http(f"http{suffix}", stream=True)
        clients: dict[str, Client] = {kind: make[kind]() for kind in kinds}
        pids = dict.fromkeys(kinds, child.pid)
        if other is not None:
            there = other[1]
            make_vs: dict[str, Callable[[], Client]] = {
                "http_vs": lambda: HttpCompletions(HOST, there["http"], MODEL, ids, args.max_tokens, False),
                "http_stream_vs": lambda: HttpCompletions(HOST, there["http"], MODEL, ids, args.max_tokens, True),
                "grpc_vs": lambda: grpc_client(there["grpc"], MODEL, ids, args.max_tokens)}
            for kind in VS_KINDS:
                if kind in clients:
                    clients[f"{kind}_vs"] = make_vs[f"{kind}_vs"]()
                    pids[f"{kind}_vs"] = other[0].pid
        await measure(clients, QUICK if args.quick else FULL, pids, report)
        for client in clients.values():
            await client.close()
    finally:
        for proc in (child, *(() if other is None else (other[0],))):
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
    compare_servers(report)
    report.emit(args.json)


def main() -> None:
    parser = base_parser(__doc__ or "")
    parser.add_argument("--max-tokens", type=int, default=2, help="tokens per request")
    parser.add_argument("--kinds", default=",".join(DEFAULT_KINDS), help=f"comma-separated subset of {','.join(KINDS)}")
    parser.add_argument("--profile", metavar="PATH", help="run the child under cProfile, stats to PATH")
    parser.add_argument("--vs", default=None, metavar="REV",
                        help="also serve the doors of commit REV, measured in turn with this tree's")
    parser.add_argument("--grpc-client", choices=sorted(GRPC_CLIENTS), default="minimal",
                        help="the load generator's gRPC client: minimal (one HTTP/2 connection, little "
                             "client-side CPU) or grpcio (a grpc.aio channel)")
    parser.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)  # the child mode
    args = parser.parse_args()
    if args.serve:
        tune_allocator()  # as every pdrouter server process does
        with asyncio.Runner(loop_factory=event_loop_factory()) as runner:  # the router's event loop
            runner.run(serve())
        return
    kinds = [k for k in args.kinds.split(",") if k]
    if unknown := set(kinds) - set(KINDS):
        parser.error(f"unknown kinds {sorted(unknown)}")
    asyncio.run(drive(args, kinds))


if __name__ == "__main__":
    main()
