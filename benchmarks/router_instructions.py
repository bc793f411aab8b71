"""The router's instructions per request, this tree against another commit's, in one run.

The CPU seconds of ``router_peers.py`` move with whatever else the machine runs; instructions do
not. Two routers (this tree's, and ``--baseline``'s package exported with ``git archive`` and run
from it with ``PYTHONPATH``) share one Redis and one set of simulated workers from this tree
(``--time-scale 0``: they answer at once) in ``router_peers.py``'s layouts: ``pd``, two prefill and
two decode workers (disaggregated), or ``cache_aware``, four colocated workers. The workload is
``router_peers.py``'s: eight shared 2,000-character prefixes, a unique 200-character suffix, 16
tokens, non-streamed ``POST /v1/completions`` (each router its own prefixes and suffixes, so
neither finds the other's prompts cached).

Each router runs under Valgrind's callgrind, instrumentation off until measured (the method of
``tracing_overhead.py --instructions``, whose helpers it uses): per round, the counts are zeroed,
``--requests`` requests go to the routers in turn, one at a time (``--concurrency``: so many at
once), so that both go through the same moments of the machine's load, and each router's count
is dumped; then the routers are counted as long again idle and that count is taken off (their
timers run by the wall clock). Every thread of a router is counted; the kernel's work in their
system calls is not (``router_peers.py`` measures it with the rest, in CPU seconds). Reported
per layout: each router's median instructions per request, the ratio of the rounds' pairs (this
tree ÷ baseline) with its median and spread, and the Redis commands per request each router
sends (from ``INFO commandstats`` over a phase of its own, the workers' own commands included).

    python benchmarks/router_instructions.py [--quick] [--json] [--baseline REF] [--layouts pd,cache_aware]
                                             [--requests N] [--rounds N] [--concurrency N]
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import secrets
import shutil
import statistics
import tempfile
import time
from collections.abc import Awaitable
from pathlib import Path

import redis
from _load import HttpCompletions
from _report import Report, base_parser
from router_peers import TOKENS, prompts
from tracing_overhead import _git, callgrind, dumped_instructions, export_tree, under_callgrind

from pdrouter.cli.local_cluster import ManagedProcess, worker_args
from pdrouter.core.model_spec import get_model_preset
from pdrouter.engine.model_folder import write_config_folder
from pdrouter.state.embedded_redis import EmbeddedRedis
from pdrouter.wire.security import INTERNAL_TOKEN_ENV

ROOT = Path(__file__).resolve().parent.parent
LAYOUTS = {"pd": [("prefill", 2), ("decode", 2)], "cache_aware": [("worker", 4)]}
SIM = ["--gpu", "h100", "--tp", "1", "--time-scale", "0"]


async def once(client: HttpCompletions, conns: dict[int, object], slot: int = 0) -> None:
    """One request on ``slot``; a keep-alive connection the router closed meanwhile is opened again."""
    try:
        await client.once(slot)
    except (OSError, asyncio.IncompleteReadError):
        conns.pop(slot, None)
        await client.once(slot)


class Counter:
    """The routers' instruction counts under callgrind, between a zero and a dump."""

    def __init__(self, pids: dict[str, int], dumps: dict[str, Path]) -> None:
        self.pids, self.dumps = pids, dumps
        self.dumped = dict.fromkeys(pids, 0)

    async def control(self, *command: str) -> None:
        await asyncio.gather(*(asyncio.to_thread(callgrind, pid, *command) for pid in self.pids.values()))

    async def count(self, work: Awaitable[None]) -> tuple[dict[str, int], float]:
        """Each router's instructions while ``work`` runs, and the seconds it took."""
        await self.control("--zero")
        began = time.monotonic()
        await work
        seconds = time.monotonic() - began
        await self.control("--dump")
        out = {}
        for name, pid in self.pids.items():
            self.dumped[name] += 1
            out[name] = dumped_instructions(self.dumps[name], pid, self.dumped[name])
        return out, seconds

    async def per_request(self, work: Awaitable[None], requests: int) -> dict[str, float]:
        """Instructions per request of each router over ``work`` (``requests`` each), less what it
        does as long idle (its timers run by the wall clock)."""
        await self.control("--instr=on")
        busy, busy_s = await self.count(work)
        idle, idle_s = await self.count(asyncio.sleep(min(busy_s, 10.0)))
        await self.control("--instr=off")
        return {name: (busy[name] - idle[name] * busy_s / idle_s) / requests for name in self.pids}


def commands(client: redis.Redis) -> dict[str, int]:
    return {name.removeprefix("cmdstat_"): int(v["calls"]) for name, v in client.info("commandstats").items()}


async def run_layout(a: object, layout: str, base_tree: Path, model: Path, redis_url: str,
                     stats: redis.Redis, report: Report, tmp: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    token = {INTERNAL_TOKEN_ENV: secrets.token_hex(16), "PDROUTER_KV_TOKEN": secrets.token_hex(16),
             "PDROUTER_KV_TOKEN_FILE": ""}
    mode = "disaggregated" if layout == "pd" else "colocated"
    procs: list[ManagedProcess] = []
    try:
        for role, count in LAYOUTS[layout]:
            for i in range(count):
                proc = ManagedProcess(f"{role}-{i}", worker_args(
                    role, model, redis_url=redis_url, sim=SIM, extra=("--worker-id", f"{layout}-{role}-{i}")),
                    env={**env, **token})
                procs.append(proc)
                proc.wait_ready(120.0)
        routers: dict[str, ManagedProcess] = {}
        dumps: dict[str, Path] = {}
        for name, extra_env in (("this", {"PYTHONPATH": str(ROOT)}), ("base", {"PYTHONPATH": str(base_tree)})):
            with under_callgrind(tmp, f"{layout}-{name}") as prefix:
                proc = ManagedProcess(f"router-{name}", [
                    "router", "--model", str(model), "--redis", redis_url, "--mode", mode, "--http-port", "0",
                    "--grpc-port", "0", "--log-level", "WARNING"],
                    env={**env, **token, **extra_env, "PYTHONHASHSEED": "0"})
            dumps[name] = prefix
            procs.append(proc)
            routers[name] = proc
        for proc in routers.values():
            proc.wait_ready(900.0)
        await asyncio.sleep(1.5)  # every router has every worker in its pool
        clients: dict[str, HttpCompletions] = {}
        conns: dict[str, dict[int, object]] = {}
        for seed, (name, proc) in enumerate(routers.items()):
            assert proc.address is not None
            host, port = proc.address.rsplit(":", 1)
            conns[name] = {}
            clients[name] = HttpCompletions(host, int(port), model.name, [], TOKENS, False, prompts=prompts(seed),
                                            connections=conns[name])  # type: ignore[arg-type]
        counter = Counter({name: proc.proc.pid for name, proc in routers.items()}, dumps)
        concurrency = a.concurrency  # type: ignore[attr-defined]

        async def alternate(count: int) -> None:
            """``count`` requests to each router: ``concurrency`` at once to one, then to the next."""
            for _ in range(0, count, concurrency):
                for name, client in clients.items():
                    await asyncio.gather(*(once(client, conns[name], slot) for slot in range(concurrency)))

        n = a.requests  # type: ignore[attr-defined]
        for name, client in clients.items():  # warm every path; the Redis commands of each router alone
            for _ in range(n // 2):
                await once(client, conns[name])
            before = commands(stats)
            for _ in range(n):
                await once(client, conns[name])
            after = commands(stats)
            calls = {c: (after[c] - before.get(c, 0)) / n for c in after if after[c] > before.get(c, 0)}
            report.add(f"router_{layout}_redis_commands_{name}", round(sum(calls.values()), 2), "/req")
            report.add(f"router_{layout}_redis_by_command_{name}",
                       " ".join(f"{c}={v:.2f}" for c, v in sorted(calls.items(), key=lambda kv: -kv[1])))
        per_round: dict[str, list[float]] = {name: [] for name in routers}
        for _ in range(a.rounds):  # type: ignore[attr-defined]
            for name, value in (await counter.per_request(alternate(n), n)).items():
                per_round[name].append(value)
        for client in clients.values():
            await client.close()
    finally:
        for proc in reversed(procs):
            proc.stop()
    for name, values in per_round.items():
        report.add(f"router_{layout}_instructions_{name}", round(statistics.median(values)), "instructions/req")
    ratios = [x / y for x, y in zip(per_round["this"], per_round["base"], strict=True)]
    report.add(f"router_{layout}_this_vs_base", round(statistics.median(ratios), 4), "x")
    report.add(f"router_{layout}_this_vs_base_spread", round(max(ratios) - min(ratios), 4), "(max - min of the rounds)")


async def run(a: object, report: Report) -> None:
    baseline = a.baseline  # type: ignore[attr-defined]
    report.add("router_baseline", _git("rev-parse", "--short", baseline).decode().strip())
    with tempfile.TemporaryDirectory() as tmp_s, EmbeddedRedis() as server, contextlib.chdir(tmp_s):
        # The children start in the temporary directory: ``python -m`` puts the working directory
        # first on the path, and the routers must import the trees their PYTHONPATH names.
        tmp = Path(tmp_s)
        base_tree = export_tree(baseline, tmp / "base")
        model = tmp / "sim-llama-3-8b"
        write_config_folder(get_model_preset("llama-3-8b"), model)
        stats = redis.Redis(host=server.host, port=server.port)
        try:
            for layout in a.layouts.split(","):  # type: ignore[attr-defined]
                if layout not in LAYOUTS:
                    raise SystemExit(f"--layouts: unknown layout {layout!r}; choose from {', '.join(LAYOUTS)}")
                await run_layout(a, layout, base_tree, model, server.url, stats, report, tmp)
        finally:
            with contextlib.suppress(Exception):
                stats.close()


def main() -> None:
    parser = base_parser(__doc__.split("\n\n")[0])
    parser.add_argument("--baseline", default="main", help="the commit to compare with (default: main)")
    parser.add_argument("--layouts", default="pd,cache_aware", help="layouts, comma-separated (pd, cache_aware)")
    parser.add_argument("--requests", type=int, default=None, help="requests per router per round (default 200)")
    parser.add_argument("--rounds", type=int, default=None, help="rounds (default 4)")
    parser.add_argument("--concurrency", type=int, default=1,
                        help="requests sent to a router at once, each router in turn (default 1)")
    args = parser.parse_args()
    if shutil.which("callgrind_control") is None:
        raise SystemExit("this benchmark needs Valgrind (valgrind and callgrind_control on the PATH)")
    args.requests = args.requests or (20 if args.quick else 200)
    args.rounds = args.rounds or (2 if args.quick else 4)
    if args.quick:
        args.layouts = "pd"
    report = Report()
    asyncio.run(run(args, report))
    report.emit(args.json)


if __name__ == "__main__":
    main()
