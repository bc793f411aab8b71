"""A simulated fleet on this machine: memory per worker, CPU headroom, and the time scale the router keeps up with.

Runs ``pdrouter up --backend sim --prefill N --decode M`` (Llama-3-8B on H100s: an embedded
Redis, the simulated workers and the router, each its own process) once per time scale in
``--scales``, and drives a steady closed-loop load through its OpenAI door (``--concurrency``
requests in flight, a ``--prompt-tokens`` prompt and ``--output-tokens`` tokens each, ignore_eos).
For each scale it reports, in simulated time (wall ÷ scale):

* ``tpot_ms_s<S>``: the mean time per output token measured at the door;
* ``tpot_model_ms_s<S>``: what the timing model says a decode step of that batch costs (the
  batch a decode worker holds when the load spreads evenly);
* ``tpot_ratio_s<S>``: measured ÷ modeled: near 1 when the simulated decode steps set the pace;
* ``ttft_ms_s<S>`` and ``e2e_ms_s<S>``: mean time to first token and per request (TTFT takes the
  router, the prefill, the KV transfer and any queueing: where a CPU-bound machine shows first);
* ``router_cpu_cores_s<S>`` and ``fleet_cpu_cores_s<S>``: cores the router and all workers used;
  ``cpu_headroom_cores_s<S>``: the machine's cores minus what the whole run used.

``router_keeps_up_from_scale``: the smallest scale whose simulated ``e2e_ms`` is within 15% of
the largest scale's (where the router's and the machine's own costs have shrunk the most).
``rss_mib_per_worker``: resident memory of one simulated worker process after the run (none of
them loads torch).

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

from pdrouter.bench.compare import Layout, bring_up
from pdrouter.core.gpu import get_gpu_preset
from pdrouter.core.model_spec import get_model_preset
from pdrouter.engine.model_folder import write_config_folder
from pdrouter.engine.sim.timing import SeqWork, TimingModel

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


def children(pid: int) -> list[int]:
    """The direct child processes of ``pid`` (Linux: every thread's ``children`` list)."""
    out: list[int] = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        with contextlib.suppress(OSError):
            out += [int(c) for c in (task / "children").read_text().split()]
    return out


@contextlib.contextmanager
def cluster(folder: Path, prefill: int, decode: int, scale: float) -> Iterator[tuple[str, int, int, list[int]]]:
    """``pdrouter up --backend sim``: (host, HTTP port, router pid, worker pids) once it is up."""
    layout = Layout(f"{prefill}p{decode}d", prefill=prefill, decode=decode)
    with bring_up(layout, folder, gpu=GPU, time_scale=scale) as running:
        procs = children(running.pid)
        argvs = {pid: Path(f"/proc/{pid}/cmdline").read_text().split("\0") for pid in procs}
        router = next(pid for pid, a in argvs.items() if a[3:4] == ["router"])  # python -m pdrouter router
        workers = [pid for pid, a in argvs.items() if "--backend" in a]
        host, port = running.url.split("//", 1)[1].split("/", 1)[0].rsplit(":", 1)
        yield host, int(port), router, workers


async def drive(client: HttpCompletions, concurrency: int, seconds: float) -> list[tuple[float, float]]:
    """Closed loop: ``concurrency`` slots send requests back to back for ``seconds``; (e2e, ttft) each."""
    results: list[tuple[float, float]] = []
    deadline = time.perf_counter() + seconds

    async def slot(i: int) -> None:
        while time.perf_counter() < deadline:
            results.append(await client.once(i))

    await asyncio.gather(*(slot(i) for i in range(concurrency)))
    return results


def tag(scale: float) -> str:
    return f"s{scale:g}"


async def measure(bench: argparse.Namespace, folder: Path, scale: float, report: Report,
                  timing: TimingModel) -> float:
    with cluster(folder, bench.prefill, bench.decode, scale) as (host, port, router, pids):
        ids = list(range(1000, 1000 + bench.prompt_tokens))
        client = HttpCompletions(host, port, folder.name, ids, bench.output_tokens, stream=True)
        try:
            await drive(client, min(bench.concurrency, 4), 2.0 * max(scale, 1.0) ** 0.5)  # warm up
            r0, f0, m0, t0 = (cpu_seconds(router), sum(cpu_seconds(p) for p in pids), machine_busy_s(),
                              time.perf_counter())
            results = await drive(client, bench.concurrency, bench.seconds)
            r1, f1, m1, t1 = (cpu_seconds(router), sum(cpu_seconds(p) for p in pids), machine_busy_s(),
                              time.perf_counter())
        finally:
            await client.close()
        rss = max(rss_mib(pid) for pid in pids)
        report.add(f"workers_seen_{tag(scale)}", len(pids), "processes")
    wall = t1 - t0
    tpot = sum((e2e - ttft) / (bench.output_tokens - 1) for e2e, ttft in results) / len(results) / scale
    batch = max(1, round(bench.concurrency / bench.decode))
    context = bench.prompt_tokens + bench.output_tokens // 2
    modeled = timing.step([SeqWork(1, context)] * batch).seconds
    t = tag(scale)
    report.add(f"requests_{t}", len(results), "requests")
    report.add(f"tpot_ms_{t}", tpot * 1e3, "ms")
    report.add(f"tpot_model_ms_{t}", modeled * 1e3, "ms")
    report.add(f"tpot_ratio_{t}", tpot / modeled, "x")
    ttft = sum(first for _, first in results) / len(results) / scale
    e2e = sum(total for total, _ in results) / len(results) / scale
    report.add(f"ttft_ms_{t}", ttft * 1e3, "ms")
    report.add(f"e2e_ms_{t}", e2e * 1e3, "ms")
    report.add(f"router_cpu_cores_{t}", (r1 - r0) / wall, "cores")
    report.add(f"fleet_cpu_cores_{t}", (f1 - f0) / wall, "cores")
    report.add(f"cpu_headroom_cores_{t}", (os.cpu_count() or 1) - (m1 - m0) / wall, "cores")
    report.add(f"rss_mib_per_worker_{t}", rss, "MiB")
    return e2e


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
    with tempfile.TemporaryDirectory(prefix="sim-fleet-") as tmp:
        folder = write_config_folder(spec, Path(tmp) / MODEL)
        e2e = {s: await measure(args, folder, s, report, timing) for s in scales}
    own = e2e[scales[-1]]
    keeps_up = next((s for s in scales if e2e[s] <= own * 1.15), scales[-1])
    report.add("router_keeps_up_from_scale", keeps_up, "x")
    report.add("rss_mib_per_worker", max(v for k, v, _ in report.figures if str(k).startswith("rss_mib")), "MiB")
    report.emit(args.json)


if __name__ == "__main__":
    asyncio.run(main_async())
