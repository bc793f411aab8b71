"""The torch engine on a CUDA GPU against the simulator's prediction, step by step (needs a GPU).

Builds a Llama-3-8B-geometry model with random bf16 weights directly on the device (no folder,
no download), a paged KV pool, and times the engine's own model step (``ModelRunner.run``, the
code the workers run) on these shapes:

* decode batches of 1/8/32/128 sequences at a 1k context, 1 and 32 at 4k, 64 at 2k;
* prefills of 128, 256, 512, 2k and 8k tokens, and a 512-token chunk on top of 3,584 cached;
* a mixed step: a 512-token prefill beside 32 decodes at 1k;
* batch-1 decode and a 128-token prefill again with half the layers (what a layer costs).

Beside each figure it prints what ``pdrouter.engine.sim.timing.TimingModel`` predicts for the GPU
preset ``--gpu`` (default h200) with the calibration ``--calibration`` (default ``torch-eager``, the
preset for this engine). Per shape:

* ``<case>_measured_ms``: the whole step, synchronized (median of the repetitions);
* ``<case>_host_ms``: until ``run`` returned, the host handing the step over (near the whole step: the
  step is bound by its launches, not by the GPU);
* ``<case>_gpu_ms``: the kernels' own time, their durations summed by the CUDA profiler (gaps left out);
* ``<case>_ops``: the torch operators the step dispatched (each costs the host a dispatch);
* ``<case>_sim_ms`` / ``<case>_error``: the modeled step and sim ÷ measured − 1;
  ``<case>_kernels_error``: the modeled kernels (the step less its host costs) against ``_gpu_ms``.

Every step is timed before any is counted or profiled. The device's own ceilings, in the same run:
``copy_tb_per_s`` (a device-to-device copy, bytes read and written), ``gemm_tflops`` (an 8192³ bf16
product), ``launch_us`` (one small kernel launched from a Python loop), ``h2d_small_copy_us`` (a small
host-to-device copy from pageable memory) and ``idle_sync_us``.

``--save FILE`` writes the measured seconds as JSON; ``--measured FILE`` reads such a file instead of
measuring (no GPU needed), so the comparison and the fit can be redone anywhere. ``--fit`` fits the
kernels' efficiencies to the kernel times, then the host's step, layer and sequence costs to the whole
steps (the robust log-error loss, priors and coordinate descent of ``sim_fidelity.py --fit``), and
prints the fitted fields and the errors after the fit. ``benchmarks/data/gpu_calibration_h200.json``
holds the H200 run the ``torch-eager`` preset is fitted to; ``..._before.json`` the engine before its
attention and input-copy changes (``docs/simulation.md``, "On a real GPU").

Without CUDA (and without ``--measured``) it prints ``cuda_available: 0`` and exits 0 (the test suite
never needs a GPU); ``--device cpu --model-preset tiny`` runs the measuring code itself on a CPU.

    python benchmarks/gpu_calibration.py [--quick] [--json] [--gpu h200] [--calibration torch-eager]
        [--save FILE | --measured FILE] [--fit]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path

from _report import Report, base_parser

from pdrouter.core.gpu import get_gpu_preset
from pdrouter.core.model_spec import ModelSpec, get_model_preset
from pdrouter.engine.sim.calibration import Calibration, resolve_calibration
from pdrouter.engine.sim.timing import SeqWork, StepCost, TimingModel

BLOCK = 16
HALF = "half"  # a case run on the model with half the layers

FIT_BOUNDS: dict[str, tuple[float, float]] = {
    "step_overhead_s": (0.0, 5e-3), "layer_overhead_s": (0.0, 2e-3), "per_seq_overhead_s": (0.0, 1e-4),
    "mbu": (0.3, 0.95), "kv_mbu": (0.05, 1.0), "mfu": (0.3, 0.95), "attention_mfu": (0.1, 0.9),
    "activation_traffic": (0.0, 4.0)}
"""What the fit moves, and where: every cost an eager, graph-less engine pays (its decode-only fields are
unused). Wider than ``sim_fidelity.py``'s bounds, which hold for engines with graphs and fused kernels: an
eager engine's host can spend a millisecond a layer launching its kernels. A step's own host work outside
its layers (packing the inputs, the embedding, the LM head) is a handful of launches: at most milliseconds
(a wider bound lets the coordinate descent settle on a per-step cost that the half-depth model refutes)."""
FIT_FIELDS = tuple(FIT_BOUNDS)


@dataclass(frozen=True)
class Case:
    """One step: sequences of ``(new tokens, cached before)``; ``model`` is ``full`` or ``half``."""

    name: str
    seqs: tuple[tuple[int, int], ...]
    model: str = "full"


def cases(quick: bool) -> list[Case]:
    def decode(b: int, ctx: int) -> Case:
        return Case(f"decode_b{b}_c{ctx}", ((1, ctx),) * b)

    out = [decode(1, 1024), decode(8, 1024), Case("prefill_128", ((128, 0),)), Case("prefill_512", ((512, 0),))]
    if quick:
        return out
    out += [decode(32, 1024), decode(128, 1024), decode(64, 2048), decode(1, 4096), decode(32, 4096),
            Case("prefill_256", ((256, 0),)), Case("prefill_2048", ((2048, 0),)), Case("prefill_8192", ((8192, 0),)),
            Case("chunk_512_on_3584", ((512, 3584),)),
            Case("mixed_512_plus_b32_c1024", ((512, 0),) + ((1, 1024),) * 32),
            Case("half_decode_b1_c1024", ((1, 1024),), HALF), Case("half_prefill_128", ((128, 0),), HALF)]
    return out


def half_spec(spec: ModelSpec) -> ModelSpec:
    return dataclasses.replace(spec, num_layers=max(1, spec.num_layers // 2))


def measure(args: argparse.Namespace, report: Report, spec: ModelSpec,
            todo: list[Case]) -> dict[str, dict[str, float]] | None:
    """Seconds per case (``step`` wall, ``host`` enqueue) and the device's ceilings; None without CUDA."""
    import torch

    from pdrouter.core.kv_layout import KvLayout
    from pdrouter.engine.kv_cache import KvCache
    from pdrouter.engine.model import LlamaModel
    from pdrouter.engine.model_runner import ModelRunner, WorkItem

    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        return None
    cuda = device.type == "cuda"
    sync: Callable[[], None] = torch.cuda.synchronize if cuda else (lambda: None)
    report.add("device", torch.cuda.get_device_name(device) if cuda else "cpu")
    quick = bool(args.quick)
    repeats = 3 if quick else 20
    out: dict[str, dict[str, float]] = {"ceilings": {}}
    if cuda:
        n = 1 << 30
        src, dst = torch.empty(n, dtype=torch.uint8, device=device), torch.empty(n, dtype=torch.uint8, device=device)
        a = torch.randn(8192, 8192, dtype=torch.bfloat16, device=device)
        copy_s = _median(lambda: dst.copy_(src), sync, repeats)
        gemm_s = _median(lambda: a @ a, sync, repeats)
        tiny = torch.zeros(1, device=device)
        launches = 2000
        sync()
        start = time.perf_counter()
        for _ in range(launches):
            tiny.add_(1)
        launch_s = (time.perf_counter() - start) / launches
        sync()
        small = torch.arange(64)
        copies = 200
        start = time.perf_counter()
        for _ in range(copies):
            small.to(device)
        copy_small_s = (time.perf_counter() - start) / copies
        start = time.perf_counter()
        for _ in range(copies):
            sync()
        sync_s = (time.perf_counter() - start) / copies
        out["ceilings"] = {"copy_tb_per_s": 2 * n / copy_s / 1e12, "gemm_tflops": 2 * 8192 ** 3 / gemm_s / 1e12,
                           "launch_us": launch_s * 1e6, "h2d_small_copy_us": copy_small_s * 1e6,
                           "idle_sync_us": sync_s * 1e6}
        del src, dst, a, tiny
    torch.manual_seed(0)
    steps: list[tuple[Case, Callable[[], object]]] = []
    for which, model_spec in (("full", spec), (HALF, half_spec(spec))):
        mine = [c for c in todo if c.model == which]
        if not mine:
            continue
        with torch.device(device):
            model = LlamaModel(model_spec).to(torch.bfloat16)
        for p in model.parameters():
            torch.nn.init.normal_(p, std=0.02)
        need = max(sum(-(-(n + c) // BLOCK) for n, c in case.seqs) for case in mine) + 8
        runner = ModelRunner(model, KvCache(KvLayout.for_model(model_spec, need, BLOCK, "bfloat16"), device))
        for case in mine:
            items, next_block = [], 0
            for new, cached in case.seqs:
                blocks = -(-(new + cached) // BLOCK)
                items.append(WorkItem([1] * new, cached, list(range(next_block, next_block + blocks)), True))
                next_block += blocks
            steps.append((case, partial(runner.run, items)))
    # Every step is timed before any is counted or profiled: a dispatch hook or a profiler, once
    # installed, can slow the host's launches for the rest of the process.
    for case, fn in steps:
        tokens = sum(n for n, _ in case.seqs)
        step, host = _timed_step(fn, sync, max(2, repeats // 3) if tokens > 2048 else repeats)
        out[case.name] = {"step": step, "host": host}
    for case, fn in steps:
        out[case.name]["ops"] = _count_ops(fn)
        if cuda:
            try:
                gpu, top = _gpu_time(fn)
            except Exception as exc:  # a profiler that does not run costs only this figure
                print(f"# the CUDA profiler did not run: {exc}")
            else:
                out[case.name]["gpu"] = gpu
                print(f"# {case.name}: " + "; ".join(f"{k[:60]} {t * 1e3:.2f} ms" for k, t in top))
    return out


def _median(fn: Callable[[], object], sync: Callable[[], None], repeats: int) -> float:
    fn()
    sync()
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        sync()
        samples.append(time.perf_counter() - start)
    return sorted(samples)[len(samples) // 2]


def _timed_step(fn: Callable[[], object], sync: Callable[[], None], repeats: int) -> tuple[float, float]:
    """Median wall seconds of one step (synchronized) and of its hand-off alone (until ``fn`` returns)."""
    fn()
    sync()
    steps, hosts = [], []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        handed = time.perf_counter()
        sync()
        steps.append(time.perf_counter() - start)
        hosts.append(handed - start)
    return sorted(steps)[len(steps) // 2], sorted(hosts)[len(hosts) // 2]


def _count_ops(fn: Callable[[], object]) -> float:
    """The torch operators one step dispatches (each a kernel launch, or a view that costs host time)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            Count.n += 1
            return func(*args, **(kwargs or {}))

    with Count():
        fn()
    return float(Count.n)


def _gpu_time(fn: Callable[[], object]) -> tuple[float, list[tuple[str, float]]]:
    """Seconds the GPU's kernels run during one step (their durations summed, as the CUDA profiler
    reports them: the gaps between launches left out), and the five longest kernels' names and seconds."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    kernels = [(e.key, e.self_device_time_total / 1e6) for e in prof.key_averages() if e.self_device_time_total > 0]
    kernels.sort(key=lambda k: -k[1])
    return sum(t for _, t in kernels), kernels[:5]


def predict(case: Case, spec: ModelSpec, gpu: str, cal: Calibration) -> float:
    return _cost(case, spec, gpu, cal).seconds


def predict_gpu(case: Case, spec: ModelSpec, gpu: str, cal: Calibration) -> float:
    """The modeled kernels alone: the step less its host costs (fixed and per sequence)."""
    cost = _cost(case, spec, gpu, cal)
    return cost.seconds - cost.overhead_s + cost.hidden_s


def _cost(case: Case, spec: ModelSpec, gpu: str, cal: Calibration) -> StepCost:
    model_spec = half_spec(spec) if case.model == HALF else spec
    return TimingModel(model_spec, get_gpu_preset(gpu), calibration=cal).step([SeqWork(n, c) for n, c in case.seqs])


HOST_FIELDS = ("step_overhead_s", "layer_overhead_s", "per_seq_overhead_s")
"""The host's costs, fitted to the whole steps; the others (the kernels' efficiencies) to the kernels' time."""


def loss(measured: dict[str, dict[str, float]], todo: list[Case], spec: ModelSpec, gpu: str,
         cal: Calibration, target: str = "step") -> float:
    """Pseudo-Huber loss of the log-errors (quadratic within about 10 %), as ``sim_fidelity.py --fit``;
    ``target`` ``step``: the whole steps against ``predict``, ``gpu``: the kernels against ``predict_gpu``."""
    d = 0.1
    total = 0.0
    model = predict if target == "step" else predict_gpu
    for case in todo:
        if target in measured.get(case.name, {}):
            e = math.log(model(case, spec, gpu, cal) / measured[case.name][target])
            total += d * d * (math.sqrt(1 + (e / d) ** 2) - 1)
    return total


def fit(measured: dict[str, dict[str, float]], todo: list[Case], spec: ModelSpec, gpu: str,
        start: Calibration, sweeps: int = 12) -> Calibration:
    """``start`` with ``FIT_FIELDS`` fitted (coordinate descent, golden sections): the kernels' efficiencies
    to the profiled kernel times where the file has them, then the host's costs to the whole steps. The
    fitted fields start from the ``vllm`` preset's values whatever ``start`` holds, so that the same
    figures give the same fit."""
    from sim_fidelity import PRIOR_WEIGHT, PRIORS, coordinate_descent

    def pulled(cal: Calibration, target: str, fields: list[str]) -> float:
        """The loss, plus ``sim_fidelity.py``'s priors on the kernels' efficiencies: a few compute-bound
        shapes leave ``mfu``, ``attention_mfu`` and ``activation_traffic`` free to trade against each other,
        and the priors (profiled values) settle them where the data does not."""
        prior = sum(PRIOR_WEIGHT * math.log(getattr(cal, f) / PRIORS[f]) ** 2
                    for f in fields if target == "gpu" and PRIORS.get(f, 0) > 0 and getattr(cal, f) > 0)
        return loss(measured, todo, spec, gpu, cal, target) + prior

    cal = start.with_overrides(**{name: getattr(Calibration(), name) for name in FIT_FIELDS})
    has_gpu = any("gpu" in m for m in measured.values())
    stages = [("gpu", [f for f in FIT_FIELDS if f not in HOST_FIELDS]), ("step", list(HOST_FIELDS))] if has_gpu \
        else [("step", list(FIT_FIELDS))]
    for target, fields in stages:
        cal = coordinate_descent(cal, fields, FIT_BOUNDS,
                                 lambda c, target=target, fields=fields: pulled(c, target, fields), sweeps)
    return cal


def compare(report: Report, prefix: str, measured: dict[str, dict[str, float]], todo: list[Case],
            spec: ModelSpec, gpu: str, cal: Calibration) -> None:
    errors = []
    for case in todo:
        if case.name not in measured:
            continue
        sim = predict(case, spec, gpu, cal)
        got = measured[case.name]["step"]
        if not prefix:
            report.add(f"{case.name}_measured_ms", got * 1e3, "ms")
            report.add(f"{case.name}_host_ms", measured[case.name]["host"] * 1e3, "ms")
            if "gpu" in measured[case.name]:
                report.add(f"{case.name}_gpu_ms", measured[case.name]["gpu"] * 1e3, "ms")
            if "ops" in measured[case.name]:
                report.add(f"{case.name}_ops", int(measured[case.name]["ops"]))
        report.add(f"{prefix}{case.name}_sim_ms", sim * 1e3, "ms")
        report.add(f"{prefix}{case.name}_error", sim / got - 1)
        errors.append(abs(sim / got - 1))
        if "gpu" in measured[case.name]:
            report.add(f"{prefix}{case.name}_kernels_error",
                       predict_gpu(case, spec, gpu, cal) / measured[case.name]["gpu"] - 1)
    if errors:
        report.add(f"{prefix}median_abs_error", sorted(errors)[len(errors) // 2])
        report.add(f"{prefix}within_15pct", sum(e <= 0.15 for e in errors), f"of {len(errors)}")


def main() -> None:
    parser = base_parser(__doc__ or "")
    parser.add_argument("--gpu", default="h200", help="the GPU preset the simulator predicts for")
    parser.add_argument("--calibration", default="torch-eager", help="the simulator's preset or calibration file")
    parser.add_argument("--model-preset", default="llama-3-8b", help="the geometry (tiny: a check of this script)")
    parser.add_argument("--device", default="cuda", help="cuda[:N]; cpu only to check the script itself")
    parser.add_argument("--save", help="write the measured seconds to this JSON file")
    parser.add_argument("--measured", help="a file --save wrote: compare (and fit) without measuring")
    parser.add_argument("--fit", action="store_true", help="fit the calibration's costs to the measured steps")
    args = parser.parse_args()
    report = Report()
    spec = get_model_preset(args.model_preset)
    todo = [c for c in cases(args.quick) if max(n + c for n, c in c.seqs) <= spec.max_context]
    if args.measured:
        try:
            data = json.loads(Path(args.measured).read_text())
            measured = data["cases"]
        except (OSError, ValueError, KeyError, TypeError) as exc:
            parser.error(f"--measured {args.measured}: not a file this script saved with --save ({exc!r})")
        report.add("device", data.get("device", "?"))
        ceilings = data.get("ceilings", {})
    else:
        got = measure(args, report, spec, todo)
        if got is None:
            report.add("cuda_available", 0, "bool")
            report.emit(args.json)
            return
        ceilings = got.pop("ceilings")
        measured = got
        if args.save:
            device = next((v for n, v, _ in report.figures if n == "device"), "?")
            Path(args.save).write_text(json.dumps({"device": device, "model": args.model_preset,
                                                   "ceilings": ceilings, "cases": measured}, indent=1) + "\n")
    report.add("cuda_available", 1, "bool")
    for name, value in ceilings.items():
        report.add(name, value, "TB/s" if name.endswith("per_s") else "TFLOP/s" if name.endswith("tflops") else "us")
    cal = resolve_calibration(args.calibration)
    compare(report, "", measured, todo, spec, args.gpu, cal)
    if args.fit:
        fitted = fit(measured, todo, spec, args.gpu, cal)
        for name in FIT_FIELDS:
            report.add(f"fitted_{name}", getattr(fitted, name))
        compare(report, "fitted_", measured, todo, spec, args.gpu, fitted)
    report.emit(args.json)


if __name__ == "__main__":
    main()
