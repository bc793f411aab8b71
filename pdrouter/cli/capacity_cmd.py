"""``pdrouter capacity``: the KV capacity table for a model on a GPU."""

from __future__ import annotations

import argparse
import dataclasses
import json

from pdrouter.core.capacity import DEFAULT_BLOCK_SIZE, CapacityPlan, plan_capacity
from pdrouter.core.gpu import GPU_PRESETS, GiB, get_gpu_preset
from pdrouter.core.model_spec import MODEL_PRESETS, get_model_preset


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "capacity", help="KV capacity of a model on a GPU (KV/token, pool, blocks, concurrency)",
        description="Print the KV capacity plan for a model on one GPU (per TP rank).",
        epilog="example: pdrouter capacity --model llama-3-70b --gpu h100 --tp 8 --context 4096 "
               "--utilization 0.9")
    p.add_argument("--model", default="llama-3-8b", help="model preset (see --list)")
    p.add_argument("--gpu", default="h100-80g", help="GPU preset (see --list)")
    p.add_argument("--tp", type=int, default=1, help="tensor parallel size")
    p.add_argument("--context", type=int, default=4096, help="average context per request, tokens")
    p.add_argument("--utilization", type=float, default=None,
                   help="fraction of GPU memory the engine may use (default 0.9, or derived from --quota-gb)")
    p.add_argument("--quota-gb", type=float, default=None,
                   help="memory quota in GiB (HAMi nvidia.com/gpumem MiB ÷ 1024); derives the utilization")
    p.add_argument("--overhead-gb", type=float, default=2.0, help="activation/graph overhead, GiB")
    p.add_argument("--block-size", type=int, default=DEFAULT_BLOCK_SIZE, help="tokens per KV block")
    p.add_argument("--dtype", default=None, help="weight and KV dtype (default: the preset's)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--list", action="store_true", help="list model and GPU presets")
    p.set_defaults(func=run)


def _positive(name: str, value: float | None) -> None:
    if value is not None and value <= 0:
        raise ValueError(f"--{name} must be > 0, got {value}")


def run(args: argparse.Namespace) -> int:
    if args.list:
        return _print_presets(args.json)
    for name in ("tp", "context", "block_size", "quota_gb", "utilization"):
        _positive(name.replace("_", "-"), getattr(args, name))
    if args.overhead_gb < 0:
        raise ValueError(f"--overhead-gb must be >= 0, got {args.overhead_gb}")
    spec = get_model_preset(args.model)
    if args.dtype:
        spec = spec.with_dtype(args.dtype)
    gpu = get_gpu_preset(args.gpu)
    utilization = args.utilization
    if utilization is None and args.quota_gb is None:
        utilization = 0.9
    plan = plan_capacity(
        spec, gpu, tp=args.tp, context=args.context, utilization=utilization,
        quota_bytes=None if args.quota_gb is None else int(args.quota_gb * GiB),
        block_size=args.block_size, overhead_bytes=int(args.overhead_gb * GiB))
    if args.json:
        print(json.dumps(plan_as_dict(plan), indent=2))
    else:
        print(format_plan(plan))
    return 0


def plan_as_dict(plan: CapacityPlan) -> dict[str, object]:
    out: dict[str, object] = dataclasses.asdict(plan)
    out["pool_tokens"] = plan.pool_tokens
    out["quota_utilization"] = plan.quota_utilization
    return out


def _gib(n: int) -> str:
    return f"{n / GiB:,.2f} GiB"


def format_plan(plan: CapacityPlan) -> str:
    rows = [
        ("model", f"{plan.model} (TP={plan.tp})"),
        ("gpu", f"{plan.gpu} ({_gib(plan.memory_bytes)})"),
        ("utilization", f"{plan.utilization:.3f}"),
        ("weights per rank", _gib(plan.weight_bytes_per_rank)),
        ("overhead", _gib(plan.overhead_bytes)),
        ("KV per token", f"{plan.kv_bytes_per_token / 1024:,.1f} KiB"),
        (f"KV per request ({plan.context} tokens)", _gib(plan.kv_bytes_per_request)),
        ("KV pool", _gib(plan.kv_pool_bytes)),
        (f"blocks ({plan.block_size} tokens each)", f"{plan.num_blocks:,} ({plan.pool_tokens:,} tokens)"),
        ("max concurrency", f"{plan.max_concurrency:,}"),
        ("decode bound (1 stream)", f"{plan.decode_tokens_per_s_bound:,.1f} tok/s"),
    ]
    if plan.quota_bytes is not None:
        rows.append(("memory quota", _gib(plan.quota_bytes)))
        rows.append(("utilization to configure", f"{plan.quota_utilization:.3f} (quota ÷ physical)"))
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)


def _print_presets(as_json: bool) -> int:
    models = {n: {"layers": m.num_layers, "kv_heads": m.num_kv_heads, "head_dim": m.head_dim,
                  "params_b": round(m.param_count / 1e9, 2), "dtype": m.dtype}
              for n, m in MODEL_PRESETS.items()}
    gpus = {n: {"memory_gib": g.memory_gib, "bandwidth_tb_s": g.bandwidth_bytes_per_s / 1e12,
                "bf16_tflops": g.bf16_flops / 1e12} for n, g in GPU_PRESETS.items()}
    if as_json:
        print(json.dumps({"models": models, "gpus": gpus}, indent=2))
        return 0
    print("models:")
    for n, m in models.items():
        print(f"  {n:<14} {m['params_b']:>7} B params  {m['layers']:>3} layers  "
              f"{m['kv_heads']:>2} KV heads × {m['head_dim']}  {m['dtype']}")
    print("gpus:")
    for n, g in gpus.items():
        print(f"  {n:<14} {g['memory_gib']:>5.0f} GiB  {g['bandwidth_tb_s']:.2f} TB/s  "
              f"{g['bf16_tflops']:.0f} TFLOP/s bf16")
    return 0
