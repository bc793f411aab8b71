"""A simulated fleet on this machine: memory per worker, CPU headroom, and the time scale the router keeps up with.

Starts an embedded Redis, ``--prefill`` + ``--decode`` simulated workers (Llama-3-8B geometry on
H100s, ``pdrouter prefill|decode --backend sim``) and a ``pdrouter router``, all as separate
processes, then drives a steady closed-loop load through the OpenAI door (``--concurrency``
requests in flight, a ``--prompt-tokens`` prompt and ``--output-tokens`` tokens each, ignore_eos)
once per time scale in ``--scales``. For each scale it reports, in simulated time (wall ÷ scale):

* ``tpot_ms_s<S>``: the mean time per output token measured at the door;
* ``tpot_model_ms_s<S>``: what the timing model says a decode step of that batch costs (the
  batch a decode worker holds when the load spreads evenly);
* ``tpot_ratio_s<S>``: measured ÷ modeled: near 1 when the simulated GPUs set the pace; well
  above 1 when the router, the transport or this machine's CPUs do;
* ``router_cpu_cores_s<S>`` and ``fleet_cpu_cores_s<S>``: cores the router and all workers used;
  ``cpu_headroom_cores_s<S>``: the machine's cores minus what the whole run used.

``router_keeps_up_from_scale``: the smallest scale whose ratio is within 15% of the largest
scale's (the fleet's own pace). ``rss_mib_per_worker``: resident memory of one simulated
worker process after the run (none of them loads torch).

    python benchmarks/sim_fleet.py [--quick] [--json] [--prefill N] [--decode M] [--scales 1,4,16]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

from _load import HttpCompletions, cpu_seconds
from _report import Report, base_parser

from pdrouter.cli.local_cluster import ManagedProcess, worker_args
from pdrouter.core.gpu import get_gpu_preset
from pdrouter.core.model_spec import get_model_preset
from pdrouter.engine.model_folder import write_config_folder
from pdrouter.engine.sim.timing import SeqWork, TimingModel
from pdrouter.state.embedded_redis import EmbeddedRedis

MODEL, GPU = "llama-3-8b", "h100"


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def machine_busy_s() -> float:
    """CPU seconds all cores spent busy since boot (``/proc/stat``: everything but idle and iowait)."""
    fields = [int(x) for x in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    return (sum(fields) - fields[3] - fields[4]) / os.sysconf("SC_CLK_TCK")


@contextlib.contextmanager
def fleet(folder: Path, redis_url: str, prefill: int, decode: int, scale: float) -> Iterator[list[ManagedProcess]]:
    sim = ["--gpu", GPU, "--time-scale", str(scale)]
    procs = [ManagedProcess(f"{role}-{i}", worker_args(role, folder, redis_url=redis_url, sim=sim,
                                                       extra=("--worker-id", f"{role}-{i}")))
             for role, n in (("prefill", prefill), ("decode", decode)) for i in range(n)]
    try:
        for p in procs:
            p.wait_ready()
        yield procs
    finally:
        for p in procs:
            p.stop()


async def drive(client: HttpCompletions, concurrency: int, seconds: float) -> list[tuple[float, float]]:
    """Closed loop: ``concurrency`` slots send requests back to back for ``seconds``; (e2e, ttft) each."""
    results: list[tuple[float, float]] = []
    deadline = time.perf_counter() + seconds

    async def slot(i: int) -> None:
        while time.perf_counter() < deadline:
            results.append(await client.once(i))

    await asyncio.gather(*(slot(i) for i in range(concurrency)))
    return results


async def measure(bench: argparse.Namespace, folder: Path, redis_url: str, scale: float, report: Report,
                  timing: TimingModel) -> float:
    with fleet(folder, redis_url, bench.prefill, bench.decode, scale) as procs:
        router = ManagedProcess("router", ["router", "--model", str(folder), "--redis", redis_url, "--http-port",
                                           "0", "--grpc-port", "0", "--log-level", "WARNING"])
        with router:
            host, _, port = router.wait_ready().rpartition(":")
            ids = list(range(1000, 1000 + bench.prompt_tokens))
            client = HttpCompletions(host, int(port), folder.name, ids, bench.output_tokens, stream=True)
            try:
                await drive(client, min(bench.concurrency, 4), 2.0 * max(scale, 1.0) ** 0.5)  # warm up
                pids = [p.proc.pid for p in procs]
                r0, f0, m0, t0 = (cpu_seconds(router.proc.pid), sum(cpu_seconds(p) for p in pids),
                                  machine_busy_s(), time.perf_counter())
                results = await drive(client, bench.concurrency, bench.seconds)
                r1, f1, m1, t1 = (cpu_seconds(router.proc.pid), sum(cpu_seconds(p) for p in pids),
                                  machine_busy_s(), time.perf_counter())
            finally:
                await client.close()
            rss = max(rss_mib(pid) for pid in pids)
    wall = t1 - t0
    tpot = sum((e2e - ttft) / (bench.output_tokens - 1) for e2e, ttft in results) / len(results) / scale
    batch = max(1, round(bench.concurrency / bench.decode))
    context = bench.prompt_tokens + bench.output_tokens // 2
    modeled = timing.step([SeqWork(1, context)] * batch).seconds
    tag = f"s{scale:g}"
    report.add(f"requests_{tag}", len(results), "requests")
    report.add(f"tpot_ms_{tag}", tpot * 1e3, "ms")
    report.add(f"tpot_model_ms_{tag}", modeled * 1e3, "ms")
    report.add(f"tpot_ratio_{tag}", tpot / modeled, "x")
    report.add(f"router_cpu_cores_{tag}", (r1 - r0) / wall, "cores")
    report.add(f"fleet_cpu_cores_{tag}", (f1 - f0) / wall, "cores")
    report.add(f"cpu_headroom_cores_{tag}", (os.cpu_count() or 1) - (m1 - m0) / wall, "cores")
    report.add(f"rss_mib_per_worker_{tag}", rss, "MiB")
    return tpot / modeled


async def main_async() -> None:
    parser = base_parser(__doc__ or "")
    parser.add_argument("--prefill", type=int, default=8)
    parser.add_argument("--decode", type=int, default=8)
    parser.add_argument("--scales", default="1,4,16", help="time scales to try, comma-separated")
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--prompt-tokens", type=int, default=512)
    parser.add_argument("--output-tokens", type=int, default=32)
    parser.add_argument("--seconds", type=float, default=8.0, help="measured load per time scale (wall)")
    args = parser.parse_args()
    if args.quick:
        args.prefill, args.decode, args.scales, args.seconds, args.concurrency = 2, 2, "4", 4.0, 8
    scales = sorted(float(s) for s in args.scales.split(","))
    spec, gpu = get_model_preset(MODEL), get_gpu_preset(GPU)
    timing = TimingModel(spec, gpu)
    report = Report()
    report.add("workers", args.prefill + args.decode, "processes")
    report.add("cpu_cores", os.cpu_count() or 1, "cores")
    with tempfile.TemporaryDirectory(prefix="sim-fleet-") as tmp, EmbeddedRedis() as redis_server:
        folder = write_config_folder(spec, Path(tmp) / MODEL)
        ratios = {s: await measure(args, folder, redis_server.url, s, report, timing) for s in scales}
    own = ratios[scales[-1]]
    keeps_up = next((s for s in scales if ratios[s] <= own * 1.15), scales[-1])
    report.add("router_keeps_up_from_scale", keeps_up, "x")
    report.add("rss_mib_per_worker", max(v for k, v, _ in report.figures if str(k).startswith("rss_mib")), "MiB")
    report.emit(args.json)


if __name__ == "__main__":
    asyncio.run(main_async())
