"""The simulator's dynamics against a real engine on this machine: one workload, one harness, both engines.

    python benchmarks/sim_dynamics.py [--quick] [--json] [--backend vllm|torch] [--layouts colocated,1p1d]
        [--rates 1,1.5,2,3] [--calibration FILE] [--write-calibration FILE] [--pin] [--mixed]

1. **Calibrate a CPU device preset** (unless ``--calibration`` gives one). One real worker behind the
   router answers probes: single prompts of several lengths with one output token (prefill against
   tokens: the TTFT), and bursts of concurrent requests at two prompt lengths (decode against batch
   and context: the median TPOT, which is the engine's step once every prompt of the burst is
   computed). Each less the harness's own share: the same probes through a simulated worker at time
   scale 0, which computes nothing (on two cores the router, the streaming and the client take turns
   with the engine rather than overlap it). The ``cpu`` GPU preset with a
   calibration fitted to these step times (``FITTED``: the matmuls' and the weights' efficiencies,
   the KV read's, and the fixed costs of a prefill step, of a decode step and per sequence) is the
   CPU preset, written with ``--write-calibration``.
2. **Compare.** For each layout (``colocated``: one colocated worker; ``1p1d``: a prefill and a decode
   worker with the engine's KV connector), the real cluster and a simulated one with that preset, the
   same scheduler limits and the same KV pool are both up, and every rate of ``--rates`` runs the
   same requests (fresh prompts every rate, the same arrival times) through one, then the other.
   Each point is scored over its measured window (``pdrouter.bench.window``, as ``pdrouter bench``
   does): TTFT, TPOT and E2E at p50 and p90, the output throughput, and whether it saturated (served
   under 90% of what its window was offered), and every CPU's busy share over its run. The first
   saturated rate of each is its saturation rate. With ``--mixed``, before the sweep, prompts of
   several sizes are sent while requests decode, through both engines (``mixed_p<size>_b<running>``).

The acceptance of the comparison: within 15% on TTFT and TPOT p50 and 20% on their p90 at three rates
below saturation, and the same saturation rate within one step of the sweep. Printed as ``name: value
unit`` lines (``--json``: one object): the probes (real, harness, model), the fitted fields, per layout
and rate every figure of both engines and the error, the saturation rates and the acceptance counts.
Timings are compared within one run only; the machine's load average is printed at the start and end.
``--pin`` puts the real engine's compute (vLLM's engine-core process; the torch engine's worker) on
CPU 1 and every other process of the run on CPU 0, so that the engine steps while the harness
streams, as a GPU does, instead of taking turns with it (in ``1p1d``, the decode engine on CPU 2
where the machine has it, else on CPU 0 beside the harness: two engines on one CPU would take
turns); it wants a machine with no other work.
``--quick`` runs few probes, two rates and short points (the machinery, not the figures; a vLLM
engine alone takes 40–150 s to start here).
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import os
import secrets
import signal
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _report import Report, base_parser
from sim_fidelity import _golden

from pdrouter.bench.runner import RunConfig, run
from pdrouter.bench.stats import Summary
from pdrouter.bench.window import measure_window, offered_rate, saturated, window_summary
from pdrouter.bench.workload import LengthDist, RequestSpec, Workload, synthetic
from pdrouter.cli.local_cluster import ManagedProcess, worker_args
from pdrouter.core.gpu import get_gpu_preset
from pdrouter.core.model_spec import ModelSpec
from pdrouter.engine.sim.calibration import Calibration
from pdrouter.engine.sim.timing import TimingModel
from pdrouter.state.embedded_redis import EmbeddedRedis
from pdrouter.wire.security import INTERNAL_TOKEN_ENV

DEVICE = "cpu"
"""The GPU preset the CPU preset calibrates: nominal 50 GB/s and 2 TFLOP/s, for the efficiencies to scale."""
BLOCK_SIZE = 32
"""vLLM's smallest CPU block, for every worker of both clusters."""
NUM_BLOCKS = 1024
"""Blocks each worker is given (vLLM keeps one of them off every request, so a simulated worker gets one
fewer): 32,736 tokens, room for the probes' and the sweep's batches."""



@dataclass(frozen=True)
class Limits:
    """The scheduler's limits, the same for the real and the simulated workers (a prompt longer than
    the token budget is prefilled in chunks)."""

    max_num_seqs: int = 128
    max_batched_tokens: int = 2048
    """vLLM 0.32's own defaults on the CPU."""


LIMITS = Limits()

MAX_MODEL_LEN = 2048
FITTED = ("mfu", "mbu", "kv_mbu", "step_overhead_s", "decode_step_overhead_s", "per_seq_overhead_s")
BOUNDS = {"mfu": (1e-4, 1.0), "mbu": (1e-3, 1.0), "kv_mbu": (1e-4, 1.0), "step_overhead_s": (0.0, 0.2),
          "decode_step_overhead_s": (0.0, 0.2), "per_seq_overhead_s": (0.0, 0.02)}
SHORT_CONTEXT, LONG_CONTEXT = 32, 768
"""The decode probes' prompt lengths."""
DECODE_TOKENS = 48
"""The decode probes' output: the default workload's median, so that a probe's TPOT spreads what a
request's first decode steps cost beyond the rest (vLLM's are uneven) over as many tokens as the
sweep's requests do."""
DECODE_SAMPLES = 6
"""At least this many TPOTs per decode probe: a burst of one request gives one."""
P50_TARGET, P90_TARGET = 15.0, 20.0
"""The acceptance bounds, in percent of the real engine's figure."""


# -- clusters -----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Layout:
    """``colocated`` (``workers`` colocated workers) or ``1p1d`` (a prefill and a decode worker)."""

    name: str
    workers: int = 1

    @property
    def roles(self) -> list[str]:
        return ["worker"] * self.workers if self.name == "colocated" else ["prefill", "decode"]

    @property
    def mode(self) -> str:
        return "colocated" if self.name == "colocated" else "disaggregated"


def real_engine(backend: str) -> list[str]:
    """A real worker's engine arguments (the scheduler limits and pool are added by :func:`cluster`)."""
    if backend == "vllm":
        return ["--backend", "vllm", "--vllm-arg", f"max_model_len={MAX_MODEL_LEN}"]
    return ["--backend", "torch"]


SIM_LINK = "tcp-25g"
"""The simulated KV link of a 1P1D layout: the real workers' KV crosses this machine's loopback."""


def sim_engine(calibration: Path | None, time_scale: float) -> list[str]:
    """A simulated worker on the CPU preset (``calibration``; None at time scale 0, where it does not count)."""
    args = ["--backend", "sim", "--gpu", DEVICE, "--time-scale", f"{time_scale:g}", "--link", SIM_LINK]
    return [*args, "--calibration", str(calibration)] if calibration is not None else args


@dataclass
class Cluster:
    """Redis, the layout's workers and a router, started as child processes."""

    url: str
    """The router's OpenAI base URL."""
    procs: list[ManagedProcess] = field(default_factory=list)
    real: bool = True
    """Its workers run a real engine (not simulated)."""


ENGINE_CPU = 1
"""With ``--pin``: the CPU a real engine's compute runs on; everything else runs on CPU 0."""
DECODE_CPU = 2
"""With ``--pin``, in ``1p1d``: the CPU the real decode engine runs on, where the machine has it."""


def _descendants(pid: int) -> list[int]:
    """``pid`` and every process below it (from ``/proc``; processes gone meanwhile are skipped)."""
    out, todo = [], [pid]
    while todo:
        current = todo.pop()
        out.append(current)
        with contextlib.suppress(OSError):
            for task in os.listdir(f"/proc/{current}/task"):
                with open(f"/proc/{current}/task/{task}/children") as f:
                    todo += [int(c) for c in f.read().split()]
    return out


def _pin_process(pid: int, cpu: int) -> None:
    """Every thread of ``pid`` onto ``cpu`` (``sched_setaffinity`` moves one thread at a time)."""
    with contextlib.suppress(OSError):
        for task in os.listdir(f"/proc/{pid}/task"):
            with contextlib.suppress(OSError):
                os.sched_setaffinity(int(task), {cpu})


def _is_engine(pid: int, backend_process: bool) -> bool:
    """Whether ``pid`` computes a real engine's steps: vLLM's engine-core process (its title starts
    ``VLLM::``), or the worker itself for the torch engine, which steps in the worker's process."""
    try:
        with open(f"/proc/{pid}/comm") as f:
            comm = f.read().strip()
    except OSError:
        return False
    return comm.startswith("VLLM::") or backend_process


def pin(clusters: Sequence[Cluster], backend: str) -> None:
    """The real engines' compute on ``ENGINE_CPU``, everything else (router, Redis, the workers' serving,
    simulated workers, this process) on CPU 0: the engine then steps while the harness streams, as on
    a GPU, instead of taking turns with it on the same cores.

    A 1P1D cluster's prefill engine runs on ``ENGINE_CPU`` and its decode engine on ``DECODE_CPU``
    where this process may use it, else on CPU 0 beside the harness: two engines on one CPU would take
    turns, where the simulated pair are two devices."""
    for pid in _descendants(os.getpid()):  # this process, Redis and every cluster's processes
        _pin_process(pid, 0)
    for c in clusters:
        for proc in c.procs if c.real else ():
            if proc.name != "router":
                cpu = ENGINE_CPU
                if proc.name.startswith("decode"):
                    cpu = DECODE_CPU if DECODE_CPU in os.sched_getaffinity(0) else 0
                for pid in _descendants(proc.proc.pid):
                    if _is_engine(pid, backend == "torch" and pid == proc.proc.pid):
                        _pin_process(pid, cpu)


@contextlib.contextmanager
def cluster(model: Path, layout: Layout, engine: Sequence[str], *, limits: Limits = LIMITS,
            num_blocks: int = NUM_BLOCKS, start_s: float = 600.0) -> Iterator[Cluster]:
    """The layout's workers with ``engine`` (``real_engine`` / ``sim_engine``) and a router, every worker
    with the same block size, pool, scheduler limits and one torch thread, until the block ends."""
    simulated = "sim" in engine
    blocks = num_blocks - 1 if simulated else num_blocks  # vLLM keeps one block off every request
    env = {INTERNAL_TOKEN_ENV: secrets.token_hex(16), "PDROUTER_KV_TOKEN": secrets.token_hex(16)}
    redis = EmbeddedRedis()
    redis.start()
    procs: list[ManagedProcess] = []
    try:
        for i, role in enumerate(layout.roles):
            procs.append(ManagedProcess(f"{role}-{i}", worker_args(
                role, model, redis_url=redis.url, num_blocks=blocks, torch_threads=None if simulated else 1,
                extra=(*engine, "--worker-id", f"{role}-{i}", "--block-size", str(BLOCK_SIZE), "--max-num-seqs",
                       str(limits.max_num_seqs), "--max-batched-tokens", str(limits.max_batched_tokens))), env=env))
        for proc in procs:
            proc.wait_ready(start_s)
        router = ManagedProcess("router", [
            "router", "--model", str(model), "--redis", redis.url, "--mode", layout.mode, "--block-size",
            str(BLOCK_SIZE), "--http-port", "0", "--grpc-port", "0", "--log-level", "WARNING"], env=env)
        procs.append(router)
        yield Cluster(f"http://{router.wait_ready()}/v1", procs, real=not simulated)
    finally:
        for proc in reversed(procs):
            proc.stop(60.0)
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.proc.pid, signal.SIGKILL)  # what vLLM's engine processes left of that session
        redis.stop()


async def wait_serving(url: str, model: str, timeout_s: float = 120.0) -> None:
    """Until one short request completes (a router serves before its workers' registry reached it)."""
    deadline = time.monotonic() + timeout_s
    spec = [RequestSpec(0, (40, 41, 42, 43), 2)]
    while True:
        result = await run(RunConfig(base_url=url, model=model, concurrency=1, timeout_s=30.0), spec)
        if all(r.ok for r in result.records):
            return
        if time.monotonic() > deadline:
            raise RuntimeError(f"{url} serves no request: {result.records[0].error} {result.records[0].detail}")
        await asyncio.sleep(1.0)


# -- the probes and the fit ------------------------------------------------------------------------


@dataclass(frozen=True)
class Probe:
    """A prefill of ``size`` tokens alone, or decode steps of ``size`` sequences at ``context`` tokens."""

    kind: str
    size: int
    context: int = 0

    @property
    def name(self) -> str:
        return f"prefill_{self.size}" if self.kind == "prefill" else f"decode_b{self.size}_c{self.context}"


def probes(quick: bool) -> list[Probe]:
    prefills = (16, 512) if quick else (16, 128, 384, 768, 1536)
    batches = (1, 8) if quick else (1, 4, 12, 32)  # at most the token budget's worth of short prompts
    contexts = (SHORT_CONTEXT,) if quick else (SHORT_CONTEXT, LONG_CONTEXT)
    return ([Probe("prefill", n) for n in prefills]
            + [Probe("decode", b, c) for c in contexts for b in batches])


class Prompts:
    """Fresh prompts for every probe and point of one run (a prompt seen before would be a prefix hit)."""

    def __init__(self, seed: int) -> None:
        self.seed = seed
        self.point = 0

    def take(self, n: int, input_len: LengthDist, output_len: LengthDist) -> list[RequestSpec]:
        self.point += 1
        return synthetic(n, input_len, output_len, seed=self.seed, point=self.point)


def _records_ok(records: Sequence[Any], what: str) -> None:
    failed = [r for r in records if not r.ok]
    if failed:
        raise RuntimeError(f"{what}: {len(failed)} of {len(records)} requests failed (first: {failed[0].error} "
                           f"{failed[0].detail})")


async def sample(url: str, model: str, probe: Probe, prompts: Prompts, workers: int = 1,
                 limits: Limits = LIMITS) -> list[float]:
    """One sample of ``probe``, in seconds: a prefill's TTFT (one request alone), or the TPOTs of a
    burst of ``size`` requests per worker (the router spreads them).

    A burst's prompts are computed in its first step, so its TPOTs are decode steps of ``size``
    sequences alone: the short prompts fit the token budget together, and the long ones are sent
    once beforehand (one output token), so that the burst finds all but their last token in the
    prefix cache. (TPOT, not the gaps between chunks: under load a worker may stream the tokens of
    two steps in one chunk.)"""
    if probe.kind == "prefill":
        specs = prompts.take(1, LengthDist("fixed", probe.size), LengthDist("fixed", 1))
        result = await run(RunConfig(base_url=url, model=model, concurrency=1), specs)
        _records_ok(result.records, probe.name)
        return [r.ttft_s for r in result.records if r.ttft_s is not None]
    n = probe.size * workers
    specs = prompts.take(n, LengthDist("fixed", probe.context), LengthDist("fixed", DECODE_TOKENS))
    if probe.context * n > limits.max_batched_tokens:
        primed = [RequestSpec(s.index, s.prompt, 1) for s in specs]
        _records_ok((await run(RunConfig(base_url=url, model=model, concurrency=1), primed)).records,
                    f"{probe.name} (priming)")
    result = await run(RunConfig(base_url=url, model=model, concurrency=n), specs)
    _records_ok(result.records, probe.name)
    return [t for r in result.records if (t := r.tpot_s) is not None]


async def measure(url: str, model: str, plan: Sequence[Probe], prompts: Prompts, reps: int, workers: int = 1,
                  limits: Limits = LIMITS) -> dict[str, float]:
    """Each probe's median over ``reps`` prefills, or over ``reps // 3`` decode bursts (more for small
    bursts, for ``DECODE_SAMPLES`` TPOTs at least), taken in rounds of the whole plan: a spell of other
    load on the machine then lands on every shape alike, instead of on all the samples of one shape
    (where it could double that shape's median against the others)."""
    rounds: dict[str, set[int]] = {}
    for p in plan:
        bursts = reps if p.kind == "prefill" else \
            min(reps, max(1, reps // 3, math.ceil(DECODE_SAMPLES / (p.size * workers))))
        rounds[p.name] = {i * reps // bursts for i in range(bursts)}
    samples: dict[str, list[float]] = {p.name: [] for p in plan}
    for i in range(reps):
        for p in plan:
            if i in rounds[p.name]:
                samples[p.name] += await sample(url, model, p, prompts, workers, limits)
    return {name: statistics.median(values) for name, values in samples.items()}


def modeled(spec: ModelSpec, cal: Calibration, probe: Probe, limits: Limits = LIMITS) -> float:
    """The timing model's seconds for ``probe``: its prefill steps, or one decode step."""
    model = TimingModel(spec, get_gpu_preset(DEVICE), calibration=cal)
    if probe.kind == "prefill":  # chunked as the scheduler would
        done, seconds = 0, 0.0
        while done < probe.size:
            chunk = min(limits.max_batched_tokens, probe.size - done)
            seconds += model.step([_work(chunk, done, done + chunk == probe.size)]).seconds
            done += chunk
        return seconds
    return model.decode_step(probe.size, probe.context + DECODE_TOKENS // 2).seconds


def _work(tokens: int, context: int, samples: bool) -> Any:
    from pdrouter.engine.sim.timing import SeqWork

    return SeqWork(tokens, context, samples)


def start_calibration(limits: Limits = LIMITS) -> Calibration:
    """The fit's starting point: per-step fixed costs only (no per-layer ones: the fit cannot tell
    them apart on one model), decode-only steps with fixed costs of their own (the timing model's
    "graph" steps, whatever the engine does), attention at the matmuls' efficiency."""
    return Calibration.preset("torch-eager").with_overrides(
        layer_overhead_s=0.0, decode_layer_overhead_s=0.0, fp8_layer_overhead_s=0.0, step_overhead_s=5e-3,
        decode_step_overhead_s=5e-3, per_seq_overhead_s=1e-4, mfu=0.05, mbu=0.3, kv_mbu=0.1,
        attention_mfu=0.05, graph_max_batch=limits.max_num_seqs)


HARNESS_MAX_SHARE = 0.8
"""A probe the harness seems to take more of than this (the machine's other load landed on the
harness's run, or left the real one) says nothing of the engine: ``engine_times`` leaves it out."""


def engine_times(plan: Sequence[Probe], measured: dict[str, float], harness: dict[str, float]) -> dict[str, float]:
    """Every probe less the harness's share: on two cores the router, the worker's streaming and the
    client do not overlap with the engine's steps, they take turns with them (a burst of 8 decodes
    streams 8 tokens a step through three processes), and a simulated worker pays them again.

    A probe whose rest is under ``1 − HARNESS_MAX_SHARE`` of it is 0, which ``fit_cpu`` skips: kept
    at a sliver of a millisecond, it pulled the log-scale fit to a preset of no fixed cost at full
    efficiency, the other probes modeled an order of magnitude too fast."""
    return {p.name: rest if (rest := measured[p.name] - harness[p.name]) > (1 - HARNESS_MAX_SHARE) * measured[p.name]
            else 0.0 for p in plan}


def fit_cpu(spec: ModelSpec, engine_s: dict[str, float], plan: Sequence[Probe],
            limits: Limits = LIMITS) -> Calibration:
    """``FITTED`` by coordinate descent on the squared log errors over ``plan`` (the attention's
    efficiency follows the matmuls')."""
    cal = start_calibration(limits)
    shapes = [p for p in plan if engine_s.get(p.name, 0) > 0]

    def loss(c: Calibration) -> float:
        return sum(math.log(modeled(spec, c, p, limits) / engine_s[p.name]) ** 2 for p in shapes)

    def with_field(c: Calibration, name: str, x: float) -> Calibration:
        extra = {"attention_mfu": x} if name == "mfu" else {}
        return c.with_overrides(**{name: x}, **extra)

    for _ in range(8):
        for name in FITTED:
            lo, hi = BOUNDS[name]
            base = cal

            def at(x: float, name: str = name, base: Calibration = base) -> float:
                return loss(with_field(base, name, x))

            best = _golden(at, lo, hi)
            if at(best) < loss(cal):
                cal = with_field(cal, name, best)
    return cal


def write_calibration(cal: Calibration, path: Path, header: str) -> None:
    """The preset as YAML on top of ``torch-eager`` (every field the fit set), ``header`` as its comment."""
    fields = (*FITTED, "attention_mfu", "layer_overhead_s", "decode_layer_overhead_s", "fp8_layer_overhead_s",
              "graph_max_batch")
    lines = [f"# {line}".rstrip() for line in header.splitlines()] + ["preset: torch-eager"]
    for name in fields:
        value = getattr(cal, name)
        lines.append(f"{name}: {value if isinstance(value, int) else float(f'{value:.4g}')}")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines) + "\n")


# -- mixed steps ---------------------------------------------------------------------------------------
MIXED_PREFILLS = (64, 256, 768)
MIXED_BATCHES = (0, 4, 16)
MIXED_DECODE_TOKENS = 300
"""The running requests' output: long enough to outlast the prefills sent beside them."""


async def mixed_ttft(url: str, model: str, prompts: Prompts, size: int, running: int, reps: int = 3) -> float:
    """The median TTFT of a prompt of ``size`` tokens (one output token) sent while ``running``
    requests decode: on vLLM and on the simulator alike its prefill shares steps with their decodes.
    Sent one at a time, after the running requests' prompts are computed."""
    background = None
    if running:
        specs = prompts.take(running, LengthDist("fixed", SHORT_CONTEXT), LengthDist("fixed", MIXED_DECODE_TOKENS))
        background = asyncio.create_task(run(RunConfig(base_url=url, model=model, concurrency=running), specs))
        await asyncio.sleep(1.5)
    ttfts: list[float] = []
    try:
        for _ in range(reps):
            ttfts += await sample(url, model, Probe("prefill", size), prompts)  # one prompt, its TTFT
            await asyncio.sleep(0.3)
        if background is not None:
            _records_ok((await background).records, f"mixed_p{size}_b{running} (running)")
    finally:
        if background is not None and not background.done():
            background.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await background
    return statistics.median(ttfts) if ttfts else math.nan


async def mixed_steps(real_url: str, sim_url: str, model: str, prompts: Prompts) -> dict[str, tuple[float, float]]:
    """Per (prompt size, running decodes), the TTFT on the real engine and on the simulator."""
    out: dict[str, tuple[float, float]] = {}
    for size in MIXED_PREFILLS:
        for running in MIXED_BATCHES:
            real = await mixed_ttft(real_url, model, prompts, size, running)
            sim = await mixed_ttft(sim_url, model, prompts, size, running)
            out[f"mixed_p{size}_b{running}"] = (real, sim)
            print(f"sim_dynamics: a {size}-token prompt beside {running} decodes: TTFT {real * 1e3:.1f} ms real, "
                  f"{sim * 1e3:.1f} ms simulated", file=sys.stderr, flush=True)
    return out


def report_mixed(report: Report, mixed: dict[str, tuple[float, float]]) -> None:
    for key, (real, sim) in mixed.items():
        report.add(f"{key}_ttft_real", real * 1e3, "ms")
        report.add(f"{key}_ttft_sim", sim * 1e3, "ms")
        report.add(f"{key}_ttft_error", error_percent(real, sim), "%")


# -- the comparison --------------------------------------------------------------------------------


def cpu_jiffies() -> dict[int, tuple[int, int]]:
    """Per CPU, (busy, total) jiffies since boot, from ``/proc/stat`` (empty where there is none)."""
    out: dict[int, tuple[int, int]] = {}
    with contextlib.suppress(OSError), open("/proc/stat") as f:
        for line in f:
            name, *fields = line.split()
            if name.startswith("cpu") and name[3:].isdigit():
                ticks = [int(x) for x in fields[:8]]
                idle = ticks[3] + ticks[4]  # idle + iowait
                out[int(name[3:])] = (sum(ticks) - idle, sum(ticks))
    return out


def busy_shares(before: dict[int, tuple[int, int]], after: dict[int, tuple[int, int]]) -> dict[int, float]:
    """Per CPU, the share of the time between the two readings it was busy (0–1)."""
    return {cpu: (after[cpu][0] - b[0]) / (after[cpu][1] - b[1])
            for cpu, b in before.items() if cpu in after and after[cpu][1] > b[1]}


@dataclass
class Point:
    """One rate through one cluster, scored over its measured window."""

    rate: float
    summary: Summary
    offered: float
    saturated: bool
    steady: bool
    failed: int
    busy: dict[int, float] = field(default_factory=dict)
    """Per CPU, the share of the point's run it was busy (with ``--pin``, CPU 0 is the harness's, CPU 1
    the real engine's): a harness core near 1 queues the requests before and after the engine."""

    def figure(self, metric: str, q: str) -> float:
        return float(getattr(getattr(self.summary, metric), q))


async def run_point(url: str, model: str, specs: list[RequestSpec], rate: float, seed: int) -> Point:
    before = cpu_jiffies()
    result = await run(RunConfig(base_url=url, model=model, rate=rate, seed=seed, timeout_s=300.0), specs)
    busy = busy_shares(before, cpu_jiffies())
    records = result.records
    window = measure_window(records)
    steady = window_summary(records, window)
    offered = offered_rate(records, window)
    return Point(rate, steady, offered, saturated(steady, offered), window.steady,
                 sum(not r.ok for r in records), busy)


def saturation_rate(points: Sequence[Point]) -> float | None:
    """The first rate whose window saturated; None when none did."""
    return next((p.rate for p in sorted(points, key=lambda p: p.rate) if p.saturated), None)


def error_percent(real: float, sim: float) -> float:
    return 100.0 * (sim - real) / real if real > 0 else math.nan


@dataclass
class Verdict:
    """The acceptance of one layout's comparison."""

    rates_within: list[float]
    """Rates below both saturations where TTFT and TPOT were within the bounds at p50 and p90."""
    rates_below: list[float]
    """Rates below both saturations."""
    saturation_real: float | None
    saturation_sim: float | None
    saturation_steps_apart: int | None

    @property
    def holds(self) -> bool:
        return len(self.rates_within) >= 3 and self.saturation_steps_apart is not None and \
            self.saturation_steps_apart <= 1


def verdict(rates: Sequence[float], real: dict[float, Point], sim: dict[float, Point]) -> Verdict:
    sat_r, sat_s = saturation_rate(list(real.values())), saturation_rate(list(sim.values()))
    index = {r: i for i, r in enumerate(sorted(rates))}
    beyond = len(rates)  # "above the sweep" counts as one step past its last rate
    apart = abs(index.get(sat_r, beyond) - index.get(sat_s, beyond)) if sat_r or sat_s else 0  # type: ignore[arg-type]
    below = [r for r in sorted(rates) if (sat_r is None or r < sat_r) and (sat_s is None or r < sat_s)]
    within = []
    for r in below:
        ok = all(abs(error_percent(real[r].figure(m, q), sim[r].figure(m, q))) <= bound
                 for m in ("ttft", "tpot") for q, bound in (("p50", P50_TARGET), ("p90", P90_TARGET)))
        if ok:
            within.append(r)
    return Verdict(within, below, sat_r, sat_s, apart)


async def sweep(real_url: str, sim_url: str, model: str, rates: Sequence[float], workload: Workload,
                duration_s: float, min_requests: int, prompts: Prompts,
                progress: bool = True) -> tuple[dict[float, Point], dict[float, Point]]:
    """Each rate through the real cluster, then the same requests at the same arrival times through
    the simulated one."""
    real: dict[float, Point] = {}
    sim: dict[float, Point] = {}
    for i, rate in enumerate(rates):
        n = max(min_requests, math.ceil(rate * duration_s))
        specs = prompts.take(n, workload.input_len, workload.output_len)
        for name, url, into in (("real", real_url, real), ("sim", sim_url, sim)):
            started = time.monotonic()
            into[rate] = point = await run_point(url, model, specs, rate, seed=1000 + i)
            if progress:
                print(f"sim_dynamics: {name} @ {rate:g} req/s: {n} requests in {time.monotonic() - started:.0f} s, "
                      f"TTFT p50 {point.figure('ttft', 'p50') * 1e3:.1f} ms, TPOT p50 "
                      f"{point.figure('tpot', 'p50') * 1e3:.1f} ms, served {point.summary.request_rate:.3g} of "
                      f"{point.offered:.3g} req/s{' (saturated)' if point.saturated else ''}, CPUs busy "
                      f"{', '.join(f'{100 * b:.0f}%' for _, b in sorted(point.busy.items()))}",
                      file=sys.stderr, flush=True)
    return real, sim


def report_layout(report: Report, layout: str, rates: Sequence[float], real: dict[float, Point],
                  sim: dict[float, Point]) -> Verdict:
    for rate in rates:
        r, s = real[rate], sim[rate]
        key = f"{layout}_rate_{rate:g}"
        for metric in ("ttft", "tpot", "e2e"):
            for q in ("p50", "p90"):
                a, b = r.figure(metric, q), s.figure(metric, q)
                report.add(f"{key}_{metric}_{q}_real", a * 1e3, "ms")
                report.add(f"{key}_{metric}_{q}_sim", b * 1e3, "ms")
                report.add(f"{key}_{metric}_{q}_error", error_percent(a, b), "%")
        report.add(f"{key}_throughput_real", r.summary.output_tokens_per_s, "tok/s")
        report.add(f"{key}_throughput_sim", s.summary.output_tokens_per_s, "tok/s")
        report.add(f"{key}_served_real", r.summary.request_rate, "req/s")
        report.add(f"{key}_served_sim", s.summary.request_rate, "req/s")
        report.add(f"{key}_offered", r.offered, "req/s")
        report.add(f"{key}_saturated_real", int(r.saturated))
        report.add(f"{key}_saturated_sim", int(s.saturated))
        report.add(f"{key}_steady_real", int(r.steady))
        report.add(f"{key}_steady_sim", int(s.steady))
        report.add(f"{key}_failed_real", r.failed, "requests")
        report.add(f"{key}_failed_sim", s.failed, "requests")
        for name, point in (("real", r), ("sim", s)):
            for cpu, share in sorted(point.busy.items()):
                report.add(f"{key}_cpu{cpu}_busy_{name}", 100.0 * share, "%")
    v = verdict(rates, real, sim)
    report.add(f"{layout}_saturation_rate_real", v.saturation_real if v.saturation_real else math.nan, "req/s")
    report.add(f"{layout}_saturation_rate_sim", v.saturation_sim if v.saturation_sim else math.nan, "req/s")
    report.add(f"{layout}_saturation_steps_apart", v.saturation_steps_apart if v.saturation_steps_apart is not None
               else math.nan, "steps")
    report.add(f"{layout}_rates_below_saturation", len(v.rates_below), "rates")
    report.add(f"{layout}_rates_within_bounds", len(v.rates_within), "rates")
    report.add(f"{layout}_acceptance", int(v.holds))
    return v


# -- the benchmark --------------------------------------------------------------------------------


def make_folder(backend: str, out: Path) -> Path:
    from pdrouter.engine.model_io import make_model

    if backend == "vllm":  # vLLM's CPU attention takes the small model's head size (64), in bfloat16
        return make_model("small", 0, out / "small", dtype="bfloat16")
    return make_model("tiny", 0, out / "tiny")


def calibrate(args: Any, folder: Path, report: Report) -> Path:
    """Probe one real colocated worker and the harness, fit the CPU preset, write it; its path."""
    spec = ModelSpec.from_pretrained_dir(folder)
    plan = probes(args.quick)
    reps = 3 if args.quick else 7
    prompts = Prompts(seed=1)
    layout = Layout("colocated")
    with cluster(folder, layout, sim_engine(None, 0.0)) as free:
        if args.pin:
            pin([free], args.backend)
        asyncio.run(wait_serving(free.url, folder.name))
        harness = asyncio.run(measure(free.url, folder.name, plan, prompts, reps))
    with cluster(folder, layout, real_engine(args.backend)) as real:
        if args.pin:
            pin([real], args.backend)
        asyncio.run(wait_serving(real.url, folder.name))
        measured = asyncio.run(measure(real.url, folder.name, plan, prompts, reps))
    engine = engine_times(plan, measured, harness)
    if not any(engine.values()):
        raise SystemExit("every probe took the harness as long as the engine: the machine is too busy to calibrate")
    cal = fit_cpu(spec, engine, plan)
    path = args.write_calibration or Path(tempfile.mkdtemp(prefix="sim-dynamics-")) / "cpu.yaml"
    write_calibration(cal, path, f"A CPU device preset for the simulator (--gpu {DEVICE} --calibration {path.name}),\n"
                      f"fitted by benchmarks/sim_dynamics.py --backend {args.backend} to the step times of\n"
                      f"{args.backend} serving the {spec.name} model ({spec.dtype}) on a 2-core CPU, one thread.")
    for p in plan:
        report.add(f"probe_{p.name}_real", measured[p.name] * 1e3, "ms")
        report.add(f"probe_{p.name}_harness", harness[p.name] * 1e3, "ms")
        report.add(f"probe_{p.name}_model", (modeled(spec, cal, p) + harness[p.name]) * 1e3, "ms")
    for name in FITTED:
        report.add(f"cpu_{name}", float(getattr(cal, name)))
    report.add("calibration_file", str(path))
    return path


def main() -> None:
    parser = base_parser(__doc__ or "")
    parser.add_argument("--backend", default="vllm", choices=["vllm", "torch"], help="the real engine")
    parser.add_argument("--layouts", default="colocated",
                        help="colocated and/or 1p1d (1p1d: the engine's prefill and decode workers)")
    parser.add_argument("--rates", default=None, help="comma-separated requests/s (default 1,1.5,2,2.5,3,4)")
    parser.add_argument("--input-len", default="lognormal:256:0.5", help="prompt tokens")
    parser.add_argument("--output-len", default="lognormal:48:0.5", help="output tokens")
    parser.add_argument("--point-duration", type=float, default=None,
                        help="seconds of arrivals per rate (default 90; --quick 20)")
    parser.add_argument("--calibration", type=Path, default=None,
                        help="a CPU preset to compare with (default: fit one from the probes first)")
    parser.add_argument("--write-calibration", type=Path, default=None,
                        help="where the fitted preset goes (default: a temporary folder)")
    parser.add_argument("--out", type=Path, default=None, help="the model folder's parent (default: temporary)")
    parser.add_argument("--pin", action="store_true",
                        help=f"the real engine's compute on CPU {ENGINE_CPU} (1p1d: the prefill engine's), everything "
                             "else on CPU 0 (two CPUs)")
    parser.add_argument("--mixed", action="store_true",
                        help=f"before the sweep, prompts of {', '.join(map(str, MIXED_PREFILLS))} tokens beside "
                             f"{', '.join(map(str, MIXED_BATCHES))} running decodes on both engines (colocated)")
    args = parser.parse_args()
    if args.pin and not {0, ENGINE_CPU} <= os.sched_getaffinity(0):
        parser.error(f"--pin needs CPUs 0 and {ENGINE_CPU} (this process may run on {sorted(os.sched_getaffinity(0))})")
    rates = [float(r) for r in (args.rates or ("1,2" if args.quick else "1,1.5,2,2.5,3,4")).split(",")]
    duration = args.point_duration or (20.0 if args.quick else 90.0)
    workload = Workload("synthetic", "", LengthDist.parse(args.input_len, "--input-len"),
                        LengthDist.parse(args.output_len, "--output-len"))
    layouts = [Layout(n.strip()) for n in args.layouts.split(",") if n.strip()]
    report = Report()
    report.add("load_average_start", os.getloadavg()[0])
    out = args.out or Path(tempfile.mkdtemp(prefix="sim-dynamics-"))
    folder = make_folder(args.backend, out)
    started = time.monotonic()
    calibration = args.calibration or calibrate(args, folder, report)
    prompts = Prompts(seed=2)
    for layout in layouts:
        with cluster(folder, layout, real_engine(args.backend)) as real, \
                cluster(folder, layout, sim_engine(calibration, 1.0)) as sim:
            if args.pin:
                pin([real, sim], args.backend)
            asyncio.run(wait_serving(real.url, folder.name))
            asyncio.run(wait_serving(sim.url, folder.name))
            if layout.name == "colocated" and args.mixed:
                report_mixed(report, asyncio.run(mixed_steps(real.url, sim.url, folder.name, prompts)))
            real_points, sim_points = asyncio.run(sweep(real.url, sim.url, folder.name, rates, workload, duration,
                                                        20 if args.quick else 60, prompts))
        report_layout(report, layout.name, rates, real_points, sim_points)
    report.add("wall_minutes", (time.monotonic() - started) / 60, "min")
    report.add("load_average_end", os.getloadavg()[0])
    report.emit(args.json)


if __name__ == "__main__":
    main()
