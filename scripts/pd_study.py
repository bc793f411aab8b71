"""The colocated-vs-disaggregated study of docs/study/: every case is one ``pdrouter bench compare``.

Each case brings up every layout on 8 simulated H100s (``pdrouter up --backend sim``: the real
router, Redis, transfer path and scheduler, with the timing model's step times), runs the same Poisson
sweep against each (every point with prompts of its own, scored over its measured window), and keeps
its report, plots and figures under ``docs/study/<case>/``. Two SLOs are scored from the same
requests (those that arrived in each point's window):

* the study's SLO, ``ttft <= 1 s, tpot <= 50 ms`` (the compare's own report), and
* a tighter one that also bounds every inter-token gap (``itl <= 100 ms``): what a stalled decode
  step (a prefill chunk sharing the GPU) breaks first.

``docs/study/README.md`` is then rewritten from every case's figures: each layout's highest rate at
90% attainment under both SLOs, the best layout, the crossovers, the prefix hit rates against the
workload's, how long the case ran, the machine's load meanwhile and the simulated time it lost. Cases
already run are kept, so the study can be run a case at a time::

    python scripts/pd_study.py --list
    python scripts/pd_study.py --cases 8b-chat,8b-summarize
    python scripts/pd_study.py --summary-only

The simulated clocks run ``time_scale`` times slower than the modeled GPUs so this machine keeps up
(each report gives the share of simulated time that was late nonetheless).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from pdrouter.bench.compare import TIE, Layout, LayoutResult, max_rate_within, slo_attainment
from pdrouter.bench.stats import RequestRecord, Slo

ROOT = Path(__file__).resolve().parent.parent
STUDY = ROOT / "docs" / "study"
SLO = "ttft=1s,tpot=50ms"
TIGHT_SLO = "ttft=1s,tpot=50ms,itl=100ms"
ATTAINMENT = 90.0
LAYOUTS_8 = "colocated,2p6d,4p4d,6p2d"


@dataclass(frozen=True)
class Case:
    """One comparison: a model on 8 GPUs, a workload, the rates of its sweep."""

    name: str
    model: str
    tp: int
    layouts: str
    workload: list[str]
    rates: str
    time_scale: float
    point_duration: float
    note: str = ""


CASES = [
    Case("8b-chat", "llama-3-8b", 1, "colocated,4p4d", ["--workload", "chat"], "24,48", 12, 20),
    Case("8b-summarize", "llama-3-8b", 1, "colocated,4p4d", ["--workload", "summarize"], "16,32", 8, 24),
    Case("8b-rag", "llama-3-8b", 1, "colocated,4p4d", ["--workload", "rag"], "48,96", 20, 7),
    Case("70b-summarize", "llama-3-70b", 4, "colocated,1p1d", ["--workload", "summarize"], "3,5", 4, 45),
    Case("70b-chat", "llama-3-70b", 4, "colocated,1p1d", ["--workload", "chat"], "12,24", 7, 40),
    Case("70b-rag", "llama-3-70b", 4, "colocated,1p1d", ["--workload", "rag"], "16,32", 8, 15),
    Case("70b-generate", "llama-3-70b", 4, "colocated,1p1d", ["--workload", "generate"], "2,4", 6, 80,
         note="a 2,000-token answer lives 35–60 simulated seconds here, so each point sends 80 simulated seconds "
              "of arrivals (160–320 requests, 0.3–0.6 million output tokens)"),
]
"""Sized for a shared 2-core machine, in the order they run: every point spans about twice its first
requests' 90th-percentile lifetime (``point_duration``) and holds 60 or more requests; two layouts a
case (colocated and the balanced split), two rates around the limits an earlier study reported. The
time scale keeps the streamed tokens at about 1,000 a wall second or fewer, what this machine's router
and load generator pass on beside other work (8B chat at 48 req/s streams 14,400 simulated tokens a
second; 70B generate at 4 req/s, 8,000)."""


def timing_figures(model: str, tp: int) -> dict[str, float]:
    """The default timing model's step times for the case's model on an H100 (which model version the
    figures came from): a decode step of 1 and of 64 sequences at a 1,000-token context, a 1,000-token
    prefill, in ms."""
    from pdrouter.core.gpu import get_gpu_preset
    from pdrouter.core.model_spec import get_model_preset
    from pdrouter.engine.sim.timing import TimingModel

    timing = TimingModel(get_model_preset(model), get_gpu_preset("h100"), tp=tp)
    return {"decode_step_1_ms": round(timing.decode_step(1, 1000).seconds * 1e3, 2),
            "decode_step_64_ms": round(timing.decode_step(64, 1000).seconds * 1e3, 2),
            "prefill_1000_ms": round(timing.prefill(1000).seconds * 1e3, 2)}


def machine_busy() -> tuple[float, float]:
    """(CPU seconds all cores spent busy since boot, wall seconds since boot) from ``/proc``."""
    fields = [int(x) for x in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    busy = (sum(fields) - fields[3] - fields[4]) / os.sysconf("SC_CLK_TCK")
    return busy, float(Path("/proc/uptime").read_text().split()[0])


def run_case(case: Case, keep: Path | None) -> Path:
    """Run one case's compare into a scratch folder, copy its report into ``docs/study/<case>``."""
    scratch = Path(tempfile.mkdtemp(prefix=f"study-{case.name}-"))
    argv = [sys.executable, "-m", "pdrouter", "bench", "compare", "--gpus", "8", "--tp", str(case.tp),
            "--model-preset", case.model, "--gpu", "h100", "--layouts", case.layouts, "--rates", case.rates,
            "--time-scale", str(case.time_scale), "--point-duration", str(case.point_duration),
            "--slo", SLO, "--stop-below", "50", "--attainment", str(ATTAINMENT), "--out", str(scratch),
            *case.workload]
    started = time.monotonic()
    busy0, up0 = machine_busy()
    load0 = os.getloadavg()[0]
    print(f"{case.name}: {' '.join(argv[3:])}", flush=True)
    report = ""
    with subprocess.Popen(argv, stdout=subprocess.PIPE, text=True) as compare:
        assert compare.stdout is not None
        for line in compare.stdout:
            print(f"{case.name}: {line}", end="", flush=True)
            if line.startswith("report: "):
                report = line.split(" ", 1)[1].strip()
    if compare.returncode != 0 or not report:
        raise SystemExit(f"{case.name}: bench compare exited {compare.returncode}; its output is under {scratch}")
    busy1, up1 = machine_busy()
    folder = Path(report).parent
    out = STUDY / case.name
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    for path in folder.iterdir():
        if path.suffix in (".png", ".md") or path.name == "plots.json":
            shutil.copy2(path, out / path.name)
    data = json.loads((folder / "compare.json").read_text())
    tight = Slo.parse(TIGHT_SLO)
    for layout in data["layouts"]:
        for point in layout["points"]:
            window = point["window"]
            records = json.loads(Path(point.pop("file")).read_text())["requests"]
            measured = [r for r in records if window["start_s"] <= r["start_s"] <= window["end_s"]]
            met = sum(tight.met(record_of(r)) for r in measured)
            point["tight_slo_met_percent"] = slo_attainment({"slo_met": met, "requests": len(measured)})
    data["case"] = {"name": case.name, "model": case.model, "tp": case.tp, "gpu": "h100", "gpus": 8,
                    "layouts": case.layouts, "workload": case.workload, "rates": case.rates,
                    "time_scale": case.time_scale, "point_duration_s": case.point_duration, "slo": SLO,
                    "tight_slo": TIGHT_SLO, "attainment": ATTAINMENT, "note": case.note,
                    "command": "pdrouter " + " ".join(argv[3:]).replace(str(scratch), "<scratch>"),
                    "wall_minutes": round((time.monotonic() - started) / 60, 1),
                    "machine_busy_cores": round((busy1 - busy0) / max(up1 - up0, 1e-9), 2),
                    "machine_cores": os.cpu_count(), "load_average_start": round(load0, 1),
                    "load_average_end": round(os.getloadavg()[0], 1),
                    "timing_model": timing_figures(case.model, case.tp)}
    (out / "compare.json").write_text(json.dumps(data, indent=1) + "\n")
    if keep is None:
        shutil.rmtree(scratch, ignore_errors=True)
    print(f"{case.name}: done in {data['case']['wall_minutes']} min -> {out}", flush=True)
    return out


def record_of(d: dict[str, Any]) -> RequestRecord:
    names = {f.name for f in fields(RequestRecord)}
    return RequestRecord(**{k: v for k, v in d.items() if k in names})


def results_of(data: dict[str, Any]) -> list[LayoutResult]:
    """The layouts and points of a case's ``compare.json``."""
    tp = int(data["case"]["tp"])
    gpus = int(data["case"]["gpus"])
    return [LayoutResult(layout_of(layout["name"], gpus, tp), layout["points"]) for layout in data["layouts"]]


def layout_of(name: str, gpus: int, tp: int) -> Layout:
    """``colocated-N`` or ``XpYd`` back to the layout it names."""
    if name.startswith("colocated"):
        return Layout(name, colocated=gpus // tp, tp=tp)
    p, d = name[:-1].split("p")
    return Layout(name, prefill=int(p), decode=int(d), tp=tp)


def rewrite_report(folder: Path) -> None:
    """Rebuild a case's ``report.md`` and plots from its ``compare.json`` (after the report's format changed)."""
    from pdrouter.bench.compare_report import CompareSetup, write_compare_report

    data = json.loads((folder / "compare.json").read_text())
    case = data["case"]
    setup = CompareSetup(data["title"], Slo.parse(case["slo"]), case["attainment"], case["time_scale"], 50.0,
                         data.get("skipped") or {})
    saved = (folder / "compare.json").read_text()
    write_compare_report(results_of(data), folder, setup)
    (folder / "compare.json").write_text(saved)  # keep the case's own figures (tight SLO, the case)


def behind_points(results: list[LayoutResult], case: dict[str, Any]) -> list[str]:
    """The points whose ITL p50 is under half the modeled decode step of one sequence (no engine step is
    that short, so the client read chunks that had queued up behind a late router or a late client),
    and those the run found host-bound (``pdrouter.bench.host``: this machine's CPUs busy throughout)."""
    step_ms = (case.get("timing_model") or {}).get("decode_step_1_ms")
    out = []
    for r in results:
        for p in r.points:
            p50 = p["summary"]["itl"].get("p50")
            host = p.get("host") or {}
            if step_ms and p50 is not None and 1e3 * p50 < step_ms / 2:
                out.append(f"{r.layout.name} at {float(p['rate']):g} (ITL p50 {1e3 * p50:.1f} ms)")
            elif host.get("host_bound"):
                out.append(f"{r.layout.name} at {float(p['rate']):g} ({host['reason']})")
    return out


def best(kept: dict[str, float | None]) -> str:
    served = {n: v for n, v in kept.items() if v is not None}
    if not served:
        return "none met it at the lowest rate"
    top = max(served.values())
    names = [n for n, v in served.items() if v >= top * (1 - TIE)]
    return ", ".join(names) + f" ({top:g} req/s)"


def summary() -> Path:
    """``docs/study/README.md`` from every case's ``compare.json``."""
    lines = ["# Colocated vs disaggregated on 8 simulated H100s: the figures", "",
             "Written by `scripts/pd_study.py` from each case's `compare.json`; the findings and the method "
             "are in [docs/benchmarks.md](../benchmarks.md#the-study). Each cell is the highest offered rate "
             f"(req/s, Poisson) at which at least {ATTAINMENT:g}% of the measured requests (those that arrived in "
             "the point's steady window) met the SLO — at that rate and "
             "at every lower rate of the sweep; `<r` means even the lowest rate missed it, `≥r` that the highest "
             "rate tried held it (the layout's limit lies above).", "",
             f"SLO: `{SLO}`; tight SLO: `{TIGHT_SLO}` (every gap between two tokens ≤ 100 ms).", ""]
    for path in sorted(STUDY.glob("*/compare.json")):
        data = json.loads(path.read_text())
        case = data["case"]
        results = results_of(data)
        lowest = min(float(r) for r in case["rates"].split(","))
        kept = {r.layout.name: max_rate_within(r, ATTAINMENT) for r in results}
        tight_kept: dict[str, float | None] = {}
        for r in results:
            shares = sorted((float(p["rate"]), p.get("tight_slo_met_percent")) for p in r.points)
            best_rate = None
            for rate, share in shares:
                if share is None or share < ATTAINMENT:
                    break
                best_rate = rate
            tight_kept[r.layout.name] = best_rate
        workload = " ".join(case["workload"]).replace("--workload ", "")
        counts = [int(p["requests"]) for r in results for p in r.points]
        short = [f"{r.layout.name} at {p['rate']:g}" for r in results for p in r.points if not p["window"]["steady"]]
        hits = [(p["prefix"]["measured_hit_rate"], p["prefix"]["expected_hit_rate"]) for r in results
                for p in r.points if p["prefix"].get("measured_hit_rate") is not None]
        lines += [f"## [{case['name']}]({case['name']}/report.md): {case['model']} TP {case['tp']}, {workload}",
                  "", f"Rates {case['rates']} req/s; time scale {case['time_scale']:g}; "
                      f"{case['point_duration_s']:g} simulated seconds of arrivals per point "
                      + (f"({min(counts)}–{max(counts)} requests); " if min(counts) < max(counts)
                         else f"({min(counts)} requests); ")
                      + (f"too short for a steady window: {', '.join(short)}." if short
                         else "every point reached a steady window.")
                  + (f" Note: {case['note']}." if case.get("note") else ""), "",
                  f"`{case['command']}`: {case['wall_minutes']:g} minutes of wall time, the machine's "
                  f"{case['machine_cores']} cores {case['machine_busy_cores']:g} busy on average (load average "
                  f"{case['load_average_start']:g} at the start, {case['load_average_end']:g} at the end)."
                  + (" Timing model (H100, default preset): a decode step of 1 sequence {decode_step_1_ms:g} ms, "
                     "of 64 {decode_step_64_ms:g} ms, a 1,000-token prefill {prefill_1000_ms:g} ms.".format(
                         **case["timing_model"]) if case.get("timing_model") else ""), "",
                  "| SLO | " + " | ".join(kept) + " | best |", "| --- |" + " --- |" * (len(kept) + 1)]
        highest = max(float(r) for r in case["rates"].split(","))
        for label, table in (("study", kept), ("tight", tight_kept)):
            cells = [f"<{lowest:g}" if v is None else (f"≥{v:g}" if v >= highest else f"{v:g}")
                     for v in table.values()]
            lines.append(f"| {label} | " + " | ".join(cells) + f" | {best(table)} |")
        cross = data.get("crossovers") or []
        lines += ["", "Crossovers (study SLO, attainment per rate): "
                  + ("; ".join(f"{w0} → {w1} between {a:g} and {b:g} req/s" for a, b, w0, w1 in cross)
                     if cross else "none."), ""]
        if hits:
            low, high = 100 * min(m for m, _ in hits), 100 * max(m for m, _ in hits)
            lines += [f"Prefix hit rate of the measured requests: {low:.1f}%" + (f"–{high:.1f}%" if high > low else "")
                      + " (the workload allows at most "
                      + f"{100 * max(e for _, e in hits):.1f}%)"
                      + ("; **above it at some point**." if any(p["prefix"].get("flagged") for r in results
                                                                  for p in r.points) else "."), ""]
        late = [p["router"].get("sim_late_share") for r in results for p in r.points]
        late = [x for x in late if x is not None]
        if late:
            lines += [f"`sim_late_share`: at most {100 * max(late):.2f}% of a point's modeled step time ended late "
                      f"(median point {100 * sorted(late)[len(late) // 2]:.2f}%).", ""]
        behind = behind_points(results, case)
        if behind:
            step = (case.get("timing_model") or {}).get("decode_step_1_ms")
            bursts = f" (ITL p50 under half the modeled decode step of one sequence, {step:g} ms)" if step else ""
            lines += [f"Chunks reached the client in bursts{bursts}, or this machine's CPUs were busy throughout the "
                      "window: the router or the load generator fell behind on this machine, which `sim_late_share` "
                      f"does not see, so these points' TTFT and ITL measure the machine as well: {', '.join(behind)}.",
                      ""]
    path = STUDY / "README.md"
    path.write_text("\n".join(lines))
    return path


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cases", default="all", help="comma-separated case names (see --list), or all")
    parser.add_argument("--list", action="store_true", help="print the cases and exit")
    parser.add_argument("--summary-only", action="store_true", help="rewrite docs/study/README.md only")
    parser.add_argument("--keep-scratch", action="store_true", help="keep each compare's per-request files")
    parser.add_argument("--rewrite-reports", action="store_true",
                        help="rebuild every case's report.md and plots from its compare.json, then the summary")
    args = parser.parse_args()
    by_name = {c.name: c for c in CASES}
    if args.list:
        for c in CASES:
            print(f"{c.name}: {c.model} TP {c.tp}, {' '.join(c.workload)}, layouts {c.layouts}, rates {c.rates}, "
                  f"time scale {c.time_scale:g}")
        return 0
    if args.rewrite_reports:
        for path in sorted(STUDY.glob("*/compare.json")):
            rewrite_report(path.parent)
            print(f"rewrote {path.parent / 'report.md'}")
    elif not args.summary_only:
        names = list(by_name) if args.cases == "all" else [n.strip() for n in args.cases.split(",")]
        unknown = [n for n in names if n not in by_name]
        if unknown:
            parser.error(f"unknown case(s) {', '.join(unknown)}; --list shows them")
        for name in names:
            run_case(by_name[name], Path("keep") if args.keep_scratch else None)
    print(f"summary: {summary()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
