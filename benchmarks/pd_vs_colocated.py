"""Colocated vs disaggregated serving on equal resources, through the router, with the real torch workers.

Built on ``pdrouter bench compare --backend torch``: both layouts get two worker processes of the
tiny model (two colocated workers, or one prefill + one decode worker), and the same seeded
Poisson workload (prompts of ``--input-len`` tokens, ``--output-len`` output tokens) at each rate of
``--rates`` goes through the router's OpenAI door. Per layout and rate it prints TTFT and ITL
(p50 / p99), output tokens/s, requests/s and goodput under the SLO, then the winner per rate.
Decode steps in a colocated worker share the engine with other requests' prefills (chunked), so
its ITL has a prefill-shaped tail; the disaggregated layout moves that conflict to the cluster and
pays a KV transfer instead. On a 2-core CPU box the layouts also share cores, so read the ratios,
not the absolute numbers; ``pdrouter bench compare`` on simulated GPUs is the study at scale.

    python benchmarks/pd_vs_colocated.py [--quick] [--json] [--rates 2,4,8]
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path

from _report import Report, base_parser


def main() -> None:
    parser = base_parser(__doc__ or "")
    parser.add_argument("--rates", default="2,4,8", help="requests/s, comma-separated")
    parser.add_argument("--requests", type=int, default=48, help="requests per rate and layout")
    parser.add_argument("--input-len", default="300")
    parser.add_argument("--output-len", default="32")
    parser.add_argument("--slo", default="ttft=1s,tpot=100ms")
    args = parser.parse_args()
    if args.quick:
        args.rates, args.requests = "4", 12
    with tempfile.TemporaryDirectory(prefix="pd-vs-colocated-") as tmp:
        argv = [sys.executable, "-m", "pdrouter", "bench", "compare", "--backend", "torch", "--gpus", "2",
                "--layouts", "colocated,1p1d", "--rates", args.rates, "--num-requests", str(args.requests),
                "--input-len", args.input_len, "--output-len", args.output_len, "--slo", args.slo,
                "--no-progress", "--json", "--out", tmp]
        done = subprocess.run(argv, capture_output=True, text=True, timeout=900)
        if done.returncode != 0:
            sys.exit(f"pdrouter bench compare failed ({done.returncode}):\n{done.stderr[-2000:]}")
        report = Path(json.loads(done.stdout)["report"])
        data = json.loads((report.parent / "compare.json").read_text())
    out = Report()
    for layout in data["layouts"]:
        name = layout["name"].replace("-", "_")
        for point in layout["points"]:
            s, tag = point["summary"], f"{name}_r{point['rate']:g}"
            out.add(f"{tag}_ttft_p50", s["ttft"]["p50"] * 1e3, "ms")
            out.add(f"{tag}_ttft_p99", s["ttft"]["p99"] * 1e3, "ms")
            out.add(f"{tag}_itl_p50", s["itl"]["p50"] * 1e3, "ms")
            out.add(f"{tag}_itl_p99", s["itl"]["p99"] * 1e3, "ms")
            out.add(f"{tag}_output_tokens_per_s", s["output_tokens_per_s"], "tok/s")
            out.add(f"{tag}_requests_per_s", s["request_rate"], "req/s")
            out.add(f"{tag}_goodput", s["goodput"] or 0.0, "req/s")
    for rate, winner in data["winners"]:
        out.add(f"best_r{rate:g}", winner)
    out.emit(args.json)


if __name__ == "__main__":
    main()
