"""``pdrouter bench run``: a load test of any OpenAI-compatible endpoint (this router, vLLM, SGLang).

Prints the summary as ``name: value unit`` lines (or one JSON object with ``--json``), writes the
whole run (config, every request, summary, the router's scraped metrics) as JSON plus a Markdown
summary under ``--out``, and exits 0 when at least one request completed, 1 when none did, 2 for
bad arguments, 130 when interrupted (after writing what was measured).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pdrouter.core.errors import ConfigError, UnavailableError

if TYPE_CHECKING:
    from pdrouter.bench.stats import Slo, Summary

WORKLOADS = ("synthetic", "shared-prefix", "jsonl", "chat", "summarize", "generate")


def add_parser(sub: argparse._SubParsersAction) -> None:
    bench = sub.add_parser("bench", help="load-test an OpenAI-compatible endpoint (TTFT, TPOT, ITL, goodput)",
                           description="Load tests with the metric definitions of `vllm bench serve`.")
    bench_sub = bench.add_subparsers(dest="bench_command", metavar="SUBCOMMAND", required=True)
    p = bench_sub.add_parser("run", help="one run: a workload at an arrival process, every request timed",
                             description="Run one load test and summarise it (docs/benchmarks.md).")
    add_run_args(p)
    p.set_defaults(func=run_cmd)
    q = bench_sub.add_parser("sweep", help="the same workload over a list of rates, or a search for the highest "
                                           "rate meeting the SLO",
                             description="Run the workload at each --rates point (one JSON per point), or with "
                                         "--search find the highest Poisson rate at which --slo-percentile % of "
                                         "the requests meet --slo.")
    add_run_args(q)
    q.add_argument("--rates", default=None, help="comma-separated requests/s, e.g. 1,2,4,8")
    q.add_argument("--search", action="store_true", help="bisect for the highest rate meeting the SLO")
    q.add_argument("--slo-percentile", type=float, default=90.0,
                   help="--search: the share of requests (%%) that must meet --slo (90: the SLO at p90)")
    q.add_argument("--min-rate", type=float, default=0.5, help="--search: the lowest rate tried")
    q.add_argument("--max-rate", type=float, default=64.0, help="--search: the highest rate tried")
    q.add_argument("--steps", type=int, default=6, help="--search: runs of the bisection")
    q.set_defaults(func=sweep_cmd)
    c = bench_sub.add_parser("compare", help="colocated vs disaggregated layouts on equal simulated GPUs",
                             description="Bring up each layout on --gpus simulated GPUs with `pdrouter up "
                                         "--backend sim`, run the same sweep against each, and write a report "
                                         "with plots (docs/benchmarks.md).")
    c.add_argument("--backend", choices=["sim", "torch"], default="sim",
                   help="sim: simulated GPUs; torch: the tiny torch model on this machine, one worker per --gpus")
    c.add_argument("--gpus", type=int, default=8, help="simulated GPUs every layout gets (torch: workers)")
    c.add_argument("--layouts", default="all",
                   help="colocated and XpYd splits, e.g. colocated,2p6d,4p4d (all: every split)")
    c.add_argument("--tp", type=int, default=1, help="GPUs per worker (tensor parallel)")
    c.add_argument("--model-preset", default="llama-3-8b")
    c.add_argument("--gpu", default="h100", help="the simulated GPU preset")
    c.add_argument("--rates", default="1,2,4,8", help="comma-separated requests/s of the sweep")
    c.add_argument("--time-scale", type=float, default=1.0, help="the simulated workers' time scale")
    c.add_argument("--quick", action="store_true",
                   help="2 GPUs, colocated vs 1p1d, two rates, 16 short requests each (under 2 minutes)")
    c.add_argument("--point-duration", type=float, default=None,
                   help="simulated seconds of arrivals per point: each rate sends max(--num-requests, "
                        "rate × this) requests, so every point reaches the same steady state")
    c.add_argument("--warmup", type=int, default=None,
                   help="short requests sent to each layout before its sweep and not measured "
                        "(default: 2 per worker; 0: none)")
    c.add_argument("--stop-below", type=float, default=None,
                   help="skip a layout's higher rates once a point kept fewer than this %% of requests "
                        "within the SLO (its attainment only falls from there; saves the slowest runs)")
    c.add_argument("--attainment", type=float, default=90.0,
                   help="the SLO attainment (%% of requests within the SLO) a layout must keep; the "
                        "report gives each layout's highest rate that kept it")
    add_workload_args(c)
    c.set_defaults(func=compare_cmd)


def add_run_args(p: argparse.ArgumentParser) -> None:
    """The options of one run against an endpoint, shared by ``run`` and ``sweep``."""
    p.add_argument("--url", default="http://127.0.0.1:8000/v1", help="the endpoint's OpenAI base URL")
    p.add_argument("--model", default=None, help="model name (default: the first of GET {url}/models)")
    p.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"), help="Bearer key (env OPENAI_API_KEY)")
    p.add_argument("--rate", type=float, default=None, help="open loop: requests/s, Poisson (default: closed loop)")
    p.add_argument("--concurrency", type=int, default=None,
                   help="closed loop: requests in flight (default without --rate: all at once)")
    p.add_argument("--max-concurrency", type=int, default=None, help="open loop: cap on requests in flight")
    p.add_argument("--duration", type=float, default=None, help="stop sending after this many seconds")
    p.add_argument("--time-scale", type=float, default=1.0,
                   help="the simulated workers' --time-scale: latencies are reported ÷ this (simulated time)")
    p.add_argument("--metrics-url", default=None, help="the router's /metrics (default: beside --url)")
    p.add_argument("--no-metrics", action="store_true", help="do not scrape /metrics")
    add_workload_args(p)


def add_workload_args(p: argparse.ArgumentParser) -> None:
    """The workload and its reporting, shared by ``run``, ``sweep`` and ``compare``."""
    p.add_argument("--workload", choices=WORKLOADS, default="synthetic",
                   help="synthetic (--input-len/--output-len), shared-prefix (--prefixes × --prefix-len + "
                        "suffix), jsonl (--dataset), or a preset: chat, summarize (7,936 in / 200 out), "
                        "generate (200 in / 2k out)")
    p.add_argument("--input-len", default="512", help="prompt tokens: N | LO-HI | lognormal:MEAN:SIGMA")
    p.add_argument("--output-len", default="128", help="output tokens (sent as max_tokens with ignore_eos)")
    p.add_argument("--prefixes", type=int, default=4, help="shared-prefix: distinct system prompts")
    p.add_argument("--prefix-len", type=int, default=2048, help="shared-prefix: tokens of each system prompt")
    p.add_argument("--dataset", type=Path, default=None, help="jsonl: one request per line (docs/benchmarks.md)")
    p.add_argument("--num-requests", type=int, default=100)
    p.add_argument("--burstiness", type=float, default=1.0, help="gamma shape of the gaps (1: Poisson)")
    p.add_argument("--slo", default=None, help="goodput SLO, any of ttft,tpot,itl,e2e: e.g. ttft=500ms,tpot=50ms")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=600.0, help="seconds one request may take")
    p.add_argument("--out", type=Path, default=Path("bench-results"), help="folder for the run's JSON and Markdown")
    p.add_argument("--json", action="store_true", help="print the summary as one JSON object")
    p.add_argument("--no-progress", action="store_true", help="no progress line on stderr")


def _workload(args: argparse.Namespace) -> tuple[list[Any], str]:
    from pdrouter.bench import workload as w

    if args.num_requests <= 0:
        raise ConfigError(f"--num-requests must be >= 1, got {args.num_requests}")
    out_len = w.LengthDist.parse(args.output_len, "--output-len")
    if args.workload == "jsonl":
        if args.dataset is None:
            raise ConfigError("--workload jsonl needs --dataset FILE")
        specs = w.from_jsonl(args.dataset, seed=args.seed, default_output=int(out_len.mean))
        return specs[:args.num_requests], f"jsonl {args.dataset}"
    if args.workload == "shared-prefix":
        if args.prefixes <= 0 or args.prefix_len <= 0:
            raise ConfigError("--prefixes and --prefix-len must be >= 1")
        suffix = w.LengthDist.parse(args.input_len, "--input-len")
        specs = w.shared_prefix(args.num_requests, prefixes=args.prefixes, prefix_len=args.prefix_len,
                                suffix_len=suffix, output_len=out_len, seed=args.seed)
        return specs, f"shared-prefix {args.prefixes}×{args.prefix_len} + {args.input_len} in / {args.output_len} out"
    if args.workload in ("chat", "summarize", "generate"):
        in_len, out_len = w.preset(args.workload)
        label = args.workload
    else:
        in_len = w.LengthDist.parse(args.input_len, "--input-len")
        label = f"synthetic {args.input_len} in / {args.output_len} out"
    return w.synthetic(args.num_requests, in_len, out_len, seed=args.seed), label


def _metrics_url(args: argparse.Namespace) -> str | None:
    if args.no_metrics:
        return None
    if args.metrics_url:
        return str(args.metrics_url)
    base = args.url.rstrip("/")
    return (base[:-3] if base.endswith("/v1") else base) + "/metrics"


def _discover_model(url: str, api_key: str | None) -> str:
    import httpx

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        response = httpx.get(url.rstrip("/") + "/models", headers=headers, timeout=10.0)
        response.raise_for_status()
        return str(response.json()["data"][0]["id"])
    except (httpx.HTTPError, KeyError, IndexError, ValueError) as exc:
        raise ConfigError(f"cannot list the models at {url}/models ({exc.__class__.__name__}: {exc}); "
                          f"check --url or give --model") from None


@dataclass
class Outcome:
    """One run as written: its summary, its document and where it went."""

    summary: Summary
    document: dict[str, Any]
    path: Path
    interrupted: bool


@dataclass
class Prepared:
    """What every run of one command shares: the workload, the model, the SLO."""

    specs: list[Any]
    label: str
    model: str
    slo: Slo | None


def prepare(args: argparse.Namespace) -> Prepared:
    from pdrouter.bench.stats import Slo

    slo = Slo.parse(args.slo) if args.slo else None
    if args.time_scale < 0:
        raise ConfigError(f"--time-scale must be >= 0, got {args.time_scale}")
    if args.burstiness <= 0:
        raise ConfigError(f"--burstiness must be > 0, got {args.burstiness}")
    specs, label = _workload(args)
    model = args.model or _discover_model(args.url, args.api_key)
    return Prepared(specs, label, model, slo)


def execute(args: argparse.Namespace, prep: Prepared, rate: float | None, stem: str) -> Outcome:
    """One run at ``rate`` (None: closed loop), written as ``{stem}.json`` / ``.md`` under ``--out``."""
    from pdrouter.bench.report import markdown, run_document, write_json
    from pdrouter.bench.runner import Progress, RunConfig, run
    from pdrouter.bench.stats import summarize

    config = RunConfig(base_url=args.url, model=prep.model, rate=rate, burstiness=args.burstiness,
                       concurrency=args.concurrency, max_concurrency=args.max_concurrency,
                       duration_s=args.duration, seed=args.seed, metrics_url=_metrics_url(args),
                       api_key=args.api_key, timeout_s=args.timeout, time_scale=args.time_scale)
    progress = Progress(len(prep.specs), enabled=False if args.no_progress else None)
    result = asyncio.run(_interruptible(run(config, prep.specs, progress=progress)))
    scale = args.time_scale or 1.0
    records = [r.scaled(scale) for r in result.records]
    summary = summarize(records, result.duration_s / scale, prep.slo)
    arrivals = (f"Poisson {rate:g}/s" + (f", burstiness {args.burstiness}" if args.burstiness != 1 else "")
                if rate else f"closed loop, {args.concurrency or len(prep.specs)} in flight")
    cfg = {"base_url": args.url, "model": prep.model, "workload": prep.label, "arrivals": arrivals,
           "num_requests": len(prep.specs), "rate": rate, "burstiness": args.burstiness,
           "concurrency": args.concurrency, "max_concurrency": args.max_concurrency, "duration_s": args.duration,
           "slo": prep.slo.describe() if prep.slo else None, "time_scale": args.time_scale, "seed": args.seed,
           "started_at": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    document = run_document(cfg, summary, [r.to_dict() for r in records], result.samples, result.interrupted)
    path = write_json(args.out / f"{stem}.json", document)
    (args.out / f"{stem}.md").write_text(markdown(document))
    return Outcome(summary, document, path, result.interrupted)


def _print_run(outcome: Outcome, as_json: bool) -> None:
    document = outcome.document
    if as_json:
        print(json.dumps({"summary": document["summary"], "router": document["router"], "file": str(outcome.path)}))
        return
    for line in outcome.summary.lines():
        print(line)
    for key, value in document["router"].items():
        if isinstance(value, dict):
            value = max(value.values(), default=None)
            key += "_max_worker"
        print(f"{key}: {'–' if value is None else (f'{value:.4g}' if isinstance(value, float) else value)}")
    print(f"results: {outcome.path}")


def _exit_code(outcome: Outcome, args: argparse.Namespace, model: str) -> int:
    if outcome.interrupted:
        return 130
    if outcome.summary.completed == 0:
        records = outcome.document["requests"]
        first = next((r["error"] for r in records if r.get("error")), "no request")
        print(f"pdrouter bench: error: no request completed (first error: {first}); "
              f"is {args.url} serving {model}?", file=sys.stderr)
        return 1
    return 0


def run_cmd(args: argparse.Namespace) -> int:
    prep = prepare(args)
    outcome = execute(args, prep, args.rate, time.strftime("%Y%m%d-%H%M%S") + f"-{args.workload}")
    _print_run(outcome, args.json)
    return _exit_code(outcome, args, prep.model)


def _rates(text: str) -> list[float]:
    try:
        rates = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ConfigError(f"--rates must be comma-separated numbers, got {text!r}") from None
    if not rates or any(not r > 0 for r in rates):
        raise ConfigError(f"--rates must list rates > 0 requests/s, got {text!r}")
    return rates


def sweep_cmd(args: argparse.Namespace) -> int:
    """Each rate of ``--rates`` (or the bisection of ``--search``), one run and one JSON each, then a summary."""
    if args.search == (args.rates is not None):
        raise ConfigError("give exactly one of --rates LIST and --search")
    if args.search:
        if not args.slo:
            raise ConfigError("--search needs --slo (the bound the rate must meet)")
        if not 0 < args.slo_percentile <= 100:
            raise ConfigError(f"--slo-percentile must be in (0, 100], got {args.slo_percentile}")
        if not 0 < args.min_rate < args.max_rate:
            raise ConfigError("--min-rate must be > 0 and below --max-rate")
        if args.steps < 1:
            raise ConfigError(f"--steps must be >= 1, got {args.steps}")
    rates = _rates(args.rates) if args.rates is not None else []
    prep = prepare(args)
    stem = time.strftime("%Y%m%d-%H%M%S") + f"-{args.workload}-sweep"
    points: list[dict[str, Any]] = []

    def point(rate: float) -> Outcome:
        outcome = execute(args, prep, rate, f"{stem}/rate-{rate:g}")
        s = outcome.summary
        share = 100.0 * (s.slo_met or 0) / s.requests if s.requests and s.slo_met is not None else None
        points.append({"rate": rate, "file": str(outcome.path), "summary": outcome.document["summary"],
                       "router": outcome.document["router"], "slo_met_percent": share})
        if not args.json:
            print(f"rate {rate:g}/s: goodput {s.goodput if s.goodput is not None else float('nan'):.3g} req/s, "
                  f"TTFT p99 {s.ttft.p99 * 1e3:.1f} ms, TPOT p99 {s.tpot.p99 * 1e3:.1f} ms"
                  + (f", {share:.0f}% within the SLO" if share is not None else ""), flush=True)
        return outcome

    best: float | None = None
    interrupted = False
    if args.search:
        lo, hi = args.min_rate, args.max_rate
        for _ in range(args.steps):
            rate = (lo * hi) ** 0.5  # bisect in log space: rates span orders of magnitude
            outcome = point(rate)
            interrupted = outcome.interrupted
            if interrupted:
                break
            share = points[-1]["slo_met_percent"] or 0.0
            if share >= args.slo_percentile:
                best, lo = rate, rate
            else:
                hi = rate
    else:
        for rate in rates:
            interrupted = point(rate).interrupted
            if interrupted:
                break
    sweep = {"config": {"workload": prep.label, "model": prep.model, "url": args.url,
                        "slo": prep.slo.describe() if prep.slo else None,
                        "slo_percentile": args.slo_percentile if args.search else None,
                        "search": bool(args.search)},
             "points": sorted(points, key=lambda p: p["rate"]), "best_rate": best, "interrupted": interrupted}
    path = args.out / stem / "sweep.json"
    path.write_text(json.dumps(sweep, indent=1, default=str) + "\n")
    if args.json:
        print(json.dumps({"best_rate": best, "points": len(points), "file": str(path)}))
    else:
        if args.search:
            print(f"best_rate: {'–' if best is None else f'{best:.4g}'} req/s")
        print(f"results: {path}")
    if interrupted:
        return 130
    return 0 if any(p["summary"]["completed"] for p in points) else 1


def compare_cmd(args: argparse.Namespace) -> int:
    """Each layout up in turn, the same sweep against each, then plots and a Markdown verdict."""
    from pdrouter.bench.compare import LayoutResult, bring_up, parse_layouts, slo_attainment
    from pdrouter.bench.stats import Slo
    from pdrouter.core.gpu import get_gpu_preset
    from pdrouter.core.model_spec import get_model_preset
    from pdrouter.engine.model_folder import write_config_folder

    if args.quick:
        args.gpus, args.layouts, args.rates, args.num_requests = 2, "colocated,1p1d", "4,8", 16
        args.input_len, args.output_len = "256", "16"
    if args.backend == "torch" and args.tp != 1:
        raise ConfigError("--backend torch runs one CPU worker per --gpus; --tp applies to simulated GPUs")
    layouts = parse_layouts(args.layouts, args.gpus, args.tp)
    rates = _rates(args.rates)
    spec = get_model_preset(args.model_preset if args.backend == "sim" else "tiny")
    get_gpu_preset(args.gpu)
    slo = Slo.parse(args.slo) if args.slo else Slo.parse("ttft=1s,tpot=50ms")
    if not 0 < args.attainment <= 100:
        raise ConfigError(f"--attainment must be in (0, 100], got {args.attainment}")
    if args.point_duration is not None and not args.point_duration > 0:
        raise ConfigError(f"--point-duration must be > 0 seconds, got {args.point_duration}")
    if args.stop_below is not None and not 0 < args.stop_below <= 100:
        raise ConfigError(f"--stop-below must be in (0, 100], got {args.stop_below}")
    if args.warmup is not None and args.warmup < 0:
        raise ConfigError(f"--warmup must be >= 0 requests, got {args.warmup}")
    base_requests = args.num_requests
    args.num_requests = max(base_requests, math.ceil(max(rates) * (args.point_duration or 0)))
    specs, label = _workload(args)
    args.num_requests = base_requests
    stem = args.out / (time.strftime("%Y%m%d-%H%M%S") + "-compare")
    if args.backend == "sim":
        folder = write_config_folder(spec, stem / "model" / f"sim-{spec.name}")
    else:
        from pdrouter.engine.model_io import make_model  # torch, for this backend only

        folder = make_model("tiny", 0, stem / "model" / "tiny")
    prep = Prepared(specs, label, folder.name, slo)
    run_args = argparse.Namespace(**vars(args))
    run_args.concurrency = run_args.max_concurrency = run_args.duration = None
    run_args.metrics_url, run_args.no_metrics, run_args.api_key = None, False, None
    results: list[LayoutResult] = []
    for layout in layouts:
        result = LayoutResult(layout)
        results.append(result)
        with bring_up(layout, folder, gpu=args.gpu, time_scale=args.time_scale, backend=args.backend) as cluster:
            run_args.url = cluster.url
            warm_up(run_args, prep, layout, args.warmup)
            for rate in rates:
                if result.points and args.stop_below is not None and \
                        (result.points[-1]["slo_met_percent"] or 0.0) < args.stop_below:
                    if not args.json:
                        print(f"{layout.name:>12}: below {args.stop_below:g}% within the SLO; higher rates "
                              f"skipped", flush=True)
                    break
                n = max(base_requests, math.ceil(rate * args.point_duration)) if args.point_duration else len(specs)
                point_prep = Prepared(specs[:n], label, prep.model, slo)
                outcome = execute(run_args, point_prep, rate, f"{stem.name}/{layout.name}/rate-{rate:g}")
                summary = outcome.document["summary"]
                result.points.append({"rate": rate, "summary": summary, "router": outcome.document["router"],
                                      "slo_met_percent": slo_attainment(summary), "file": str(outcome.path)})
                s = outcome.summary
                if not args.json:
                    errors = ", ".join(f"{k}: {v}" for k, v in sorted(s.errors.items()))
                    print(f"{layout.name:>12} @ {rate:g}/s: goodput {s.goodput or 0:.3g} req/s, TTFT p99 "
                          f"{s.ttft.p99 * 1e3:.1f} ms, ITL p99 {s.itl.p99 * 1e3:.1f} ms"
                          + (f", failed {s.failed} ({errors})" if s.failed else ""), flush=True)
                if s.completed == 0 and s.failed:
                    first = next((r["error"] for r in outcome.document["requests"] if r.get("error")), "")
                    raise UnavailableError(f"every request to {layout.name} at {rate:g}/s failed ({first}); "
                                           f"check the workload against the model (context, vocabulary): "
                                           f"{outcome.path}")
                if outcome.interrupted:
                    return 130
    report = write_compare_report(results, stem, args, label, slo.describe())
    if args.json:
        print(json.dumps({"report": str(report), "layouts": [r.layout.name for r in results]}))
    else:
        print(f"report: {report}")
    return 0


def warm_up(args: argparse.Namespace, prep: Prepared, layout: Any, count: int | None) -> None:
    """Send ``count`` short requests (default: 2 per worker), two per worker at a time, and discard
    them: a fresh cluster's first requests pay for connections being opened and code paths run for
    the first time, which would otherwise land in the sweep's first point. Their prompts share nothing
    with the workload's, so no prefix is cached for it. A warm-up that fails stops the comparison."""
    from pdrouter.bench import workload as w
    from pdrouter.bench.runner import RunConfig, run

    workers = layout.colocated + layout.prefill + layout.decode
    count = 2 * workers if count is None else count
    if count == 0:
        return
    specs = w.synthetic(count, w.LengthDist.parse("64", "warm-up"), w.LengthDist.parse("4", "warm-up"),
                        seed=args.seed + 7919)
    config = RunConfig(base_url=args.url, model=prep.model, concurrency=min(count, 2 * workers),
                       timeout_s=args.timeout, time_scale=args.time_scale)
    result = asyncio.run(_interruptible(run(config, specs)))
    failed = [r for r in result.records if not r.ok]
    if result.interrupted:
        raise KeyboardInterrupt
    if failed:
        raise UnavailableError(f"{layout.name}: {len(failed)} of {count} warm-up requests failed "
                               f"(first: {failed[0].error})")


def write_compare_report(results: list[Any], out: Path, args: argparse.Namespace, workload: str,
                         slo: str) -> Path:
    """``compare.json`` (every point), the plots and ``report.md``: per rate the SLO attainment and the
    layout that kept the most requests within the SLO (ties within 3%), why, the crossovers, each
    layout's highest rate at ``--attainment`` %, goodput in req/s, and the router-side figures."""
    from pdrouter.bench.compare import best_by_rate, crossovers, max_rate_within, why
    from pdrouter.bench.plots import write_plots

    title = (f"{args.model_preset} on {args.gpus}× {args.gpu} (TP {args.tp}), {workload}, SLO {slo}"
             if args.backend == "sim" else f"tiny torch model on {args.gpus} CPU workers, {workload}, SLO {slo}")
    plots = write_plots(results, out, title)
    winners = best_by_rate(results, "slo_met_percent")
    cross = crossovers(winners)
    kept = {r.layout.name: max_rate_within(r, args.attainment) for r in results}
    (out / "compare.json").write_text(json.dumps(
        {"title": title, "layouts": [{"name": r.layout.name, "gpus": r.layout.gpus, "points": r.points}
                                     for r in results],
         "winners": winners, "crossovers": cross, "attainment_target": args.attainment,
         "max_rate_within": kept}, indent=1, default=str) + "\n")
    names = [r.layout.name for r in results]
    rates_tried = [rate for rate, _ in winners] or [0.0]

    def table(key: str, fmt: Any) -> list[str]:
        rows = ["| rate | " + " | ".join(names) + " |", "| --- |" + " --- |" * len(names)]
        for rate, _ in winners:
            cells = [dict(r.curve(key)).get(rate) for r in results]
            rows.append(f"| {rate:g} | " + " | ".join("–" if v is None else fmt(v) for v in cells) + " |")
        return rows

    lines = [f"# {title}", "",
             "SLO attainment: the share of requests that met every bound (failures count as misses), the "
             "layout keeping the most (within 3%: a tie) and why:", "",
             "| rate | " + " | ".join(names) + " | best | why |", "| --- |" + " --- |" * (len(names) + 2)]
    for rate, winner in winners:
        cells = [dict(r.curve("slo_met_percent")).get(rate) for r in results]
        lines.append(f"| {rate:g} | " + " | ".join("–" if v is None else f"{v:.0f}%" for v in cells)
                     + f" | {winner} | {why(results, rate, winner)} |")
    if args.stop_below is not None:
        lines += ["", f"–: not run (the layout kept under {args.stop_below:g}% at a lower rate)."]
    lines += ["", "Crossovers: " + ("; ".join(f"between {a:g} and {b:g} req/s the best layout changes from "
                                                f"{w0} to {w1}" for a, b, w0, w1 in cross)
                                     if cross else "none: the same layout (or tie) is best at every rate tried."), ""]
    lines += [f"Highest rate each layout served with at least {args.attainment:g}% of requests within the SLO "
              "(DistServe's goodput; every lower rate of the sweep held it too):", "",
              "| layout | GPUs | highest rate | per GPU |", "| --- | --- | --- | --- |"]
    for r in results:
        v = kept[r.layout.name]
        held_all = v is not None and v >= max(rates_tried)
        lines.append(f"| {r.layout.name} | {r.layout.gpus} | "
                     + ("below the lowest rate | – |" if v is None else
                        f"{'≥ ' if held_all else ''}{v:g} req/s{' (the highest tried)' if held_all else ''} | "
                        f"{v / r.layout.gpus:.3g} |"))
    served = [(v, n) for n, v in kept.items() if v is not None]
    if served:
        top = max(v for v, _ in served)
        best = [n for v, n in served if v == top]
        lines += ["", f"**{' and '.join(best)}** {'serve' if len(best) > 1 else 'serves'} the highest rate "
                      f"at {args.attainment:g}% attainment ({top:g} req/s)."]
    lines += ["", "Goodput as `vllm bench serve` reports it (requests within the SLO ÷ the run's duration, "
                  "the drain after the last arrival included), req/s:", ""]
    lines += table("goodput", lambda v: f"{v:.2f}")
    lines += ["", "TTFT p99 (ms):", "", *table("ttft_p99", lambda v: f"{v * 1e3:.0f}")]
    lines += ["", "ITL p99 (ms):", "", *table("itl_p99", lambda v: f"{v * 1e3:.1f}")]
    lines += ["", "| layout | GPUs | KV water level peak | prefix hit rate | admission queue peak | "
                  "simulated time lost to this machine |", "| --- | --- | --- | --- | --- | --- |"]
    for r in results:
        peaks = [max((p["router"].get("kv_water_level_peak") or {0: 0}).values(), default=0) for p in r.points]
        hits = [p["router"].get("prefix_hit_rate") for p in r.points if p["router"].get("prefix_hit_rate") is not None]
        queues = [p["router"].get("admission_queue_peak") or 0 for p in r.points]
        late = [p["router"]["sim_late_share"] for p in r.points if p["router"].get("sim_late_share") is not None]
        lines.append(f"| {r.layout.name} | {r.layout.gpus} | {max(peaks, default=0):.2f} | "
                     f"{(sum(hits) / len(hits)) if hits else float('nan'):.2f} | {max(queues, default=0):g} | "
                     + (f"{100 * max(late):.2f}% (worst point)" if late else "–") + " |")
    lines += [""] + [f"![{p.stem}]({p.name})" for p in plots]
    path = out / "report.md"
    path.write_text("\n".join(lines) + "\n")
    return path


async def _interruptible(coro: Any) -> Any:
    """Run ``coro``; SIGINT/SIGTERM cancel it (the run then returns what it measured)."""
    task = asyncio.ensure_future(coro)
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError, RuntimeError):
            loop.add_signal_handler(sig, task.cancel)
    try:
        return await task
    finally:
        for sig in (signal.SIGINT, signal.SIGTERM):
            with contextlib.suppress(NotImplementedError, RuntimeError):
                loop.remove_signal_handler(sig)
