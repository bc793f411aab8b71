"""``benchmarks/sim_dynamics.py`` at a small size against the group's vLLM workers: the CPU preset is
fitted to their probed step times, and one workload runs at two rates through them and through
simulated workers on that preset, in the same harness.

The figures are printed, not asserted: on a shared 2-core machine an engine's step times follow the
machine's other load from one minute to the next (the benchmark runs the full comparison, on a quiet
machine, with the acceptance bounds). What is asserted is the machinery: the probes see fresh prompts,
the fit reproduces what it was fitted to, the preset file loads and drives simulated workers, and both
clusters answer every request of the same workload.
"""

from __future__ import annotations

import importlib.util
import math
import sys
from pathlib import Path
from types import ModuleType

from pdrouter.core.model_spec import ModelSpec
from pdrouter.engine.sim.calibration import Calibration

from .conftest import BLOCK, MODEL, POOL_BLOCKS, VllmPool, run

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "sim_dynamics.py"


def load_bench() -> ModuleType:
    sys.path.insert(0, str(BENCH.parent))
    spec = importlib.util.spec_from_file_location("sim_dynamics", BENCH)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["sim_dynamics"] = module  # its dataclasses look their module up while being defined
    spec.loader.exec_module(module)
    return module


def test_a_cpu_preset_fitted_to_vllm_drives_simulated_workers_through_the_same_workload(
        vllm_pool: VllmPool, vllm_model: Path, tmp_path: Path) -> None:
    sd = load_bench()
    assert sd.BLOCK_SIZE == BLOCK
    limits = sd.Limits()  # what the group's workers run: vLLM's own defaults on the CPU
    url = vllm_pool.http + "/v1"
    plan = [sd.Probe("prefill", 16), sd.Probe("prefill", 320), sd.Probe("decode", 1, 32), sd.Probe("decode", 4, 32)]
    prompts = sd.Prompts(seed=7)
    measured = run(sd.measure(url, MODEL, plan, prompts, reps=3, workers=2, limits=limits))
    layout = sd.Layout("colocated", workers=2)
    with sd.cluster(vllm_model, layout, sd.sim_engine(None, 0.0), limits=limits, num_blocks=POOL_BLOCKS) as free:
        run(sd.wait_serving(free.url, MODEL))
        harness = run(sd.measure(free.url, MODEL, plan, prompts, reps=3, workers=2, limits=limits))
    engine = sd.engine_times(plan, measured, harness)
    fitted = [p for p in plan if engine[p.name] > 0]
    assert fitted, (measured, harness)
    spec = ModelSpec.from_pretrained_dir(vllm_model)
    cal = sd.fit_cpu(spec, engine, plan, limits)
    path = tmp_path / "cpu.yaml"
    sd.write_calibration(cal, path, "fitted by the vLLM group's dynamics test")
    loaded = Calibration.from_file(path)
    assert all(math.isclose(getattr(loaded, f), getattr(cal, f), rel_tol=1e-3) for f in sd.FITTED)
    # The fit moved towards what it was fitted to, and lands in its range. (Not closer: on a shared
    # machine one probe can take twice another, longer one, which no step cost reproduces.)
    def loss(c: Calibration) -> float:
        return sum(math.log(sd.modeled(spec, c, p, limits) / engine[p.name]) ** 2 for p in fitted)

    assert loss(cal) < loss(sd.start_calibration(limits))
    for p in fitted:
        assert abs(math.log(sd.modeled(spec, cal, p, limits) / engine[p.name])) < math.log(4.0), (p, engine, cal)
    workload = sd.Workload("synthetic", "", sd.LengthDist.parse("48-96", "in"), sd.LengthDist.parse("8-16", "out"))
    with sd.cluster(vllm_model, layout, sd.sim_engine(path, 1.0), limits=limits, num_blocks=POOL_BLOCKS) as sim:
        run(sd.wait_serving(sim.url, MODEL))
        real, simulated = run(sd.sweep(url, sim.url, MODEL, [1.0, 2.0], workload, 10.0, 16, prompts))
        # A prompt beside running decodes, on both: every request answered, a TTFT each.
        mixed = {name: run(sd.mixed_ttft(u, MODEL, prompts, 64, 4, reps=2)) for name, u in (("real", url),
                                                                                              ("sim", sim.url))}
    verdict = sd.verdict([1.0, 2.0], real, simulated)
    assert all(0 < t < 30 for t in mixed.values()), mixed
    for points in (real, simulated):
        for point in points.values():  # every CPU's busy share of the point's run, where /proc/stat says
            assert all(0.0 <= b <= 1.0 for b in point.busy.values()), point.busy
    for rate in (1.0, 2.0):
        r, s = real[rate], simulated[rate]
        assert r.failed == s.failed == 0 and r.summary.completed == s.summary.completed > 0
        print(f"rate {rate:g}: " + ", ".join(
            f"{m} {q} {r.figure(m, q) * 1e3:.1f} / {s.figure(m, q) * 1e3:.1f} ms" for m in ("ttft", "tpot", "e2e")
            for q in ("p50", "p90")) + " (real / simulated)")
    print("probes (ms, engine / model): " + ", ".join(
        f"{p.name} {engine[p.name] * 1e3:.1f} / {sd.modeled(spec, cal, p, limits) * 1e3:.1f}" for p in plan))
    print(f"a 64-token prompt beside 4 decodes: TTFT {mixed['real'] * 1e3:.1f} / {mixed['sim'] * 1e3:.1f} ms")
    print(f"rates within the bounds: {verdict.rates_within} of {verdict.rates_below}; saturation "
          f"{verdict.saturation_real} / {verdict.saturation_sim}")
