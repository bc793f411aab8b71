"""Memory under sustained load: does any process of a cluster grow with the requests it serves?

Redis, the workers (a prefill and a decode worker, or one colocated worker: ``--mode``, both by
default, one after the other) and the router run as separate processes (as ``router_overhead.py``
starts them); this script sends short requests (a 13-token prompt, 2
tokens) through the router's OpenAI door at concurrency 32, in phases, and reads each process's
resident memory (``VmRSS``) after every phase. The first phase warms up (allocator pools, caches,
connections); the growth figures are the least-squares slope over the phases after it, in KiB per
thousand requests. A process that keeps something per request (a transfer, a callback, a
booking) grows by its size times the request rate for as long as it keeps it: one that held every
finished KV transfer until its deadline (ten minutes) grew ~4 MiB per thousand requests here.
Slopes of tens of KiB per thousand in a short run are the allocator settling and bounded caches
filling (a decode worker remembers the last 4,096 finished transfer ids, ~0.7 MiB); over 130k
requests the decode worker's slope was 0.9 KiB per thousand.

Figures per mode: ``<mode>_<process>_rss_mib`` after the last phase,
``<mode>_<process>_growth_kib_per_1k``, ``<mode>_requests`` served, ``<mode>_rps``.

    python benchmarks/memory_soak.py [--quick] [--json] [--mode disaggregated|colocated|both]
"""

from __future__ import annotations

import asyncio
import secrets
import tempfile
import time
from pathlib import Path

from _load import HttpCompletions
from _report import Report, base_parser

from pdrouter.cli.local_cluster import ManagedProcess, worker_args
from pdrouter.core.tokenizer import load_tokenizer
from pdrouter.engine.model_io import make_model
from pdrouter.state.embedded_redis import EmbeddedRedis
from pdrouter.wire.security import INTERNAL_TOKEN_ENV

MODEL = "tiny"
PROMPT = "The quick brown fox"
PHASES, PER_PHASE = 7, 5000
QUICK_PHASES, QUICK_PER_PHASE = 4, 1500


def rss_kib(pid: int) -> int:
    """Resident memory of ``pid`` (``VmRSS`` of ``/proc/<pid>/status``), in KiB."""
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    raise RuntimeError(f"no VmRSS for pid {pid}")


def slope(xs: list[float], ys: list[float]) -> float:
    """Least-squares slope of ``ys`` over ``xs``."""
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    den = sum((x - mx) ** 2 for x in xs)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / den if den else 0.0


async def send(client: HttpCompletions, n: int, concurrency: int = 32) -> None:
    left = n

    async def caller(slot: int) -> None:
        nonlocal left
        while left > 0:
            left -= 1
            await client.once(slot)

    await asyncio.gather(*(caller(i) for i in range(concurrency)))


async def soak(mode: str, model: Path, redis_url: str, ids: list[int], phases: int, per_phase: int,
               report: Report) -> None:
    """One cluster of ``mode``: workers, then the router; ``phases`` phases of ``per_phase`` requests."""
    roles = ("prefill", "decode") if mode == "disaggregated" else ("worker",)
    # The run's own secrets: the KV transfer's, and the one the router and the workers share.
    env = {"PDROUTER_KV_TOKEN": secrets.token_hex(16), INTERNAL_TOKEN_ENV: secrets.token_hex(16)}
    procs = {role: ManagedProcess(role, worker_args(role, model, redis_url=redis_url, num_blocks=2048,
                                                    torch_threads=1), env=env)
             for role in roles}
    try:
        for proc in procs.values():
            proc.wait_ready()
        # Started once the workers are registered, so its first look at the pool finds them.
        procs["router"] = ManagedProcess("router", [
            "router", "--model", str(model), "--redis", redis_url, "--mode", mode, "--http-port", "0",
            "--grpc-port", "0", "--local-prefill-tokens", "0", "--log-level", "WARNING"], env=env)
        procs["router"].wait_ready()
        assert procs["router"].address is not None
        host, port = procs["router"].address.rsplit(":", 1)
        client = HttpCompletions(host, int(port), MODEL, ids, 2, stream=False)
        served: list[float] = []
        rss: dict[str, list[float]] = {name: [] for name in procs}
        start = time.perf_counter()
        for phase in range(phases):
            await send(client, per_phase)
            if phase == 0:
                start = time.perf_counter()  # the warm-up phase is not timed or fitted
                continue
            served.append(phase * per_phase / 1000)
            for name, proc in procs.items():
                rss[name].append(rss_kib(proc.proc.pid))
        seconds = time.perf_counter() - start
        await client.close()
    finally:
        for proc in procs.values():
            proc.stop()
    report.add(f"{mode}_requests", phases * per_phase, "requests")
    report.add(f"{mode}_rps", (phases - 1) * per_phase / seconds, "req/s")
    for name, values in rss.items():
        report.add(f"{mode}_{name}_rss_mib", values[-1] / 1024, "MiB")
        report.add(f"{mode}_{name}_growth_kib_per_1k", slope(served, values), "KiB/1k req")


async def main_async() -> None:
    parser = base_parser(__doc__ or "")
    parser.add_argument("--mode", choices=["disaggregated", "colocated", "both"], default="both",
                        help="which cluster to soak")
    args = parser.parse_args()
    phases, per_phase = (QUICK_PHASES, QUICK_PER_PHASE) if args.quick else (PHASES, PER_PHASE)
    modes = ["disaggregated", "colocated"] if args.mode == "both" else [args.mode]
    report = Report()
    with tempfile.TemporaryDirectory(prefix="memory-soak-") as tmp, EmbeddedRedis() as redis:
        model = make_model(MODEL, 0, Path(tmp) / MODEL)
        ids = load_tokenizer(model).encode(PROMPT)
        for mode in modes:
            await soak(mode, model, redis.url, ids, phases, per_phase, report)
    report.emit(args.json)


if __name__ == "__main__":
    asyncio.run(main_async())
