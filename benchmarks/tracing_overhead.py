"""What tracing costs the router: CPU per request with tracing off against the commit before tracing
existed, and with tracing on, side by side in one run.

Three routers: ``off`` (this tree, no OTEL_* variables), ``base`` (the tree of ``--baseline``, by
default the parent of the commit that added ``pdrouter/core/tracing.py``) and ``on`` (this tree,
every request traced, exporting over OTLP/HTTP to an in-process receiver). Each tree runs its own
cluster: a Redis and simulated workers (one prefill, one decode; ``--time-scale 0``: they answer at
once, so the figures are the router's) started from that tree, because the trees differ in more
than tracing (a router reads the registry and heartbeats its own tree's workers write, and an
older router does not start beside newer workers). ``off`` and ``on`` share this tree's cluster.
Another tree is its ``pdrouter`` package exported with ``git archive`` and run from it with
``PYTHONPATH`` (and ``PYTHONSAFEPATH``, so that ``python -m`` does not put the checkout ahead of
it); ``--tree REF`` runs ``off`` and ``on`` from ``REF``'s tree in the same way instead of the
checkout, to compare two commits. A closed loop of ``--concurrency`` clients sends short
disaggregated requests (``--prompt-tokens`` ids, ``--max-tokens`` tokens, the prefill on the
prefill worker) through each router's HTTP door in turn, ``--rounds`` rounds of ``--requests``
each, the order reversed every round so drift hits all alike. Per round, each router's CPU (its
process's CPU clock over its phase) per request; then per router the median, and the ratios of the
medians of per-round pairs:

* ``tracing_off_vs_base``: CPU per request, tracing off ÷ the baseline (the target: within 2 %,
  i.e. at most 1.02);
* ``tracing_on_vs_off``: what tracing every request costs.

``--instructions``: ``off`` against ``base`` counted in instructions instead of CPU seconds, which
the rest of the machine does not move. Each router runs under Valgrind's callgrind with
instrumentation off until its measured window; per round and router, ``callgrind_control`` turns
it on and zeroes the counts, the router serves the same ``--requests`` requests (one at a time, the
same bodies), and the dump's total is taken; then the router is counted as long again idle, and
that count is taken off: the router's timers (heartbeats, leases, pool refreshes) run by the wall
clock, more of them per request when the machine's load slows the router down. Every thread of the
router process is counted. Within a round the two routers are sent their requests in turn, one to
each, so that both go through the same moments of the machine's load; the ratios are reported per
round, with their median and their spread (max − min), the measurement's own noise. Tracing on is
left to the CPU-seconds mode (it runs five times slower under callgrind).

    python benchmarks/tracing_overhead.py [--quick] [--json] [--baseline REF] [--tree REF] [--instructions]
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import secrets
import shutil
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from collections.abc import Awaitable, Iterator
from io import BytesIO
from pathlib import Path
from unittest import mock

from _load import HttpCompletions, cpu_seconds
from _report import Report, base_parser

from pdrouter.cli.local_cluster import ManagedProcess
from pdrouter.engine.model_io import make_model
from pdrouter.state.embedded_redis import EmbeddedRedis
from pdrouter.testing.otlp import OtlpSink
from pdrouter.wire.security import INTERNAL_TOKEN_ENV

ROOT = Path(__file__).resolve().parent.parent


def _git(*args: str) -> bytes:
    return subprocess.run(["git", "-C", str(ROOT), *args], check=True, capture_output=True).stdout


def default_baseline() -> str:
    """The parent of the commit that added the tracing module: the tree before tracing."""
    added = _git("log", "--diff-filter=A", "--format=%H", "--", "pdrouter/core/tracing.py").split()
    if not added:
        raise SystemExit("no commit adds pdrouter/core/tracing.py: give --baseline")
    return added[-1].decode() + "^"


def export_tree(ref: str, into: Path) -> Path:
    """The ``pdrouter`` package of ``ref``, written under ``into`` (for PYTHONPATH); SystemExit naming
    the ref when git cannot export it (an unknown commit, a shallow clone without it)."""
    try:
        archive = _git("archive", "--format=tar", ref, "pdrouter")
    except subprocess.CalledProcessError as exc:
        raise SystemExit(f"cannot export pdrouter at {ref!r}: {exc.stderr.decode(errors='replace').strip()}") from None
    with tarfile.open(fileobj=BytesIO(archive)) as tar:
        tar.extractall(into, filter="data")
    return into


def tree_environment(tree: Path) -> dict[str, str]:
    """The variables that run ``python -m pdrouter`` from an exported tree."""
    # PYTHONSAFEPATH: `python -m` would put the working directory (the checkout) ahead of PYTHONPATH.
    return {"PYTHONPATH": str(tree), "PYTHONSAFEPATH": "1"}


def worker_command(role: str, model: Path, redis_url: str) -> list[str]:
    """``pdrouter prefill|decode``: a simulated worker answering at once, in flags that this tree's
    CLI and the older trees' all accept (``worker_args`` follows this tree's CLI alone)."""
    return [role, "--model", str(model), "--redis", redis_url, "--port", "0", "--log-level", "WARNING",
            "--backend", "sim", "--gpu", "h100", "--time-scale", "0", "--num-blocks", "4096",
            "--worker-id", f"{role}-0"]


@contextlib.contextmanager
def under_callgrind(tmp: Path, name: str) -> Iterator[Path]:
    """While open, ``pdrouter`` child processes (``ManagedProcess``) start under callgrind with its
    instrumentation off; yields the prefix of their dump files."""
    out = tmp / f"callgrind-{name}"
    wrapper = tmp / f"python-under-callgrind-{name}"
    wrapper.write_text(f"#!/bin/sh\nexec valgrind --tool=callgrind --instr-atstart=no --callgrind-out-file={out}.%p "
                       f"--log-file={out}.log {sys.executable} \"$@\"\n")
    wrapper.chmod(0o755)
    with mock.patch.object(sys, "executable", str(wrapper)):
        yield out


def callgrind(pid: int, *command: str) -> None:
    subprocess.run(["callgrind_control", *command, str(pid)], check=True, capture_output=True, timeout=120)


def dumped_instructions(prefix: Path, pid: int, dumps: int) -> int:
    """The instruction count (``summary``) of dump number ``dumps`` of process ``pid``."""
    text = Path(f"{prefix}.{pid}.{dumps}").read_text()
    for line in text.splitlines():
        if line.startswith("summary:"):
            return int(line.split()[1])
    raise RuntimeError(f"no summary line in {prefix}.{pid}.{dumps}")


async def run(args: object, report: Report) -> None:
    a = args
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    token = {INTERNAL_TOKEN_ENV: secrets.token_hex(16), "PDROUTER_KV_TOKEN": secrets.token_hex(16),
             "PDROUTER_KV_TOKEN_FILE": ""}
    baseline = a.baseline or default_baseline()  # type: ignore[attr-defined]
    tree = a.tree  # type: ignore[attr-defined]
    report.add("tracing_baseline", _git("rev-parse", "--short", baseline).decode().strip())
    if tree is not None:
        report.add("tracing_tree", _git("rev-parse", "--short", tree).decode().strip())
    with tempfile.TemporaryDirectory() as tmp, contextlib.ExitStack() as clusters, OtlpSink() as sink:
        # Each tree runs beside a Redis and workers of its own (the module docstring): "this" serves off and on.
        trees = {"this": {} if tree is None else tree_environment(export_tree(tree, Path(tmp) / "tree")),
                 "base": tree_environment(export_tree(baseline, Path(tmp) / "base"))}
        model = make_model("tiny", 0, Path(tmp) / "tiny")
        procs: list[ManagedProcess] = []
        try:
            redis_urls: dict[str, str] = {}
            for cluster, tree_env in trees.items():
                redis_urls[cluster] = clusters.enter_context(EmbeddedRedis()).url
                for role in ("prefill", "decode"):
                    proc = ManagedProcess(f"{role}-{cluster}", worker_command(role, model, redis_urls[cluster]),
                                          env={**env, **token, **tree_env})
                    procs.append(proc)
                    proc.wait_ready(120.0)
            routers: dict[str, ManagedProcess] = {}
            counted = a.instructions  # type: ignore[attr-defined]
            dumps: dict[str, Path] = {}
            variants: list[tuple[str, str, dict[str, str]]] = [("off", "this", {}), ("base", "base", {})]
            if not counted:  # tracing on runs five times slower under callgrind: its cost is measured in seconds
                variants.append(("on", "this", sink.environment("http/protobuf")))
            for name, cluster, extra_env in variants:
                with under_callgrind(Path(tmp), name) if counted else contextlib.nullcontext() as prefix:
                    proc = ManagedProcess(f"router-{name}", [
                        "router", "--model", str(model), "--redis", redis_urls[cluster], "--http-port", "0",
                        "--grpc-port", "0", "--local-prefill-tokens", "0", "--log-level", "WARNING"],
                        env={**env, **token, **trees[cluster], **extra_env,
                             **({"PYTHONHASHSEED": "0"} if counted else {})})
                if prefix is not None:
                    dumps[name] = prefix
                procs.append(proc)
                routers[name] = proc
            for proc in routers.values():
                proc.wait_ready(900.0 if counted else 120.0)
            await asyncio.sleep(1.5)  # every router has both workers in its pool
            ids = list(range(3, 3 + a.prompt_tokens))  # type: ignore[attr-defined]
            clients = {}
            for name, proc in routers.items():
                assert proc.address is not None
                host, port = proc.address.rsplit(":", 1)
                clients[name] = HttpCompletions(host, int(port), "tiny", ids, a.max_tokens, stream=False)  # type: ignore[attr-defined]
            concurrency, n = a.concurrency, a.requests  # type: ignore[attr-defined]

            async def phase(name: str, count: int, measured: bool = True) -> float:
                """CPU seconds (``--instructions``: instructions) per request of router ``name`` over
                ``count`` requests (``measured`` False: only sent, e.g. to warm it)."""
                left = count

                async def slot(i: int) -> None:
                    nonlocal left
                    while left > 0:
                        left -= 1
                        await clients[name].once(i)

                pid = routers[name].proc.pid
                if counted and not measured:
                    await slot(0)
                    return 0.0
                if not counted:
                    cpu0 = cpu_seconds(pid)
                    await asyncio.gather(*(slot(i) for i in range(concurrency)))
                    return (cpu_seconds(pid) - cpu0) / count
                raise AssertionError("--instructions counts both routers at once: paired()")

            async def paired(count: int) -> dict[str, float]:
                """``--instructions``: instructions per request of every router over ``count`` requests
                each, sent to them in turn one at a time (the same sequence every round), so that both
                run through the same moments of the machine's load; counted between a zero and a dump.
                Then as long idle, whose count (the routers' timers run by the wall clock: more of them
                per request when the load slows the router down) is taken off."""
                pids = {name: proc.proc.pid for name, proc in routers.items()}

                async def every(*command: str) -> None:
                    await asyncio.gather(*(asyncio.to_thread(callgrind, pid, *command) for pid in pids.values()))

                async def counted_while(work: Awaitable[None]) -> tuple[dict[str, int], float]:
                    await every("--zero")
                    start = time.monotonic()
                    await work
                    took = time.monotonic() - start
                    await every("--dump")
                    for name in dumped:
                        dumped[name] += 1
                    counts = {name: dumped_instructions(dumps[name], pid, dumped[name]) for name, pid in pids.items()}
                    return counts, took

                async def alternate() -> None:
                    for _ in range(count):
                        for name in clients:
                            await clients[name].once(0)

                await every("--instr=on")
                busy, busy_s = await counted_while(alternate())
                idle, idle_s = await counted_while(asyncio.sleep(min(busy_s, 10.0)))
                await every("--instr=off")
                return {name: (busy[name] - idle[name] * busy_s / idle_s) / count for name in pids}

            dumped = dict.fromkeys(routers, 0)

            for name in routers:  # warm every path (and the tracer's exporter) before measuring
                await phase(name, n // 2, measured=False)
            per_round: dict[str, list[float]] = {name: [] for name in routers}
            order = list(routers)
            for r in range(a.rounds):  # type: ignore[attr-defined]
                if counted:
                    for name, value in (await paired(n)).items():
                        per_round[name].append(value)
                    continue
                for name in (order if r % 2 == 0 else list(reversed(order))):
                    per_round[name].append(await phase(name, n))
            for client in clients.values():
                await client.close()
            await asyncio.sleep(0.5)
            traced = len({s.trace_id for s in sink.spans if s.service == "pdrouter-router"})
        finally:
            for proc in reversed(procs):
                proc.stop()
    counted = a.instructions  # type: ignore[attr-defined]
    for name, values in per_round.items():
        if counted:
            report.add(f"tracing_router_instructions_{name}", round(statistics.median(values)), "instructions/req")
        else:
            report.add(f"tracing_router_cpu_{name}_us", round(statistics.median(values) * 1e6, 1), "us/req")
    for key, num, den, unit in (("tracing_off_vs_base", "off", "base", "× (target ≤ 1.02)"),
                                *([] if counted else [("tracing_on_vs_off", "on", "off", "×")])):
        ratios = [x / y for x, y in zip(per_round[num], per_round[den], strict=True)]
        report.add(key, round(statistics.median(ratios), 4 if counted else 3), unit)
        report.add(f"{key}_spread", round(max(ratios) - min(ratios), 4), "(max − min of the rounds)")
        report.add(f"{key}_rounds", " ".join(f"{r:.4f}" for r in ratios))
    if not counted:
        report.add("tracing_traces_received", traced, "traces")


def main() -> None:
    parser = base_parser(__doc__ or "")
    parser.add_argument("--baseline", default=None, help="git ref of the tree to compare with")
    parser.add_argument("--tree", default=None,
                        help="git ref whose tree runs the off and on routers (default: this checkout)")
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--requests", type=int, default=None,
                        help="requests per router per round (default 1,500; --instructions: 300)")
    parser.add_argument("--rounds", type=int, default=None, help="rounds (default 8; --instructions: 4)")
    parser.add_argument("--prompt-tokens", type=int, default=13)
    parser.add_argument("--max-tokens", type=int, default=2)
    parser.add_argument("--instructions", action="store_true",
                        help="count the routers' instructions under callgrind instead of their CPU seconds "
                             "(robust to the machine's load)")
    args = parser.parse_args()
    if args.instructions and shutil.which("callgrind_control") is None:
        raise SystemExit("--instructions needs Valgrind (valgrind and callgrind_control on the PATH)")
    if args.requests is None:
        args.requests = 300 if args.instructions else 1500
    if args.rounds is None:
        args.rounds = 4 if args.instructions else 8
    if args.quick:
        args.requests, args.rounds = (40 if args.instructions else 300), 2
    report = Report()
    asyncio.run(run(args, report))
    report.emit(args.json)


if __name__ == "__main__":
    main()
