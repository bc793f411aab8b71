"""The torch engine on a CUDA GPU against the simulator's prediction, step by step (needs a GPU).

Builds a Llama-3-8B-geometry model with random bf16 weights directly on the device (no folder,
no download), a paged KV pool, and times the engine's own model step (``ModelRunner.run``, the
code the workers run) for decode batches of 1/8/32/128 sequences at a 1k context and for
prefills of 512, 2k and 8k tokens. Beside each figure it prints what
``pdrouter.engine.sim.timing.TimingModel`` predicts for the GPU preset ``--gpu`` (default h100) with
the calibration ``--calibration`` (default ``torch-eager``, the preset for this engine):
``<case>_measured_ms``, ``<case>_sim_ms``, ``<case>_error`` (sim ÷ measured − 1). The torch engine
is written for clarity, not speed (no CUDA graphs, no fused kernels); the ``torch-eager`` preset's
per-layer and per-step costs are estimates until these errors are fitted away (a calibration file
on top of the preset, ``docs/simulation.md``).

Without CUDA it prints ``cuda_available: 0`` and exits 0 (the test suite never needs a GPU).

    python benchmarks/gpu_calibration.py [--quick] [--json] [--gpu h100] [--calibration torch-eager]
"""

from __future__ import annotations

import time

import torch
from _report import Report, base_parser

from pdrouter.core.gpu import get_gpu_preset
from pdrouter.core.kv_layout import KvLayout
from pdrouter.core.model_spec import get_model_preset
from pdrouter.engine.kv_cache import KvCache
from pdrouter.engine.model import LlamaModel
from pdrouter.engine.model_runner import ModelRunner, WorkItem
from pdrouter.engine.sim.calibration import resolve_calibration
from pdrouter.engine.sim.timing import SeqWork, TimingModel

BLOCK = 16


def timed(runner: ModelRunner, items: list[WorkItem], repeats: int) -> float:
    """Median seconds of one ``runner.run(items)`` (logits included), after a warm-up."""
    sync = torch.cuda.synchronize if runner.device.type == "cuda" else (lambda: None)
    runner.run(items)
    sync()
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        runner.run(items)
        sync()
        samples.append(time.perf_counter() - start)
    return sorted(samples)[len(samples) // 2]


def main() -> None:
    parser = base_parser(__doc__ or "")
    parser.add_argument("--gpu", default="h100", help="the GPU preset the simulator predicts for")
    parser.add_argument("--calibration", default="torch-eager", help="the simulator's preset or calibration file")
    parser.add_argument("--model-preset", default="llama-3-8b", help="the geometry (tiny: a check of this script)")
    parser.add_argument("--device", default="cuda", help="cuda[:N]; cpu only to check the script itself")
    args = parser.parse_args()
    report = Report()
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        report.add("cuda_available", 0, "bool")
        report.emit(args.json)
        return
    spec = get_model_preset(args.model_preset)
    torch.manual_seed(0)
    with torch.device(device):
        model = LlamaModel(spec).to(torch.bfloat16)
    for p in model.parameters():
        torch.nn.init.normal_(p, std=0.02)
    batches = [1, 8] if args.quick else [1, 8, 32, 128]
    prefills = [512, 2048] if args.quick else [512, 2048, 8192]
    context = min(1024, spec.max_context - 1)
    prefills = [n for n in prefills if n <= spec.max_context]
    need = max(max(batches) * (context // BLOCK + 1), max(prefills) // BLOCK) + 8
    cache = KvCache(KvLayout.for_model(spec, need, BLOCK, "bfloat16"), device)
    runner = ModelRunner(model, cache)
    sim = TimingModel(spec, get_gpu_preset(args.gpu), calibration=resolve_calibration(args.calibration))
    report.add("cuda_available", int(device.type == "cuda"), "bool")
    report.add("device", torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu")
    repeats = 3 if args.quick else 10
    per_seq = context // BLOCK + 1
    for b in batches:
        items = [WorkItem([1], context, list(range(i * per_seq, (i + 1) * per_seq)), True) for i in range(b)]
        measured = timed(runner, items, repeats)
        predicted = sim.step([SeqWork(1, context)] * b).seconds
        report.add(f"decode_b{b}_measured_ms", measured * 1e3, "ms")
        report.add(f"decode_b{b}_sim_ms", predicted * 1e3, "ms")
        report.add(f"decode_b{b}_error", predicted / measured - 1)
    for n in prefills:
        items = [WorkItem([1] * n, 0, list(range(-(-n // BLOCK))), True)]
        measured = timed(runner, items, max(2, repeats // 3))
        predicted = sim.prefill(n).seconds
        report.add(f"prefill_{n}_measured_ms", measured * 1e3, "ms")
        report.add(f"prefill_{n}_sim_ms", predicted * 1e3, "ms")
        report.add(f"prefill_{n}_error", predicted / measured - 1)
    report.emit(args.json)


if __name__ == "__main__":
    main()
