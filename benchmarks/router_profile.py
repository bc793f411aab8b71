"""Where the router's CPU goes, function by function, per request: a CPU-clock profile of its event loop.

    python benchmarks/router_profile.py [--quick] [--json] [--layouts pd,cache_aware] [--requests N]
                                        [--concurrency N] [--top N]

The router (``pdrouter router``, this tree) runs in front of simulated GPUs at time scale 0 (they answer
at once) and one embedded Redis, in ``router_peers.py``'s layouts: ``pd``, two prefill and two decode
workers, and ``cache_aware``, four colocated workers placed by prefix. The workload is
``router_peers.py``'s: eight shared 2,000-character prefixes, a unique 200-character suffix, 16 tokens,
non-streamed ``POST /v1/completions``, ``--concurrency`` requests at once (default 32).

The router's event loop is profiled with ``cProfile`` timed by its thread's CPU clock
(``_cpu_profile.py``): time it waits, or spends preempted by a process it woke, does not count, where
a sampling profiler or a wall-clock profile counts both. The profile starts after a warm-up and stops
after ``--requests`` requests (default 4,000), so neither start-up nor shutdown is in it. The profiler
has a cost of its own, about a microsecond per Python call, which weighs on the functions called
most: read the shares, not the absolute figures, and time a change with ``router_peers.py --vs`` or
``router_instructions.py``.

Per layout: ``router_<layout>_profiled_cpu_per_request`` (the profiled total, the profiler's cost
included); for the ``--top`` functions by their own CPU, ``router_<layout>_top<NN>``: the share of the
total, with the function, its own CPU per request and its calls per request; and the same shares summed
by module (``router_<layout>_module<NN>``: the HTTP door, the dispatcher, the prefix index, the lane
client, asyncio...), where the time goes by area.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import pstats
import secrets
import signal
import sys
import tempfile
import time
from pathlib import Path
from unittest import mock

from _load import HttpCompletions
from _report import Report, base_parser
from router_instructions import LAYOUTS, SIM, once
from router_peers import TOKENS, prompts

from pdrouter.cli.local_cluster import ManagedProcess, worker_args
from pdrouter.core.model_spec import get_model_preset
from pdrouter.engine.model_folder import write_config_folder
from pdrouter.state.embedded_redis import EmbeddedRedis
from pdrouter.wire.security import INTERNAL_TOKEN_ENV

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent


def profiled_interpreter(tmp: Path, out: Path) -> Path:
    """A stand-in for ``sys.executable`` that runs ``-m MODULE ...`` under ``_cpu_profile.py``."""
    wrapper = tmp / "python-cpu-profile"
    wrapper.write_text(f"#!/bin/sh\nexec {sys.executable} {HERE / '_cpu_profile.py'} {out} \"$@\"\n")
    wrapper.chmod(0o755)
    return wrapper


async def load(client: HttpCompletions, conns: dict[int, object], count: int, concurrency: int) -> None:
    """``count`` requests, ``concurrency`` at once."""
    for start in range(0, count, concurrency):
        await asyncio.gather(*(once(client, conns, slot) for slot in range(min(concurrency, count - start))))


def short_path(path: str) -> str:
    """A source file's path from the tree's root, its site-packages or its standard library."""
    for marker in ("site-packages/", "/lib/python3.11/", f"{ROOT}/"):
        if marker in path:
            return path.split(marker, 1)[1]
    return path


def function_name(func: tuple[str, int, str]) -> str:
    path, line, name = func
    return f"{name} ({short_path(path)}:{line})" if line else name


def module_name(func: tuple[str, int, str]) -> str:
    """The module a function is in (``pdrouter/router/dispatch.py``, ``asyncio/tasks.py``), or, for a
    built-in, the built-in itself (its time is its callers' work done in C)."""
    return func[2] if func[0] == "~" else short_path(func[0])


async def profile_layout(layout: str, requests: int, concurrency: int, top: int, report: Report, tmp: Path) -> None:
    model = tmp / "sim-llama-3-8b"
    if not model.exists():
        write_config_folder(get_model_preset("llama-3-8b"), model)
    out = tmp / f"router-{layout}.prof"
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    token = {INTERNAL_TOKEN_ENV: secrets.token_hex(16), "PDROUTER_KV_TOKEN": secrets.token_hex(16),
             "PDROUTER_KV_TOKEN_FILE": ""}
    procs: list[ManagedProcess] = []
    with EmbeddedRedis() as server:
        try:
            for role, count in LAYOUTS[layout]:
                for i in range(count):
                    proc = ManagedProcess(f"{role}-{i}", worker_args(
                        role, model, redis_url=server.url, sim=SIM, extra=("--worker-id", f"{layout}-{role}-{i}")),
                        env={**env, **token})
                    procs.append(proc)
                    proc.wait_ready(120.0)
            mode = "disaggregated" if layout == "pd" else "colocated"
            with mock.patch.object(sys, "executable", str(profiled_interpreter(tmp, out))):
                router = ManagedProcess("router", [
                    "router", "--model", str(model), "--redis", server.url, "--mode", mode, "--http-port", "0",
                    "--grpc-port", "0", "--log-level", "WARNING"], env={**env, **token, "PYTHONPATH": str(ROOT)})
            procs.append(router)
            router.wait_ready(300.0)
            await asyncio.sleep(1.5)  # every worker in the router's pool
            assert router.address is not None
            host, port = router.address.rsplit(":", 1)
            conns: dict[int, object] = {}
            client = HttpCompletions(host, int(port), model.name, [], TOKENS, False, prompts=prompts(0),
                                     connections=conns)  # type: ignore[arg-type]
            try:
                await load(client, conns, max(concurrency, requests // 4), concurrency)  # warm-up
                os.kill(router.proc.pid, signal.SIGUSR1)
                await asyncio.sleep(0.05)
                await load(client, conns, requests, concurrency)
                os.kill(router.proc.pid, signal.SIGUSR2)
                deadline = time.monotonic() + 30.0
                while not out.exists() and time.monotonic() < deadline:
                    await asyncio.sleep(0.05)
                await asyncio.sleep(0.2)  # written in full
            finally:
                await client.close()
        finally:
            for proc in reversed(procs):
                proc.stop()
    if not out.exists():
        raise SystemExit(f"router_profile.py: the router wrote no profile ({layout}); see its output above")
    stats = pstats.Stats(str(out))
    rows = [(own, calls, func) for func, (_, calls, own, _, _) in stats.stats.items()]  # type: ignore[attr-defined]
    total = sum(own for own, _, _ in rows)
    report.add(f"router_{layout}_profiled_requests", requests, "requests")
    report.add(f"router_{layout}_profiled_cpu_per_request", total / requests * 1e6, "us/req (profiler's cost included)")
    for i, (own, calls, func) in enumerate(sorted(rows, key=lambda r: -r[0])[:top], start=1):
        report.add(f"router_{layout}_top{i:02d}", 100.0 * own / total,
                   f"% {function_name(func)}: {own / requests * 1e6:.1f} us/req, {calls / requests:.2f} calls/req")
    by_module: dict[str, float] = {}
    for own, _, func in rows:
        where = module_name(func)
        by_module[where] = by_module.get(where, 0.0) + own
    for i, (where, own) in enumerate(sorted(by_module.items(), key=lambda kv: -kv[1])[:top], start=1):
        report.add(f"router_{layout}_module{i:02d}", 100.0 * own / total, f"% {where}")


async def run(args: object, report: Report) -> None:
    layouts = [x for x in args.layouts.split(",") if x]  # type: ignore[attr-defined]
    for layout in layouts:
        if layout not in LAYOUTS:
            raise SystemExit(f"--layouts: unknown layout {layout!r}; choose from {', '.join(LAYOUTS)}")
    with tempfile.TemporaryDirectory(prefix="router-profile-") as tmp_s, contextlib.chdir(tmp_s):
        for layout in layouts:
            await profile_layout(layout, args.requests, args.concurrency, args.top, report,  # type: ignore[attr-defined]
                                 Path(tmp_s))


def main() -> None:
    parser = base_parser(__doc__.split("\n\n")[0])
    parser.add_argument("--layouts", default="pd,cache_aware", help="layouts, comma-separated (pd, cache_aware)")
    parser.add_argument("--requests", type=int, default=None, help="profiled requests per layout (default 4000)")
    parser.add_argument("--concurrency", type=int, default=32, help="requests at once")
    parser.add_argument("--top", type=int, default=None, help="functions to print per layout (default 30)")
    args = parser.parse_args()
    if args.quick:
        args.layouts = "pd"
    if args.requests is None:
        args.requests = 500 if args.quick else 4000
    if args.top is None:
        args.top = 15 if args.quick else 30
    if args.requests < 1 or args.concurrency < 1 or args.top < 1:
        parser.error("--requests, --concurrency and --top must be at least 1")
    report = Report()
    asyncio.run(run(args, report))
    report.emit(args.json)


if __name__ == "__main__":
    main()
