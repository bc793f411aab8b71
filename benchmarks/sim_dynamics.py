"""The simulator's dynamics against a real engine on this machine: one workload, one harness, both engines.

    python benchmarks/sim_dynamics.py [--quick] [--json] [--backend torch] [--rates 2,4,8,16]

1. **Calibrate a CPU device preset.** One real colocated worker (``--backend``: the project's torch
   engine on this machine's CPUs; the vLLM backend once ``pdrouter up`` runs it) behind the router
   answers probes: prompts of several lengths at concurrency 1 with one output token (prefill
   against tokens) and batches of concurrent decodes (decode against batch). The same probes
   through a simulated worker at time scale 0 (no model time at all) measure the harness's own
   share, which is taken off. The ``cpu`` GPU preset with a calibration fitted to what is left
   (``mfu``, the costs of a prefill step, of a decode-only step and per sequence) is the CPU
   preset, written to ``--out/cpu_calibration.json``.
2. **Compare.** The same Poisson workload at each rate of ``--rates`` through the real worker and
   through a simulated one with that preset and the real worker's KV pool (``--num-blocks``): TTFT,
   TPOT and E2E at p50 and p90, the output throughput, and the rate at which each saturates (the
   first whose achieved request rate falls under 90% of the offered one, or whose p90 TTFT passes
   10× the lowest rate's).

Printed as ``name: value unit`` lines (``--json``: one object); ``--quick`` runs fewer probes, rates and
requests (under a minute on an idle machine). Timings are only compared within one run.
"""

from __future__ import annotations

import asyncio
import json
import math
import statistics
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _report import Report, base_parser
from sim_fidelity import _golden

from pdrouter.bench.compare import Layout, bring_up
from pdrouter.bench.runner import RunConfig, run
from pdrouter.bench.stats import Summary, summarize
from pdrouter.bench.workload import RequestSpec
from pdrouter.core.gpu import get_gpu_preset
from pdrouter.core.model_spec import ModelSpec
from pdrouter.engine.sim.calibration import Calibration
from pdrouter.engine.sim.timing import TimingModel

DEVICE = "cpu"
NUM_BLOCKS = 512
DECODE_PROMPT = 16
DECODE_TOKENS = 48
FITTED = ("mfu", "step_overhead_s", "decode_step_overhead_s", "per_seq_overhead_s")
BOUNDS = {"mfu": (1e-4, 1.0), "step_overhead_s": (0.0, 0.2), "decode_step_overhead_s": (0.0, 0.2),
          "per_seq_overhead_s": (0.0, 0.02)}


@dataclass(frozen=True)
class Probe:
    """One shape of step: a prefill of ``tokens`` (batch 1) or a decode of ``batch`` sequences."""

    kind: str
    size: int

    @property
    def name(self) -> str:
        return f"{self.kind}_{self.size}"


def probes(quick: bool) -> list[Probe]:
    prefills = (16, 256) if quick else (16, 128, 512, 1000)
    batches = (1, 8) if quick else (1, 4, 16, 32)
    return [Probe("prefill", n) for n in prefills] + [Probe("decode", b) for b in batches]


def _specs(n: int, prompt: int, max_tokens: int, seed: int) -> list[RequestSpec]:
    rng = range(32, 127)
    return [RequestSpec(i, tuple(rng[(seed * 7919 + i * 131 + j * 17) % len(rng)] for j in range(prompt)), max_tokens)
            for i in range(n)]


def _drive(url: str, model: str, specs: Sequence[RequestSpec], *, rate: float | None = None,
           concurrency: int | None = None) -> Summary:
    config = RunConfig(base_url=url, model=model, rate=rate, concurrency=concurrency, seed=1)
    result = asyncio.run(run(config, specs))
    return summarize(result.records, result.duration_s)


def measure(url: str, model: str, quick: bool) -> dict[str, float]:
    """Each probe's median seconds through ``url``: TTFT for a prefill, TPOT for a decode batch."""
    out = {}
    reps = 3 if quick else 6
    for i, probe in enumerate(probes(quick)):
        if probe.kind == "prefill":
            summary = _drive(url, model, _specs(reps, probe.size, 1, i), concurrency=1)
            out[probe.name] = summary.ttft.p50
        else:
            summary = _drive(url, model, _specs(2 * probe.size, DECODE_PROMPT, DECODE_TOKENS, i),
                             concurrency=probe.size)
            out[probe.name] = summary.tpot.p50
    return out


def modeled(spec: ModelSpec, cal: Calibration, probe: Probe) -> float:
    model = TimingModel(spec, get_gpu_preset(DEVICE), calibration=cal)
    if probe.kind == "prefill":
        return model.prefill(probe.size).seconds
    return model.decode_step(probe.size, DECODE_PROMPT + DECODE_TOKENS // 2).seconds


def fit_cpu(spec: ModelSpec, engine_s: dict[str, float], quick: bool) -> Calibration:
    """The CPU preset: ``FITTED`` fields fitted to the engine's own step times (log least squares)."""
    # Decode-only steps keep their own cost ("graph" steps in the timing model's terms, whatever the engine).
    cal = Calibration.preset("torch-eager").with_overrides(layer_overhead_s=0.0, decode_layer_overhead_s=0.0,
                                                          fp8_layer_overhead_s=0.0, step_overhead_s=1e-3,
                                                          decode_step_overhead_s=1e-3, mfu=0.05, mbu=0.5,
                                                          graph_max_batch=NUM_BLOCKS)
    shapes = [p for p in probes(quick) if engine_s.get(p.name, 0) > 0]

    def loss(c: Calibration) -> float:
        return sum(math.log(modeled(spec, c, p) / engine_s[p.name]) ** 2 for p in shapes)

    for _ in range(6):
        for name in FITTED:
            lo, hi = BOUNDS[name]
            base = cal

            def at(x: float, name: str = name, base: Calibration = base) -> float:
                return loss(base.with_overrides(**{name: x}))

            best = _golden(at, lo, hi)
            if at(best) < loss(cal):
                cal = cal.with_overrides(**{name: best})
    return cal


def sweep(url: str, model: str, rates: Sequence[float], n: int, prompt: int, output: int) -> dict[float, Summary]:
    return {rate: _drive(url, model, _specs(n, prompt, output, int(rate * 10)), rate=rate) for rate in rates}


def saturation(results: dict[float, Summary]) -> float | None:
    """The first rate at which the engine fell behind (see the module docstring), None if none did."""
    rates = sorted(results)
    base = results[rates[0]].ttft.p90
    for rate in rates:
        s = results[rate]
        if s.request_rate < 0.9 * rate or s.ttft.p90 > 10 * base:
            return rate
    return None


def main() -> None:
    parser = base_parser(__doc__ or "")
    parser.add_argument("--backend", default="torch", help="the real engine behind `pdrouter up --backend` (torch)")
    parser.add_argument("--rates", default=None, help="comma-separated requests/s (default 2,4,8,16,32)")
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--requests", type=int, default=None, help="requests per rate (default 60; --quick 24)")
    parser.add_argument("--out", type=Path, default=None, help="where the CPU calibration file goes (default: temp)")
    args = parser.parse_args()
    from pdrouter.engine.model_io import make_model

    rates = [float(r) for r in (args.rates or ("4,16" if args.quick else "2,4,8,16,32")).split(",")]
    n = args.requests or (24 if args.quick else 60)
    report = Report()
    out = args.out or Path(tempfile.mkdtemp(prefix="sim-dynamics-"))
    out.mkdir(parents=True, exist_ok=True)
    folder = make_model("tiny", 0, out / "tiny")
    spec = ModelSpec.from_pretrained_dir(folder)
    layout = Layout("colocated-1", colocated=1)
    blocks = ["--num-blocks", str(NUM_BLOCKS)]
    with bring_up(layout, folder, gpu=DEVICE, time_scale=0.0, extra=blocks) as free:
        harness = measure(free.url, folder.name, args.quick)
    with bring_up(layout, folder, gpu=DEVICE, time_scale=1.0, backend=args.backend, extra=blocks) as real:
        measured = measure(real.url, folder.name, args.quick)
        real_sweep = sweep(real.url, folder.name, rates, n, args.input_len, args.output_len)
    engine = {k: max(measured[k] - harness[k], 1e-6) for k in measured}
    cal = fit_cpu(spec, engine, args.quick)
    path = out / "cpu_calibration.json"
    path.write_text(json.dumps({"preset": "torch-eager", **{f: getattr(cal, f) for f in (
        *FITTED, "layer_overhead_s", "decode_layer_overhead_s", "mbu", "graph_max_batch")}}, indent=2))
    report.add("calibration_file", str(path))
    for probe in probes(args.quick):
        report.add(f"probe_{probe.name}_real", measured[probe.name] * 1e3, "ms")
        report.add(f"probe_{probe.name}_harness", harness[probe.name] * 1e3, "ms")
        report.add(f"probe_{probe.name}_model", (modeled(spec, cal, probe) + harness[probe.name]) * 1e3, "ms")
    for name in FITTED:
        report.add(f"cpu_{name}", float(getattr(cal, name)))
    extra = [*blocks, "--calibration", str(path)]
    with bring_up(layout, folder, gpu=DEVICE, time_scale=1.0, extra=extra) as sim:
        sim_sweep = sweep(sim.url, folder.name, rates, n, args.input_len, args.output_len)
    for rate in rates:
        r, s = real_sweep[rate], sim_sweep[rate]
        for metric in ("ttft", "tpot", "e2e"):
            for q in ("p50", "p90"):
                a, b = getattr(getattr(r, metric), q), getattr(getattr(s, metric), q)
                report.add(f"rate_{rate:g}_{metric}_{q}_real", a * 1e3, "ms")
                report.add(f"rate_{rate:g}_{metric}_{q}_sim", b * 1e3, "ms")
                report.add(f"rate_{rate:g}_{metric}_{q}_error", 100 * (b - a) / a if a > 0 else math.nan, "%")
        report.add(f"rate_{rate:g}_throughput_real", r.output_tokens_per_s, "tok/s")
        report.add(f"rate_{rate:g}_throughput_sim", s.output_tokens_per_s, "tok/s")
    for name, results in (("real", real_sweep), ("sim", sim_sweep)):
        rate = saturation(results)
        report.add(f"saturation_rate_{name}", rate if rate is not None else math.nan, "req/s")
    report.add("rates_median_abs_ttft_p50_error", statistics.median(
        abs(100 * (sim_sweep[x].ttft.p50 - real_sweep[x].ttft.p50) / real_sweep[x].ttft.p50) for x in rates), "%")
    report.emit(args.json)


if __name__ == "__main__":
    main()
