"""``pdrouter capacity``: the KV capacity table for a model on a GPU, at the smallest TP that fits.

The model's own figures (KV bytes per token and per request, weight bytes, the single-stream
decode ceiling at TP 1) are printed whatever the pool. When the requested TP leaves no room for
the pool (or for ``--min-concurrency`` requests), the output says so and plans the smallest
tensor-parallel size that fits instead; a table of every TP size follows. Exit code 0 whenever
the figures could be computed; ``--json`` carries ``fits`` and ``fit_tp``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json

from pdrouter.core.capacity import DEFAULT_BLOCK_SIZE, CapacityPlan, TpOption, TpSizing, plan_tp
from pdrouter.core.gpu import GPU_PRESETS, GiB, GpuSpec, get_gpu_preset
from pdrouter.core.model_spec import MODEL_PRESETS, ModelSpec, get_model_preset


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "capacity", help="KV capacity of a model on a GPU (KV/token, pool, blocks, concurrency, TP that fits)",
        description="Print a model's KV and weight figures on a GPU and the KV capacity plan per TP rank, "
                    "at the requested TP or, when that does not fit, at the smallest TP that does.",
        epilog="example: pdrouter capacity --model llama-3-70b --gpu h100 --context 4096 (does not fit at "
               "TP 1: plans the smallest TP that fits and lists every TP)")
    p.add_argument("--model", default="llama-3-8b", help="model preset (see --list)")
    p.add_argument("--gpu", default="h100-80g", help="GPU preset (see --list)")
    p.add_argument("--tp", type=int, default=1, help="tensor parallel size to plan first")
    p.add_argument("--context", type=int, default=4096, help="average context per request, tokens")
    p.add_argument("--utilization", type=float, default=None,
                   help="fraction of GPU memory the engine may use (default 0.9, or derived from --quota-gb)")
    p.add_argument("--quota-gb", type=float, default=None,
                   help="memory quota in GiB (HAMi nvidia.com/gpumem MiB ÷ 1024); derives the utilization")
    p.add_argument("--overhead-gb", type=float, default=2.0, help="activation/graph overhead, GiB")
    p.add_argument("--block-size", type=int, default=DEFAULT_BLOCK_SIZE, help="tokens per KV block")
    p.add_argument("--dtype", default=None, help="weight and KV dtype (default: the preset's)")
    p.add_argument("--min-concurrency", type=int, default=1, metavar="N",
                   help="a TP fits when its pool holds at least N requests of --context tokens (default 1)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--list", action="store_true", help="list model and GPU presets")
    p.set_defaults(func=run)


def _positive(name: str, value: float | None) -> None:
    if value is not None and value <= 0:
        raise ValueError(f"--{name} must be > 0, got {value}")


def run(args: argparse.Namespace) -> int:
    if args.list:
        return _print_presets(args.json)
    for name in ("tp", "context", "block_size", "quota_gb", "utilization", "min_concurrency"):
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
    sizing = plan_tp(
        spec, gpu, tp=args.tp, context=args.context, utilization=utilization,
        quota_bytes=None if args.quota_gb is None else int(args.quota_gb * GiB),
        block_size=args.block_size, overhead_bytes=int(args.overhead_gb * GiB), min_concurrency=args.min_concurrency)
    if args.json:
        print(json.dumps(sizing_as_dict(spec, gpu, sizing), indent=2))
    else:
        print(format_sizing(spec, gpu, sizing))
    return 0


def plan_as_dict(plan: CapacityPlan) -> dict[str, object]:
    out: dict[str, object] = dataclasses.asdict(plan)
    out["pool_tokens"] = plan.pool_tokens
    out["quota_utilization"] = plan.quota_utilization
    return out


def _option_as_dict(option: TpOption) -> dict[str, object]:
    plan = option.plan
    return {"tp": option.tp, "fits": option.fits, "weight_bytes_per_rank": option.weight_bytes_per_rank,
            "kv_pool_bytes": None if plan is None else plan.kv_pool_bytes,
            "max_concurrency": None if plan is None else plan.max_concurrency,
            "decode_tokens_per_s_bound": None if plan is None else plan.decode_tokens_per_s_bound,
            "reason": option.shortfall or None}


def sizing_as_dict(spec: ModelSpec, gpu: GpuSpec, sizing: TpSizing) -> dict[str, object]:
    """The plan's fields at ``fit_tp`` (absent when no TP fits), the model's figures under ``geometry``,
    ``fits`` (the requested TP fits), ``fit_tp`` (the TP planned; null when none fits) and every TP."""
    chosen = sizing.chosen
    out: dict[str, object] = {"model": spec.name, "gpu": gpu.name, "tp": sizing.requested_tp,
                              "context": sizing.figures.context, "utilization": sizing.utilization}
    if chosen is not None and chosen.plan is not None:
        out.update(plan_as_dict(chosen.plan))
    out.update({
        "fits": sizing.fits, "fit_tp": None if chosen is None else chosen.tp, "requested_tp": sizing.requested_tp,
        "min_concurrency": sizing.min_concurrency, "reason": sizing.requested.shortfall or None,
        "geometry": {"num_layers": spec.num_layers, "num_kv_heads": spec.num_kv_heads, "head_dim": spec.head_dim,
                     "dtype": spec.dtype, "param_count": spec.param_count,
                     "memory_bytes": gpu.memory_bytes, "bandwidth_bytes_per_s": gpu.bandwidth_bytes_per_s,
                     **dataclasses.asdict(sizing.figures)},
        "tp_options": [_option_as_dict(o) for o in sizing.options],
    })
    return out


def _gib(n: int) -> str:
    return f"{n / GiB:,.2f} GiB"


def _rows(rows: list[tuple[str, str]], width: int) -> list[str]:
    return [f"{k:<{width}}  {v}" for k, v in rows]


def format_sizing(spec: ModelSpec, gpu: GpuSpec, sizing: TpSizing) -> str:
    """The model's figures, what happens at the requested TP, the plan at the TP that fits, every TP."""
    fig = sizing.figures
    geometry = [
        ("model", f"{spec.name} ({spec.num_layers} layers, {spec.num_kv_heads} KV heads × {spec.head_dim}, "
                  f"{spec.dtype}, {spec.param_count / 1e9:.2f} B params)"),
        ("gpu", f"{gpu.name} ({_gib(gpu.memory_bytes)}, {gpu.bandwidth_bytes_per_s / 1e12:.2f} TB/s)"),
        ("weights", f"{_gib(fig.weight_bytes)} ({fig.weight_bytes / 1e9:.1f} GB)"),
        ("KV per token", f"{fig.kv_bytes_per_token / 1024:,.1f} KiB"),
        (f"KV per request ({fig.context} tokens)", _gib(fig.kv_bytes_per_request)),
        ("decode bound (1 stream)", f"{fig.decode_tokens_per_s_bound:,.1f} tok/s at TP 1 "
                                    f"({gpu.bandwidth_bytes_per_s / 1e12:.2f} TB/s ÷ {fig.weight_bytes / 1e9:.1f} GB)"),
    ]
    chosen = sizing.chosen
    plan_rows = [] if chosen is None or chosen.plan is None else _plan_rows(chosen.plan)
    width = max(len(k) for k, _ in geometry + plan_rows)
    lines = _rows(geometry, width)
    requested = sizing.requested
    wanted = "fits" if sizing.min_concurrency == 1 else (
        f"holds {sizing.min_concurrency} concurrent {fig.context}-token requests")
    if not requested.fits:
        lines += ["", f"does not fit at TP {requested.tp}: {requested.shortfall}"]
        if chosen is None:
            lines.append(f"no TP up to {sizing.options[-1].tp} {wanted} "
                         f"(powers of two dividing the {spec.num_kv_heads} KV heads)")
        else:
            lines.append(f"smallest TP that {wanted}: {chosen.tp}")
    if chosen is not None and chosen.plan is not None:
        lines += ["", f"plan at TP {chosen.tp}" + (" (per rank)" if chosen.tp > 1 else "")]
        lines += _rows(plan_rows, width)
    lines += ["", *_tp_table(sizing)]
    return "\n".join(lines)


def _plan_rows(plan: CapacityPlan) -> list[tuple[str, str]]:
    rows = [("utilization", f"{plan.utilization:.3f}")]
    if plan.tp > 1:
        rows += [("weights per rank", _gib(plan.weight_bytes_per_rank)),
                 ("KV per token per rank", f"{plan.kv_bytes_per_token / 1024:,.1f} KiB"),
                 (f"KV per request per rank ({plan.context} tokens)", _gib(plan.kv_bytes_per_request))]
    rows += [
        ("overhead", _gib(plan.overhead_bytes)),
        ("KV pool", _gib(plan.kv_pool_bytes)),
        (f"blocks ({plan.block_size} tokens each)", f"{plan.num_blocks:,} ({plan.pool_tokens:,} tokens)"),
        ("max concurrency", f"{plan.max_concurrency:,}" + (f" on {plan.tp} GPUs" if plan.tp > 1 else "")),
    ]
    if plan.tp > 1:
        rows.append(("decode bound (1 stream)", f"{plan.decode_tokens_per_s_bound:,.1f} tok/s at TP {plan.tp}"))
    if plan.quota_bytes is not None:
        rows.append(("memory quota", _gib(plan.quota_bytes)))
        rows.append(("utilization to configure", f"{plan.quota_utilization:.3f} (quota ÷ physical)"))
    return rows


def _tp_table(sizing: TpSizing) -> list[str]:
    chosen = sizing.chosen
    head = f"{'TP':>3}  {'weights/rank':>12}  {'KV pool/rank':>12}  {'max concurrency':>15}  {'per GPU':>7}  " \
           f"{'decode bound':>12}"
    lines = [head]
    for o in sizing.options:
        mark = "  <- plan" if chosen is not None and o.tp == chosen.tp else ""
        if o.plan is None:
            lines.append(f"{o.tp:>3}  {_gib(o.weight_bytes_per_rank):>12}  {'does not fit':>12}")
            continue
        p = o.plan
        lines.append(f"{o.tp:>3}  {_gib(o.weight_bytes_per_rank):>12}  {_gib(p.kv_pool_bytes):>12}  "
                     f"{p.max_concurrency:>15,}  {p.max_concurrency / o.tp:>7.1f}  "
                     f"{p.decode_tokens_per_s_bound:>6.1f} tok/s{mark}")
    return lines


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
