"""Cross-check of ``pdrouter bench run`` against NVIDIA's AIPerf: one simulated cluster, one workload, both tools.

The cluster, the model folder (the llama-3-8b geometry with a character-level ``tokenizer.json``),
the workload and our side of the run are ``crosscheck_guidellm.py``'s: ``pdrouter up --backend sim
--prefill 1 --decode 1`` at time scale 1, ``--requests`` requests of ``--input-len`` prompt tokens and
exactly ``--output-len`` output tokens, streamed from ``/v1/completions`` at a constant ``--rate``
(ours replays the arrivals as a trace, AIPerf runs ``--arrival-pattern constant``). AIPerf sends the
output length as ``max_completion_tokens`` (its default), with ``ignore_eos``, and counts tokens from
the server's ``usage`` (``--use-server-token-count``); its prompts are its own synthetic text of the
same length in this tokenizer, each unique, so neither tool gets prefix-cache hits.

Printed for each of ``ttft_mean``, ``ttft_p50``, ``tpot_mean``, ``itl_mean``, ``e2e_mean`` and
``output_tokens_per_s``: ``<figure>_ours``, ``<figure>_aiperf`` and ``<figure>_diff_percent`` (AIPerf
relative to ours), then ``agreement_within_5pct``. Definitions side by side:

* TTFT and E2E: from the request's start to the first chunk with content / the end of the stream,
  both tools. AIPerf (aiohttp) starts its clock as it sends the request; ours before the HTTP client
  takes its connection, with the body already encoded.
* ITL: AIPerf's ``inter_token_latency`` is per request ``(last chunk − first chunk) / (output tokens −
  1)``, averaged over requests: that is our TPOT's definition (``tpot_mean``); our ITL is the mean of
  every gap between chunks, the same number when every chunk is one token (``tokens_per_chunk``).
* Output throughput: both output tokens ÷ the span from the first request's start to the last one's
  end.

``ttft_server_mean_*`` is the router's own TTFT during each tool's run (its histogram), the referee
between a client's clock and what the server did, and ``ttft_client_overhead_ms_*`` each tool's TTFT
minus it; ``cpu_busy_cores_*``, ``cluster_cpu_cores_*`` and ``load_tool_cpu_cores_*`` are the machine's,
the cluster's and the tool's cores during each run.

AIPerf is not a dependency of this project: install it in a virtual environment of its own
(``python -m venv /tmp/aiperf && /tmp/aiperf/bin/pip install aiperf``) and pass ``--aiperf``. Its start-up
(services, tokenizer, synthetic prompts) takes tens of seconds here, so ``--quick`` (20 requests each)
does not fit in 30 s.

    python benchmarks/crosscheck_aiperf.py [--quick] [--json] [--aiperf PATH] [--requests N] [--rate R]
        [--input-len N] [--output-len N] [--keep DIR]
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from _report import Report, base_parser
from crosscheck_guidellm import CpuSampler, diff_percent, ours_figures, run_ours, run_tool, server_ttft, warm_up
from crosscheck_guidellm import write_model as write_model_folder
from sim_fleet import cluster

DEFAULT_AIPERF = "/tmp/aiperf/bin/aiperf"
FIGURES = ("ttft_mean", "ttft_p50", "tpot_mean", "itl_mean", "e2e_mean", "output_tokens_per_s")


def run_aiperf(args: Any, base: str, folder: Path, work: Path,
               sampler: CpuSampler) -> tuple[dict[str, Any], list[str], float, float]:
    """AIPerf's constant-rate profile: (its summary export, its argv, its measured window's wall times)."""
    out = work / "aiperf"
    argv = [args.aiperf, "profile", "--model", "model", "--url", base, "--endpoint-type", "completions",
            "--streaming", "--tokenizer", str(folder), "--request-rate", f"{args.rate:g}", "--arrival-pattern",
            "constant", "--request-count", str(args.requests), "--prompt-input-tokens-mean", str(args.input_len),
            "--prompt-input-tokens-stddev", "0", "--prompt-output-tokens-mean", str(args.output_len),
            "--prompt-output-tokens-stddev", "0", "--extra-inputs", "ignore_eos:true", "--use-server-token-count",
            "--random-seed", "0", "--artifact-dir", str(out), "--ui-type", "none", "--no-gpu-telemetry"]
    log = work / "aiperf.log"
    started = time.time()
    with log.open("w") as sink:
        code, _ = run_tool(argv, sampler, stdout=sink, stderr=subprocess.STDOUT, cwd=work)
    found = sorted(out.rglob("profile_export_aiperf.json"))
    if code != 0 or not found:
        tail = "".join(log.read_text().splitlines(keepends=True)[-30:])
        raise RuntimeError(f"aiperf exited {code}:\n{tail}")
    summary = json.loads(found[-1].read_text())
    records = sorted(out.rglob("profile_export.jsonl"))
    first, last = started, time.time()
    if records:  # the measured requests' own span, from their records
        starts, ends = [], []
        for line in records[-1].read_text().splitlines():
            meta = json.loads(line).get("metadata") or {}
            if "request_start_ns" in meta and "request_end_ns" in meta:
                starts.append(meta["request_start_ns"] / 1e9)
                ends.append(meta["request_end_ns"] / 1e9)
        if starts:
            first, last = min(starts), max(ends)
    return summary, argv, first, last


def metric(summary: dict[str, Any], name: str, stat: str) -> float:
    found = summary.get(name)
    if found is None:
        found = next((m for m in summary.get("records", {}).values() if m.get("tag") == name), None)
    if not isinstance(found, dict) or found.get(stat) is None:
        return float("nan")
    return float(found[stat])


def aiperf_figures(summary: dict[str, Any]) -> dict[str, float]:
    return {"ttft_mean": metric(summary, "time_to_first_token", "avg"),
            "ttft_p50": metric(summary, "time_to_first_token", "p50"),
            "tpot_mean": metric(summary, "inter_token_latency", "avg"),
            "itl_mean": metric(summary, "inter_token_latency", "avg"),
            "e2e_mean": metric(summary, "request_latency", "avg"),
            "output_tokens_per_s": metric(summary, "output_token_throughput", "avg"),
            "completed": metric(summary, "request_count", "avg"),
            "failed": metric(summary, "error_request_count", "avg") if "error_request_count" in summary else 0.0,
            "output_tokens": metric(summary, "output_sequence_length", "avg"),
            "prompt_tokens": metric(summary, "input_sequence_length", "avg")}


def main() -> int:
    parser = base_parser(__doc__ or "")
    parser.add_argument("--aiperf", default=DEFAULT_AIPERF, help="the aiperf executable")
    parser.add_argument("--requests", type=int, default=100, help="requests per tool")
    parser.add_argument("--rate", type=float, default=4.0, help="constant arrival rate, requests/s")
    parser.add_argument("--input-len", type=int, default=256, help="prompt tokens")
    parser.add_argument("--output-len", type=int, default=64, help="output tokens (ignore_eos)")
    parser.add_argument("--keep", type=Path, default=None, help="keep the model folder, both runs and logs here")
    args = parser.parse_args()
    if args.quick:
        args.requests = 20
    if not (shutil.which(args.aiperf) or os.access(args.aiperf, os.X_OK)):
        print(f"crosscheck_aiperf: no aiperf at {args.aiperf}; install it in a separate venv "
              f"(python -m venv /tmp/aiperf && /tmp/aiperf/bin/pip install aiperf) and pass --aiperf PATH",
              file=sys.stderr)
        return 2
    if args.requests < 2 or not args.rate > 0 or args.input_len < 1 or args.output_len < 2:
        print("crosscheck_aiperf: need --requests >= 2, --rate > 0, --input-len >= 1, --output-len >= 2",
              file=sys.stderr)
        return 2
    report = Report()
    with tempfile.TemporaryDirectory(prefix="crosscheck-aiperf-") as tmp:
        work = args.keep or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        folder = write_model_folder(work / "model")
        with cluster(folder, 1, 1, 1.0) as (host, port, router, workers):
            base = f"http://{host}:{port}"
            metrics_url = base + "/metrics"
            asyncio.run(warm_up(base + "/v1", args.input_len, args.output_len))
            sampler = CpuSampler([router, *workers])
            sampler.start()
            s0 = server_ttft(metrics_url)
            document, ours_argv, ours_end = run_ours(args, base + "/v1", work, sampler)
            s1 = server_ttft(metrics_url)
            summary, aiperf_argv, first, last = run_aiperf(args, base, folder, work, sampler)
            s2 = server_ttft(metrics_url)
            sampler.stop()
        ours, theirs = ours_figures(document), aiperf_figures(summary)
        done = [r for r in document["requests"] if r["ok"]]
        ours["e2e_mean"] = sum(r["e2e_s"] for r in done) / max(len(done), 1) * 1e3
        ours_cpu = sampler.cores(ours_end - document["summary"]["duration_s"], ours_end)
        theirs_cpu = sampler.cores(first, last)
    print("ours:   " + " ".join(ours_argv), file=sys.stderr)
    print("aiperf: " + " ".join(aiperf_argv), file=sys.stderr)
    report.add("requests_per_tool", args.requests, "requests")
    report.add("rate", args.rate, "req/s")
    for tool, figures in (("ours", ours), ("aiperf", theirs)):
        report.add(f"completed_{tool}", float(figures["completed"]), "requests")
        report.add(f"prompt_tokens_{tool}", float(figures["prompt_tokens"]), "tokens")
        report.add(f"output_tokens_{tool}", float(figures["output_tokens"]), "tokens")
    report.add("tokens_per_chunk_ours", float(document["summary"]["tokens_per_chunk"] or float("nan")), "tokens")
    units = {"output_tokens_per_s": "tok/s"}
    agree = True
    for name in FIGURES:
        d = diff_percent(ours[name], theirs[name])
        agree = agree and abs(d) <= 5.0
        report.add(f"{name}_ours", ours[name], units.get(name, "ms"))
        report.add(f"{name}_aiperf", theirs[name], units.get(name, "ms"))
        report.add(f"{name}_diff_percent", d, "%")
    for tool, (a, b), figures in (("ours", (s0, s1), ours), ("aiperf", (s1, s2), theirs)):
        count = b[1] - a[1]
        mean = (b[0] - a[0]) / count * 1e3 if count else float("nan")
        report.add(f"ttft_server_mean_{tool}", mean, "ms")
        report.add(f"ttft_client_overhead_ms_{tool}", figures["ttft_mean"] - mean, "ms")
    for tool, (busy, fleet, own) in (("ours", ours_cpu), ("aiperf", theirs_cpu)):
        report.add(f"cpu_busy_cores_{tool}", busy, "cores")
        report.add(f"cluster_cpu_cores_{tool}", fleet, "cores")
        report.add(f"load_tool_cpu_cores_{tool}", own, "cores")
    report.add("agreement_within_5pct", int(agree))
    report.emit(args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
