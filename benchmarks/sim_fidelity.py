"""Fidelity of the simulated GPU: the timing model against published GPU measurements.

    python benchmarks/sim_fidelity.py [--quick] [--json] [--fit]

For every row of ``MEASUREMENTS`` (published figures, each with its source) it prints what was
measured (``<row>: …``), the published figure (``<row>_published``), the timing model's figure with
the default calibration (``<row>_sim``) and the relative error in percent (``<row>_error``), then a
summary. Rows whose ``calibrates`` names a calibration field were used to fit that default
(``pdrouter.engine.sim.calibration.Calibration``); the others are held out. ``--fit`` re-derives the
fitted defaults from their rows and prints them next to the defaults. Target: |error| <= 15% on
each row; ``docs/simulation.md`` explains the rows that miss it. Instant, so ``--quick`` changes
nothing.
"""

from __future__ import annotations

import dataclasses
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _report import Report, base_parser

from pdrouter.core.gpu import GiB, GpuSpec, get_gpu_preset
from pdrouter.core.model_spec import ModelSpec, get_model_preset
from pdrouter.engine.sim.calibration import Calibration
from pdrouter.engine.sim.timing import SeqWork, TimingModel

TARGET_PCT = 15.0

SOURCES: dict[str, str] = {
    "trtllm": "TensorRT-LLM, 'Performance of TensorRT-LLM', docs/source/performance.md (throughput tables of "
              "v0.6.1, first-token latency of v0.5), https://github.com/NVIDIA/TensorRT-LLM/blob/"
              "138f96d45f90b9667426f7c47297d8c06bafac73/docs/source/performance.md",
    "databricks": "Databricks (Mosaic AI Research), 'LLM Inference Performance Engineering: Best Practices' "
                  "(2023; Figures 2-3 and Table 1), "
                  "https://www.databricks.com/blog/llm-inference-performance-engineering-best-practices",
    "nim": "NVIDIA NIM for LLMs benchmarking guide, 'Performance': Llama-3.3-70b-instruct, version 1.8.0, "
           "2 x H100 80G, fp8 TP2, concurrency 1, https://docs.nvidia.com/nim/benchmarking/llm/1.0.0/performance",
    "vllm": "vLLM performance benchmark, Buildkite build 9515, latency tests (8 prompts, 32 in / 128 out, "
            "mean latency), https://buildkite.com/vllm/performance-benchmark/builds/9515",
}
TRTLLM, DATABRICKS, NIM, VLLM = "trtllm", "databricks", "nim", "vllm"


def _llama2(name: str, layers: int, hidden: int, heads: int, kv_heads: int, inter: int) -> ModelSpec:
    """Llama-2 geometry from the HF config.json files (vocabulary 32000, context 4096, untied head)."""
    return ModelSpec(name=name, num_layers=layers, hidden_size=hidden, num_heads=heads, num_kv_heads=kv_heads,
                     head_dim=hidden // heads, intermediate_size=inter, vocab_size=32000, max_context=4096)


MODELS: dict[str, ModelSpec] = {
    "llama-2-7b": _llama2("llama-2-7b", 32, 4096, 32, 32, 11008),
    "llama-2-70b": _llama2("llama-2-70b", 80, 8192, 64, 8, 28672),
    "llama-3.1-8b": get_model_preset("llama-3-8b"),  # the same geometry as Llama-3-8B
    "llama-3-70b": get_model_preset("llama-3-70b"),  # Llama-3.3-70B shares it
}
GPUS: dict[str, GpuSpec] = {
    "a100-40g": GpuSpec("a100-40g", 40 * GiB, 1.555e12, 312e12, 600e9),  # A100 40GB SXM datasheet
    "a100-80g": get_gpu_preset("a100"),
    "h100-80g": get_gpu_preset("h100"),
    "h200": get_gpu_preset("h200"),
}


@dataclass(frozen=True)
class Measurement:
    """One published figure and the scenario that reproduces it.

    ``kind``: ``ttft`` (one prompt of ``input_len`` tokens in one step, batch 1), ``itl`` (one
    decode step at batch ``batch`` and context ``input_len + output_len // 2``, the decode's mean),
    ``mbu`` (Databricks' model bandwidth utilization at batch 1: (weights + KV) ÷ TPOT ÷ the TP
    group's bandwidth, context ``input_len``), ``static_latency`` (``batch`` prompts prefilled in
    one step, then ``output_len − 1`` decode steps) or ``static_throughput`` (output tokens/s per
    GPU of that run).
    """

    key: str
    source: str
    """A key of ``SOURCES``."""
    model: str
    dtype: str
    gpu: str
    tp: int
    batch: int
    input_len: int
    output_len: int
    kind: str
    published: float
    unit: str
    calibrates: str | None = None
    """The calibration field fitted to this row; None: held out."""

    def describe(self) -> str:
        role = f"calibrates {self.calibrates}" if self.calibrates else "held out"
        return (f"{self.model} {self.dtype}, {self.tp}x {self.gpu}, TP {self.tp}, batch {self.batch}, "
                f"{self.input_len} in / {self.output_len} out, {self.kind} [{role}]; source_{self.source}")


def _m(key: str, source: str, model: str, dtype: str, gpu: str, tp: int, batch: int, isl: int, osl: int,
       kind: str, published: float, unit: str, calibrates: str | None = None) -> Measurement:
    return Measurement(key, source, model, dtype, gpu, tp, batch, isl, osl, kind, published, unit, calibrates)


MEASUREMENTS: tuple[Measurement, ...] = (
    # TensorRT-LLM first-token latency (batch 1, one output token; v0.5).
    _m("trtllm_a100_llama2_7b_ttft_2048", TRTLLM, "llama-2-7b", "float16", "a100-80g", 1, 1, 2048, 1,
       "ttft", 0.133, "s", calibrates="mfu"),
    _m("trtllm_a100_llama2_7b_ttft_128", TRTLLM, "llama-2-7b", "float16", "a100-80g", 1, 1, 128, 1,
       "ttft", 0.016, "s", calibrates="serial_fraction"),
    _m("trtllm_a100_llama2_70b_tp4_ttft_2048", TRTLLM, "llama-2-70b", "float16", "a100-80g", 4, 1, 2048, 1,
       "ttft", 0.377, "s"),
    _m("trtllm_a100_llama2_70b_tp4_ttft_128", TRTLLM, "llama-2-70b", "float16", "a100-80g", 4, 1, 128, 1,
       "ttft", 0.047, "s"),
    _m("trtllm_h100_llama2_7b_fp8_ttft_2048", TRTLLM, "llama-2-7b", "float8", "h100-80g", 1, 1, 2048, 1,
       "ttft", 0.036, "s"),
    _m("trtllm_h100_llama2_7b_fp8_ttft_128", TRTLLM, "llama-2-7b", "float8", "h100-80g", 1, 1, 128, 1,
       "ttft", 0.007, "s"),
    _m("trtllm_h100_llama2_70b_fp8_tp4_ttft_2048", TRTLLM, "llama-2-70b", "float8", "h100-80g", 4, 1, 2048, 1,
       "ttft", 0.109, "s"),
    _m("trtllm_h100_llama2_70b_fp8_tp4_ttft_128", TRTLLM, "llama-2-70b", "float8", "h100-80g", 4, 1, 128, 1,
       "ttft", 0.026, "s"),
    # TensorRT-LLM static-batch throughput (v0.6.1, output tokens/s per GPU).
    _m("trtllm_h100_llama2_7b_fp8_b768_128_128", TRTLLM, "llama-2-7b", "float8", "h100-80g", 1, 768, 128, 128,
       "static_throughput", 19694.0, "tok/s/GPU"),
    _m("trtllm_h100_llama2_7b_fp8_b112_128_2048", TRTLLM, "llama-2-7b", "float8", "h100-80g", 1, 112, 128, 2048,
       "static_throughput", 6818.0, "tok/s/GPU"),
    _m("trtllm_h100_llama2_70b_fp8_tp2_b1024_128_128", TRTLLM, "llama-2-70b", "float8", "h100-80g", 2, 1024,
       128, 128, "static_throughput", 2657.0, "tok/s/GPU"),
    _m("trtllm_h100_llama2_70b_fp8_tp2_b64_2048_2048", TRTLLM, "llama-2-70b", "float8", "h100-80g", 2, 64,
       2048, 2048, "static_throughput", 547.0, "tok/s/GPU"),
    # Databricks: MBU at batch 1 (Figures 2-3, 512-token prompts; Llama2-70B, the smallest A100-40GB
    # system it fits being 4 GPUs) and time to first token (Table 1).
    _m("databricks_h100_llama2_70b_tp2_mbu", DATABRICKS, "llama-2-70b", "float16", "h100-80g", 2, 1, 512, 0,
       "mbu", 0.60, "fraction", calibrates="mbu"),
    _m("databricks_a100_40g_llama2_70b_tp4_mbu", DATABRICKS, "llama-2-70b", "float16", "a100-40g", 4, 1, 512, 0,
       "mbu", 0.55, "fraction"),
    _m("databricks_a100_40g_llama2_70b_tp4_ttft_512", DATABRICKS, "llama-2-70b", "float16", "a100-40g", 4, 1,
       512, 1, "ttft", 0.154, "s"),
    _m("databricks_a100_40g_llama2_70b_tp8_ttft_512", DATABRICKS, "llama-2-70b", "float16", "a100-40g", 8, 1,
       512, 1, "ttft", 0.114, "s"),
    # NVIDIA NIM 1.8.0, concurrency 1.
    _m("nim_h100_llama3_70b_fp8_tp2_itl_500_2000", NIM, "llama-3-70b", "float8", "h100-80g", 2, 1, 500, 2000,
       "itl", 0.01891, "s", calibrates="allreduce_latency_s"),
    _m("nim_h100_llama3_70b_fp8_tp2_itl_5000_500", NIM, "llama-3-70b", "float8", "h100-80g", 2, 1, 5000, 500,
       "itl", 0.01858, "s"),
    _m("nim_h100_llama3_70b_fp8_tp2_ttft_5000", NIM, "llama-3-70b", "float8", "h100-80g", 2, 1, 5000, 500,
       "ttft", 0.40677, "s", calibrates="fp8_speedup"),
    _m("nim_h100_llama3_70b_fp8_tp2_ttft_500", NIM, "llama-3-70b", "float8", "h100-80g", 2, 1, 500, 2000,
       "ttft", 0.04777, "s"),
    # vLLM nightly latency tests: 8 prompts of 32 tokens, 128 tokens generated each, mean latency.
    _m("vllm_h200_llama3_8b_b8_32_128", VLLM, "llama-3.1-8b", "bfloat16", "h200", 1, 8, 32, 128,
       "static_latency", 0.833421, "s", calibrates="step_overhead_s"),
    _m("vllm_h200_llama3_70b_tp4_b8_32_128", VLLM, "llama-3-70b", "bfloat16", "h200", 4, 8, 32, 128,
       "static_latency", 2.07753, "s"),
)


def simulate(m: Measurement, calibration: Calibration) -> float:
    """The timing model's figure for ``m``'s scenario, in ``m.unit``."""
    spec = MODELS[m.model].with_dtype(m.dtype)
    gpu = GPUS[m.gpu]
    model = TimingModel(spec, gpu, tp=m.tp, calibration=calibration)
    if m.kind == "ttft":
        return model.prefill(m.input_len).seconds
    if m.kind == "itl":
        return model.decode_step(m.batch, m.input_len + m.output_len // 2).seconds
    if m.kind == "mbu":
        tpot = model.decode_step(1, m.input_len).seconds
        moved = spec.weight_bytes + m.input_len * model.kv_bytes_per_token * m.tp
        return moved / tpot / (m.tp * gpu.bandwidth_bytes_per_s)
    if m.kind in ("static_latency", "static_throughput"):
        seconds = model.step([SeqWork(m.input_len, 0)] * m.batch).seconds
        for i in range(m.output_len - 1):
            seconds += model.decode_step(m.batch, m.input_len + i).seconds
        if m.kind == "static_latency":
            return seconds
        return m.batch * m.output_len / seconds / m.tp
    raise ValueError(f"unknown measurement kind {m.kind!r}")


def relative_error_pct(simulated: float, published: float) -> float:
    """100 × (simulated − published) ÷ published."""
    return 100.0 * (simulated - published) / published


def fit(start: Calibration | None = None, rounds: int = 50) -> Calibration:
    """The calibration whose fitted fields reproduce their rows exactly (the others from ``start``).

    Each field is solved by bisection against its row with the other fields held; the rounds
    repeat until no field moves (the couplings, e.g. the step overhead inside a TP decode step,
    are weak)."""
    cal = start if start is not None else Calibration()
    bounds = {"mfu": (0.01, 1.0), "mbu": (0.01, 1.0), "fp8_speedup": (0.25, 4.0),
              "allreduce_latency_s": (0.0, 1e-3), "step_overhead_s": (0.0, 0.05), "serial_fraction": (0.0, 1.0)}
    rows = [m for m in MEASUREMENTS if m.calibrates]
    for _ in range(rounds):
        before = cal
        for m in rows:
            assert m.calibrates is not None
            lo, hi = bounds[m.calibrates]
            low_sign = simulate(m, cal.with_overrides(**{m.calibrates: lo})) > m.published
            for _ in range(60):
                mid = (lo + hi) / 2
                if (simulate(m, cal.with_overrides(**{m.calibrates: mid})) > m.published) == low_sign:
                    lo = mid
                else:
                    hi = mid
            cal = cal.with_overrides(**{m.calibrates: (lo + hi) / 2})
        if all(abs(getattr(cal, f) - getattr(before, f)) <= 1e-9 * max(abs(getattr(cal, f)), 1e-12)
               for f in bounds):
            break
    return cal


def main() -> None:
    parser = base_parser(__doc__ or "")
    parser.add_argument("--fit", action="store_true", help="also re-derive the fitted calibration defaults")
    args = parser.parse_args()
    calibration = Calibration()
    report = Report()
    for name, citation in SOURCES.items():
        report.add(f"source_{name}", citation)
    held_out_errors: list[float] = []
    calibration_errors: list[float] = []
    for m in MEASUREMENTS:
        simulated = simulate(m, calibration)
        error = relative_error_pct(simulated, m.published)
        (calibration_errors if m.calibrates else held_out_errors).append(abs(error))
        report.add(m.key, m.describe())
        report.add(f"{m.key}_published", m.published, m.unit)
        report.add(f"{m.key}_sim", simulated, m.unit)
        report.add(f"{m.key}_error", error, "%")
    report.add("fidelity_rows", len(MEASUREMENTS))
    report.add("fidelity_calibration_rows", len(calibration_errors))
    report.add("fidelity_held_out_rows", len(held_out_errors))
    report.add("fidelity_held_out_within_target", sum(e <= TARGET_PCT for e in held_out_errors))
    report.add("fidelity_held_out_median_abs_error", statistics.median(held_out_errors), "%")
    report.add("fidelity_calibration_max_abs_error", max(calibration_errors), "%")
    report.add("fidelity_target", TARGET_PCT, "%")
    if args.fit:
        fitted = fit()
        for f in dataclasses.fields(Calibration):
            report.add(f"fit_{f.name}", float(getattr(fitted, f.name)))
            report.add(f"default_{f.name}", float(getattr(calibration, f.name)))
    report.emit(args.json)


if __name__ == "__main__":
    main()
