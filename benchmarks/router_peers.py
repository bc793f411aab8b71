"""pd-router beside the peer routers: router CPU per request and added latency, one load generator, one run.

The systems, each in front of instant workers (no model work, so what the router costs stands out):

* ``pd-router``: ``pdrouter up --backend sim --time-scale 0`` (simulated GPUs that answer at once; the
  real router, Redis, the decode-driven hand-off and a real KV transfer between the simulated workers);
* ``sglang-router``, ``vllm-router``, ``smg`` (SGLang's model gateway), when they are installed in
  ``--peers-venv``, each in front of ``_instant_worker.py`` processes (``pip install sglang-router==0.3.2
  vllm-router==0.1.17 smg==1.13.0`` into a venv of its own: they pin packages of their own);
* ``python-relay``: not a router but the floor of one written in Python (``_python_relay.py``): each
  request's body relayed as it is to an instant worker over a kept-open connection and the answer
  relayed back (PD: a prefill hop, then a decode hop), on uvloop, parsing nothing but HTTP. What it
  costs, no Python router can save.

Two layouts by default: ``cache_aware``, one pool of four workers placed by prefix (pd-router colocated,
the peers' ``--policy cache_aware``); ``pd``, two prefill and two decode workers (pd-router disaggregated;
the peers' PD modes, ``round_robin``). A third on request, ``by_load``: the same pool placed without
looking at prefixes (pd-router ``--no-cache-aware``, by load alone: no prefix-index look-up; the peers'
``--policy round_robin``), which shows what the prefix matching costs each router. The workload is the
one the peers were first measured with: eight shared 2,000-character prefixes, a unique 200-character
suffix per request, 16 output tokens, non-streamed ``POST /v1/completions``.

Per system and layout:

* ``..._router_cpu``: the router's CPU time per request over a closed loop at concurrency 32 (all its
  threads; for a peer, its process and any child it starts), from the process's CPU-time clock;
* ``..._rps``: requests per second in that loop (the load generator, router and workers share this
  machine's cores, so it is the system's, not the router's, capacity);
* ``..._added_p50`` / ``..._added_p99``: at concurrency 1, requests alternate between the router and one
  instant worker reached directly, so drift hits both alike; the router's latency minus the worker's.
  For pd-router this includes its simulated workers' own time, which an instant worker does not spend
  (``benchmarks/router_overhead.py`` measures against pd-router's own workers reached directly);
* pd-router also gets ``..._redis_cpu``: its Redis server's CPU per request (index look-ups and decode
  bookings, work the peers do not do), so the whole cost is on the page;
* ``pd-router_<layout>_cpu_vs_best_peer``: pd-router's router CPU over the lowest peer's, same layout;
  ``python-relay_<layout>_cpu_vs_best_peer`` the floor's.

``--rounds N`` (without ``--vs``) runs the whole comparison ``N`` times, every system and layout once a
round, the systems' order reversed every other round: each figure is then the median of the rounds, and
``..._cpu_vs_best_peer`` the median of the rounds' ratios (each round against its own best peer), with
``..._cpu_vs_best_peer_min`` / ``..._max``. One run's ratio moves with the machine's drift between the
systems' rows; the median of a few rounds is the figure to judge a target by.

    python benchmarks/router_peers.py [--quick] [--json] [--peers-venv /tmp/peers-venv]
                                      [--systems pd-router,sglang-router,vllm-router,smg,python-relay] [--pin]
                                      [--layouts cache_aware,pd,by_load] [--seconds 8] [--pair-seconds 4]
                                      [--rounds N] [--vs REV [--vs-compiled]]

``--vs REV`` measures pd-router only, this tree against commit ``REV`` (its ``pdrouter`` package exported
with ``git archive`` and run from ``PYTHONPATH``), each layout ``--rounds`` times (default 3) with the two
trees in turn, the order reversed every round: ``pd-router_<layout>_router_cpu`` and
``pd-router_<layout>_vs_router_cpu`` are the medians of the rounds, ``pd-router_<layout>_vs_ratio`` the
median of the rounds' ratios (this tree ÷ REV; ``..._ratio_min`` / ``..._ratio_max``). CPU seconds, not
instructions: ``router_instructions.py`` counts the instructions, which fall faster than the CPU time
when the cut work was cheap instructions. This tree runs as it is, compiled or not
(``pd-router_compiled_modules``); ``--vs-compiled`` compiles REV's tree too, with REV's own
``scripts/compile_engine.py --router`` (about two minutes), to compare two compiled routers
(``pd-router_vs_compiled_modules``).

``--quick`` runs pd-router's PD row only, with short phases (under 30 s). ``--pin`` puts each router (all
its threads) alone on CPU 0 and everything else, its workers, Redis and the load generator, on CPU 1,
so that a router's figure does not depend on what shares its core.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import random
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from _load import HttpCompletions, cpu_seconds
from _report import Report, base_parser
from tracing_overhead import export_tree, tree_environment

from pdrouter.core.build import compiled_modules

HERE = Path(__file__).resolve().parent
PREFIXES, PREFIX_CHARS, SUFFIX_CHARS, TOKENS, CONCURRENCY = 8, 2000, 200, 16, 32
SYSTEMS = ("pd-router", "sglang-router", "vllm-router", "smg", "python-relay")
FLOOR = "python-relay"
"""Not a router: ``_python_relay.py``, the floor of any router written in Python (see the module docstring)."""
LAYOUTS = ("cache_aware", "pd", "by_load")
DEFAULT_LAYOUTS = ("cache_aware", "pd")
ONE_POOL = ("cache_aware", "by_load")
PEER_MODEL = "instant-model"


def prompts(seed: int) -> Iterator[str]:
    """Eight shared prefixes, each request with a suffix of its own (never repeated)."""
    rng = random.Random(seed)
    letters = "abcdefghijklmnopqrstuvwxyz"
    words = ["".join(rng.choice(letters) for _ in range(rng.randint(2, 9))) for _ in range(500)]

    def text(chars: int, head: str) -> str:
        out = head
        while len(out) < chars:
            out += " " + rng.choice(words)
        return out[:chars]

    shared = [text(PREFIX_CHARS, f"System prompt {g}:") for g in range(PREFIXES)]
    i = 0
    while True:
        yield shared[i % PREFIXES] + text(SUFFIX_CHARS, f"\nRequest {i}:")
        i += 1


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def descendants(pid: int) -> list[int]:
    """``pid`` and every process below it, from /proc."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError, IndexError, ValueError):
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
                children.setdefault(ppid, []).append(int(entry.name))
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo += children.get(p, [])
    return out


def cmdline(pid: int) -> list[str]:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
    except OSError:
        return []


def tree_cpu(pids: list[int]) -> float:
    total = 0.0
    for pid in pids:
        with contextlib.suppress(OSError):
            total += cpu_seconds(pid)
    return total


def pin(pids: list[int], cpus: set[int]) -> None:
    """Every thread of each process in ``pids`` onto ``cpus`` (threads started later inherit it)."""
    for pid in pids:
        with contextlib.suppress(OSError):
            for tid in os.listdir(f"/proc/{pid}/task"):
                with contextlib.suppress(OSError):
                    os.sched_setaffinity(int(tid), cpus)


class Processes:
    """Processes started for one row, stopped together (each in a session of its own)."""

    def __init__(self, logs: Path) -> None:
        self.logs = logs
        self.procs: list[subprocess.Popen[bytes]] = []

    def start(self, name: str, args: list[str], cwd: Path | None = None,
              extra_env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
        log = (self.logs / f"{name}.log").open("ab")
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "NO_PROXY": "*", "no_proxy": "*", **(extra_env or {})}
        proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, cwd=cwd, env=env, start_new_session=True)
        self.procs.append(proc)
        return proc

    def stop(self) -> None:
        for proc in self.procs:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGTERM)
        for proc in self.procs:
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        self.procs.clear()


async def one_request(client: HttpCompletions, slot: int) -> float:
    total, _ = await client.once(slot)
    return total


async def ready(port: int, model: str, timeout: float, what: str, logs: Path) -> None:
    """Wait until the router answers a generation (its workers found and healthy)."""
    deadline = time.monotonic() + timeout
    last = ""
    gen = prompts(999)
    while time.monotonic() < deadline:
        client = HttpCompletions("127.0.0.1", port, model, [], TOKENS, False, prompts=gen)
        try:
            await asyncio.wait_for(client.once(0), 10)
            return
        except (TimeoutError, OSError, RuntimeError, asyncio.IncompleteReadError, ValueError) as exc:
            last = str(exc)[:200]
        finally:
            with contextlib.suppress(Exception):
                await client.close()
        await asyncio.sleep(0.5)
    raise RuntimeError(f"{what} did not answer within {timeout:.0f} s (last: {last}); logs in {logs}")


@dataclass
class Loop:
    """A closed loop's outcome."""

    requests: int = 0
    errors: int = 0
    seconds: float = 0.0
    cpu: dict[str, float] = field(default_factory=dict)
    first_error: str = ""


async def closed_loop(client: HttpCompletions, seconds: float, watched: dict[str, list[int]]) -> Loop:
    """``CONCURRENCY`` clients back to back for ``seconds``; the CPU of each watched process group."""
    out = Loop()
    before = {name: tree_cpu(pids) for name, pids in watched.items()}
    start = time.perf_counter()
    deadline = start + seconds

    async def slot(i: int) -> None:
        while time.perf_counter() < deadline:
            try:
                await client.once(i)
                out.requests += 1
            except (OSError, RuntimeError, asyncio.IncompleteReadError, ValueError) as exc:
                out.errors += 1
                out.first_error = out.first_error or str(exc)[:300]
                await asyncio.sleep(0.05)

    await asyncio.gather(*(slot(i) for i in range(CONCURRENCY)))
    out.seconds = time.perf_counter() - start
    out.cpu = {name: tree_cpu(pids) - before[name] for name, pids in watched.items()}
    return out


async def paired(router: HttpCompletions, direct: HttpCompletions, seconds: float) -> tuple[list[float], list[float]]:
    """Concurrency 1, alternating the router and the instant worker request by request."""
    via, straight = [], []
    deadline = time.perf_counter() + seconds
    while time.perf_counter() < deadline:
        via.append(await one_request(router, 0))
        straight.append(await one_request(direct, 0))
    return via, straight


def quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


@dataclass
class Row:
    system: str
    layout: str
    port: int
    model: str
    watched: dict[str, list[int]]


class Bench:
    def __init__(self, args: argparse.Namespace, report: Report, work: Path) -> None:
        self.args, self.report, self.work = args, report, work
        self.py = str(Path(args.peers_venv) / "bin" / "python")
        self.seed = 0

    def peer_available(self, system: str) -> bool:
        if system == FLOOR:
            return True
        if not Path(self.py).exists():
            return False
        module = {"sglang-router": "sglang_router.launch_router", "smg": "smg.launch_router",
                  "vllm-router": "vllm_router_rs"}[system]
        if system == "vllm-router" and not (Path(self.args.peers_venv) / "bin" / "vllm-router").exists():
            return False
        return subprocess.run([self.py, "-c", f"import {module}"], capture_output=True).returncode == 0

    def start_workers(self, procs: Processes, layout: str) -> tuple[list[str], list[tuple[str, int]], list[str]]:
        """Instant workers for a peer: (regular URLs, prefill (URL, bootstrap port)s, decode URLs)."""
        worker = [sys.executable, str(HERE / "_instant_worker.py"), "--tokens", str(TOKENS)]
        regular: list[str] = []
        prefill: list[tuple[str, int]] = []
        decode: list[str] = []
        if layout in ONE_POOL:
            for i in range(4):
                port = free_port()
                procs.start(f"worker-{i}", [*worker, "--port", str(port)])
                regular.append(f"http://127.0.0.1:{port}")
        else:
            for i in range(2):
                port, boot = free_port(), free_port()
                procs.start(f"prefill-{i}", [*worker, "--port", str(port), "--role", "prefill",
                                             "--bootstrap-port", str(boot)])
                prefill.append((f"http://127.0.0.1:{port}", boot))
                port = free_port()
                procs.start(f"decode-{i}", [*worker, "--port", str(port), "--role", "decode"])
                decode.append(f"http://127.0.0.1:{port}")
        return regular, prefill, decode

    def start_peer(self, procs: Processes, system: str, layout: str) -> Row:
        regular, prefill, decode = self.start_workers(procs, layout)
        port, metrics = free_port(), free_port()
        common = ["--host", "127.0.0.1", "--port", str(port), "--prometheus-host", "127.0.0.1",
                  "--prometheus-port", str(metrics)]
        if system == FLOOR:
            relay = [sys.executable, str(HERE / "_python_relay.py"), "--port", str(port)]
            relay += (["--workers", *regular] if layout in ONE_POOL
                      else ["--prefill", *(url for url, _ in prefill), "--decode", *decode])
            proc = procs.start(system, relay)
            return Row(system, layout, port, PEER_MODEL, {"router": [proc.pid]})
        if system == "vllm-router":
            cmd = [str(Path(self.args.peers_venv) / "bin" / "vllm-router"), *common, "--log-level", "warning"]
        else:
            module = "sglang_router.launch_router" if system == "sglang-router" else "smg.launch_router"
            cmd = [self.py, "-m", module, *common, "--log-level", "warn"]
        if layout in ONE_POOL:
            cmd += ["--worker-urls", *regular, "--policy", "cache_aware" if layout == "cache_aware" else "round_robin"]
        elif system == "vllm-router":
            cmd += ["--vllm-pd-disaggregation"]
            for url, _ in prefill:
                cmd += ["--prefill", url]
            for url in decode:
                cmd += ["--decode", url]
            cmd += ["--policy", "round_robin"]
        else:
            cmd += ["--pd-disaggregation"]
            for url, boot in prefill:
                cmd += ["--prefill", url, str(boot)]
            for url in decode:
                cmd += ["--decode", url]
            cmd += ["--policy", "round_robin"]
        proc = procs.start(system, cmd)
        return Row(system, layout, port, PEER_MODEL, {"router": [proc.pid]})

    def start_pdrouter(self, procs: Processes, layout: str, tree: Path | None = None) -> Row:
        """``pdrouter up`` of this checkout, or of the exported package ``tree`` (``--vs``)."""
        port = free_port()
        shape = (["--mode", "colocated", "--workers", "4"] if layout in ONE_POOL
                 else ["--mode", "disaggregated", "--prefill", "2", "--decode", "2"])
        if layout == "by_load":
            shape.append("--no-cache-aware")
        up = [sys.executable, "-m", "pdrouter", "up", "--backend", "sim", "--time-scale", "0",
              "--model-preset", "llama-3-8b", "--no-api-key", "--http-port", str(port),
              "--grpc-port", str(free_port()), *shape]
        proc = procs.start("pd-router", up, cwd=self.work, extra_env=None if tree is None else tree_environment(tree))
        return Row("pd-router", layout, port, "sim-llama-3-8b", {"up": [proc.pid]})

    def pdrouter_pids(self, row: Row) -> None:
        """Split ``pdrouter up``'s tree into the router process and its Redis server."""
        tree = descendants(row.watched["up"][0])
        router = [p for p in tree if "router" in cmdline(p)[3:5]]
        redis = [p for p in tree if any("redis-server" in a for a in cmdline(p)[:1])]
        if len(router) != 1:
            raise RuntimeError(f"pdrouter up: expected one router process, found {router}")
        row.watched = {"router": router, "redis": redis}

    async def measure(self, row: Row, direct: HttpCompletions | None) -> dict[str, float]:
        """The row's figures: its router CPU per request at C=32 (``router_cpu``, µs), and with ``direct``
        the rest (``redis_cpu`` for pd-router, ``rps``, and from the paired C=1 run ``c1_p50``,
        ``added_p50`` and ``added_p99``, ms)."""
        name = f"{row.system}_{row.layout}"
        client = HttpCompletions("127.0.0.1", row.port, row.model, [], TOKENS, False, prompts=prompts(self.seed))
        self.seed += 1
        everything = os.sched_getaffinity(0)
        if self.args.pin:  # the router on a core of its own; its workers, Redis and this load generator on the other
            if not {0, 1} <= everything:
                raise SystemExit(f"--pin needs CPUs 0 and 1; this process may use {sorted(everything)}")
            router = [p for pid in row.watched["router"] for p in descendants(pid)]
            pin([p for p in descendants(os.getpid()) if p not in router], {1})
            pin(router, {0})
        try:
            await closed_loop(client, self.args.warmup_seconds, {})  # warm connections, caches, pools
            loop = await closed_loop(client, self.args.seconds, row.watched)
            if loop.requests == 0 or loop.errors > 0.01 * (loop.requests + loop.errors):
                raise RuntimeError(f"{name}: {loop.errors} errors in {loop.requests + loop.errors} requests "
                                   f"(first: {loop.first_error})")
            figures = {"router_cpu": loop.cpu["router"] / loop.requests * 1e6}
            if direct is None:
                return figures
            if "redis" in loop.cpu:
                figures["redis_cpu"] = loop.cpu["redis"] / loop.requests * 1e6
            figures["rps"] = loop.requests / loop.seconds
            via, straight = await paired(client, direct, self.args.pair_seconds)
            figures["c1_p50"] = quantile(via, 0.5) * 1e3
            figures["added_p50"] = (quantile(via, 0.5) - quantile(straight, 0.5)) * 1e3
            figures["added_p99"] = (quantile(via, 0.99) - quantile(straight, 0.99)) * 1e3
            return figures
        finally:
            if self.args.pin:
                pin(descendants(os.getpid()), everything)
            await client.close()

    async def row(self, system: str, layout: str, direct: HttpCompletions | None, tree: Path | None = None,
                  label: str = "") -> dict[str, float]:
        logs = self.work / "logs" / f"{system}_{layout}{label}"
        logs.mkdir(parents=True, exist_ok=True)
        procs = Processes(logs)
        try:
            if system == "pd-router":
                row = self.start_pdrouter(procs, layout, tree)
            else:
                row = self.start_peer(procs, system, layout)
            await ready(row.port, row.model, 240 if system == "pd-router" else 90, f"{system} ({layout})", logs)
            if system == "pd-router":
                self.pdrouter_pids(row)
            figures = await self.measure(row, direct)
            print(f"# {system} {layout}{label}: done", file=sys.stderr, flush=True)
            return figures
        finally:
            procs.stop()

    async def against(self, rev: str, layouts: list[str]) -> None:
        """``--vs``: pd-router of this tree and of ``rev`` in turn, ``--rounds`` times per layout."""
        try:
            tree = export_tree(rev, self.work / "vs")
        except subprocess.CalledProcessError as exc:
            raise SystemExit(f"--vs {rev}: git archive failed ({exc.stderr.decode().strip()})") from None
        if self.args.vs_compiled:
            compile_tree(rev, tree)
        self.report.add("pd-router_vs_compiled_modules", compiled_modules(tree / "pdrouter"), "modules")
        for layout in layouts:
            this: list[float] = []
            base: list[float] = []
            for i in range(self.args.rounds):
                for side in ((None, tree) if i % 2 == 0 else (tree, None)):
                    figures = await self.row("pd-router", layout, None, side, f"_{'vs' if side else 'this'}{i}")
                    (base if side else this).append(figures["router_cpu"])
            ratios = [t / b for t, b in zip(this, base, strict=True)]
            name = f"pd-router_{layout}"
            self.report.add(f"{name}_router_cpu", statistics.median(this), "us/req")
            self.report.add(f"{name}_vs_router_cpu", statistics.median(base), "us/req")
            self.report.add(f"{name}_vs_ratio", statistics.median(ratios), "x")
            self.report.add(f"{name}_vs_ratio_min", min(ratios), "x")
            self.report.add(f"{name}_vs_ratio_max", max(ratios), "x")

    async def run(self) -> None:
        systems = [s for s in self.args.systems.split(",") if s]
        for system in systems:
            if system not in SYSTEMS:
                raise SystemExit(f"--systems: unknown system {system!r}; choose from {', '.join(SYSTEMS)}")
        layouts = [x for x in self.args.layouts.split(",") if x]
        for layout in layouts:
            if layout not in LAYOUTS:
                raise SystemExit(f"--layouts: unknown layout {layout!r}; choose from {', '.join(LAYOUTS)}")
        # This tree's pd-router runs its compiled modules when the checkout has them
        # (scripts/compile_engine.py [--router]); 0: the sources.
        self.report.add("pd-router_compiled_modules", compiled_modules(HERE.parent / "pdrouter"), "modules")
        if self.args.vs:
            await self.against(self.args.vs, layouts)
            return
        logs = self.work / "logs"
        logs.mkdir(parents=True, exist_ok=True)
        baseline = Processes(logs)
        direct_port = free_port()
        baseline.start("direct", [sys.executable, str(HERE / "_instant_worker.py"), "--port", str(direct_port),
                                  "--tokens", str(TOKENS)])
        direct = HttpCompletions("127.0.0.1", direct_port, PEER_MODEL, [], TOKENS, False, prompts=prompts(10_000))
        try:
            await ready(direct_port, PEER_MODEL, 30, "the instant worker", logs)
            available = []
            for system in systems:
                if system != "pd-router" and not self.peer_available(system):
                    print(f"# {system}: not installed in {self.args.peers_venv}; its rows are skipped",
                          file=sys.stderr)
                    continue
                available.append(system)
            rounds = self.args.rounds or 1
            # Per round, every system and layout once; the systems' order reversed every other round, so
            # that a drift of the machine within a round does not favour the systems measured first.
            runs: dict[tuple[str, str], list[dict[str, float]]] = {}
            for i in range(rounds):
                for system in (available if i % 2 == 0 else available[::-1]):
                    for layout in layouts:
                        label = f"_round{i}" if rounds > 1 else ""
                        runs.setdefault((system, layout), []).append(await self.row(system, layout, direct,
                                                                                    label=label))
        finally:
            await direct.close()
            baseline.stop()
        self.summarize(runs, layouts, rounds)

    def summarize(self, runs: dict[tuple[str, str], list[dict[str, float]]], layouts: list[str],
                  rounds: int) -> None:
        """Each figure's median over the rounds, and pd-router's (and the floor's) CPU over the best
        peer's: the median of the rounds' ratios, each round's best peer its own."""
        if rounds > 1:
            self.report.add("rounds", rounds, "rounds")
        units = {"router_cpu": "us/req", "redis_cpu": "us/req", "rps": "req/s", "c1_p50": "ms",
                 "added_p50": "ms", "added_p99": "ms"}
        for (system, layout), figures in runs.items():
            for key, unit in units.items():
                values = [f[key] for f in figures if key in f]
                if values:
                    self.report.add(f"{system}_{layout}_{key}", statistics.median(values), unit)
        for layout in layouts:
            peers = [s for (s, lay) in runs if lay == layout and s not in ("pd-router", FLOOR)]
            if not peers:
                continue
            best = [min(peers, key=lambda s: runs[(s, layout)][i]["router_cpu"]) for i in range(rounds)]
            print(f"# {layout}: best peer {', '.join(best)}", file=sys.stderr)
            for system in ("pd-router", FLOOR):
                if (system, layout) not in runs:
                    continue
                ratios = [runs[(system, layout)][i]["router_cpu"] / runs[(best[i], layout)][i]["router_cpu"]
                          for i in range(rounds)]
                name = f"{system}_{layout}_cpu_vs_best_peer"
                self.report.add(name, statistics.median(ratios), "x")
                if rounds > 1:
                    self.report.add(f"{name}_min", min(ratios), "x")
                    self.report.add(f"{name}_max", max(ratios), "x")


def compile_tree(rev: str, tree: Path) -> None:
    """``--vs-compiled``: ``rev``'s exported tree compiled as ``rev``'s own ``scripts/compile_engine.py --router``
    compiles it (its lists of modules, not this tree's)."""
    for path, into in (("scripts/compile_engine.py", "compile_engine.py"), ("pyproject.toml", "pyproject.toml")):
        try:  # the script, and the mypy settings it compiles with
            text = subprocess.run(["git", "show", f"{rev}:{path}"], cwd=HERE.parent, capture_output=True,
                                  check=True).stdout
        except subprocess.CalledProcessError as exc:
            raise SystemExit(f"--vs-compiled {rev}: it has no {path} ({exc.stderr.decode().strip()})") from None
        (tree / into).write_bytes(text)
    print(f"# compiling {rev}'s tree (about 2 minutes)...", file=sys.stderr, flush=True)
    done = subprocess.run([sys.executable, str(tree / "compile_engine.py"), "--router", "--root", str(tree)],
                          capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"--vs-compiled {rev}: compiling its tree failed:\n{(done.stdout + done.stderr)[-2000:]}")


def main() -> None:
    parser = base_parser(__doc__.split("\n\n")[0])
    parser.formatter_class = argparse.ArgumentDefaultsHelpFormatter
    parser.add_argument("--peers-venv", default="/tmp/peers-venv", help="the venv holding the peer routers")
    parser.add_argument("--systems", default=argparse.SUPPRESS,
                        help=f"systems to measure, comma-separated (default {','.join(SYSTEMS)}; with --quick, "
                             "pd-router)")
    parser.add_argument("--layouts", default=argparse.SUPPRESS,
                        help=f"layouts to measure, comma-separated (default {','.join(DEFAULT_LAYOUTS)}; with "
                             "--quick, pd)")
    parser.add_argument("--seconds", type=float, default=8.0, help="measured seconds at concurrency 32")
    parser.add_argument("--pair-seconds", type=float, default=4.0, help="seconds of the paired concurrency-1 run")
    parser.add_argument("--warmup-seconds", type=float, default=2.0, help="unmeasured seconds before each row")
    parser.add_argument("--pin", action="store_true",
                        help="the router alone on CPU 0, its workers, Redis and the load generator on CPU 1")
    parser.add_argument("--vs", metavar="REV", help="pd-router only: this tree against commit REV, in turn")
    parser.add_argument("--vs-compiled", action="store_true",
                        help="with --vs: REV's tree compiled (by its own scripts/compile_engine.py --router) first")
    parser.add_argument("--rounds", type=int, default=None,
                        help="rounds: with --vs, per layout (default 3); otherwise of the whole comparison, "
                             "every system and layout once a round (default 1)")
    args = parser.parse_args()
    if args.rounds is not None and args.rounds < 1:
        parser.error("--rounds must be at least 1")
    if args.vs_compiled and not args.vs:
        parser.error("--vs-compiled compiles the tree of --vs REV: give --vs")
    if args.vs and args.rounds is None:
        args.rounds = 3
    if args.quick:
        args.seconds, args.pair_seconds, args.warmup_seconds = 3, 2, 1
    args.systems = getattr(args, "systems", None) or ("pd-router" if args.quick else ",".join(SYSTEMS))
    args.layouts = getattr(args, "layouts", None) or ("pd" if args.quick else ",".join(DEFAULT_LAYOUTS))
    report = Report()
    with tempfile.TemporaryDirectory(prefix="router-peers-") as tmp:
        asyncio.run(Bench(args, report, Path(tmp)).run())
    report.emit(args.json)


if __name__ == "__main__":
    main()
