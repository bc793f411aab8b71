"""What ``pdrouter bench compare`` leaves behind: ``compare.json``, the plots and ``report.md``.

The report reads the figures of each point's measured window (``pdrouter.bench.window``): per rate
the SLO attainment and the layout keeping the most requests within the SLO (within ``TIE``: a tie),
why, the crossovers, each layout's highest rate at the attainment target, goodput and throughput
against the offered rate, the tails, and per point its requests, window, whether it reached steady
state, the prefix hit rate it measured beside the one its workload allows, and this machine's CPU
over its window. A host-bound point (``pdrouter.bench.host``: the machine's CPUs or the load
generator busy all the time) is marked ‡: its figures hold this machine's queueing too, a bound on the
layout's.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pdrouter.bench.compare import LayoutResult, best_by_rate, crossovers, max_rate_within, why
from pdrouter.bench.plots import write_plots
from pdrouter.bench.report import KV_FULL, kv_full_count
from pdrouter.bench.stats import Slo
from pdrouter.bench.window import MIN_REQUESTS, SETTLE_LIFETIMES, WARMUP_SHARE, settling_span_s


@dataclass(frozen=True)
class CompareSetup:
    """What a comparison ran: its title, SLO, attainment target, time scale, and the rates it skipped
    per layout (``--stop-below``)."""

    title: str
    slo: Slo
    attainment: float
    time_scale: float = 1.0
    stop_below: float | None = None
    skipped: dict[str, list[float]] = field(default_factory=dict)

    def window_rule(self) -> str:
        return (f"each point is measured over its window: after a warm-up of {100 * WARMUP_SHARE:g}% of its arrivals "
                f"(at least the 90th-percentile lifetime of its first requests), up to its last arrival (the drain "
                f"is left out); a window shorter than that lifetime or holding fewer than {MIN_REQUESTS} requests is "
                f"marked too short")

    def time_note(self) -> str:
        if self.time_scale in (0, 1):
            return "times as measured (time scale 1)"
        return f"simulated times (the simulated clocks ran {self.time_scale:g}× slower than the modeled GPUs)"


def _requests(results: Sequence[LayoutResult]) -> str:
    counts = [int(p.get("requests") or p["summary"]["requests"]) for r in results for p in r.points]
    if not counts:
        return "no point ran"
    return f"{min(counts)} requests a point" if min(counts) == max(counts) else \
        f"{min(counts)}–{max(counts)} requests a point"


def footer(results: Sequence[LayoutResult], setup: CompareSetup) -> str:
    """The plots' footer: requests per point, the window rule, the time scale."""
    return (f"{_requests(results)}, Poisson arrivals; {setup.window_rule()}; {setup.time_note()}.")


def _pct(v: float | None) -> str:
    return "–" if v is None else f"{100 * v:.1f}%"


def point_rows(results: Sequence[LayoutResult]) -> list[str]:
    """One row per point: requests sent, the window, the measured requests, steady or not, what it
    served against what it was offered, the prefix hit rate measured and allowed, and this machine's
    CPUs busy and the load generator's CPU over the window (‡: host-bound)."""
    rows = ["| layout | rate | requests | window (s) | measured | steady state | served / offered (req/s) | "
            "prefix hits: measured / expected | this machine: CPUs busy, load generator (CPUs) |",
            "| --- |" + " --- |" * 8]
    for r in results:
        for p in r.points:
            w = p.get("window") or {}
            served = p["summary"].get("request_rate")
            offered = p.get("offered_rate")
            steady = "yes" if w.get("steady") else f"**no**: {w.get('reason', 'unknown')}"
            if w.get("short_to_settle"):
                steady += f", short to settle §: {w['lifetimes']:.2g} lifetimes"
            if p.get("saturated"):
                steady += " (saturated)"
            prefix = p.get("prefix") or {}
            hits = f"{_pct(prefix.get('measured_hit_rate'))} / {_pct(prefix.get('expected_hit_rate'))}"
            if prefix.get("flagged"):
                hits += " **above the workload's**"
            window = f"{w['start_s']:.3g}–{w['end_s']:.3g}" if w else "–"
            host = p.get("host") or {}
            machine = "–" if not host else (f"{_pct(host.get('busy_share'))}, {host['load_generator_cpu']:.2f}"
                                            + (" **‡**" if host.get("host_bound") else ""))
            rows.append(f"| {r.layout.name} | {p['rate']:g} | {p.get('requests', '–')} | {window} | "
                        f"{w.get('requests', '–')} | {steady} | "
                        f"{'–' if served is None else f'{served:.3g}'} / {'–' if offered is None else f'{offered:.3g}'}"
                        f" | {hits} | {machine} |")
    return rows


def unsettled_windows(results: Sequence[LayoutResult]) -> dict[tuple[str, float], dict[str, Any]]:
    """(layout, rate) → window, for the points whose window was short to settle."""
    return {(r.layout.name, p["rate"]): w for r in results for p in r.points
            if (w := p.get("window") or {}).get("short_to_settle")}


def settle_hint(windows: Sequence[dict[str, Any]]) -> str:
    """``--point-duration N or more gives …``: what gives the longest-lived of these windows three lifetimes."""
    return (f"--point-duration {max(settling_span_s(w['lifetime_s']) for w in windows):g} or more gives "
            f"{'these windows' if len(windows) > 1 else 'its window'} {SETTLE_LIFETIMES:g} lifetimes")


def host_bound_points(results: Sequence[LayoutResult]) -> dict[tuple[str, float], str]:
    """The host-bound points, (layout, rate) → why (``pdrouter.bench.host``)."""
    return {(r.layout.name, p["rate"]): str((p.get("host") or {}).get("reason") or "")
            for r in results for p in r.points if (p.get("host") or {}).get("host_bound")}


def write_compare_report(results: list[LayoutResult], out: Path, setup: CompareSetup,
                         extra: dict[str, Any] | None = None) -> Path:
    """``compare.json`` (every point, plus ``extra``), the plots and ``report.md`` in ``out``; the report's path."""
    plots = write_plots(results, out, title=setup.title, slo=setup.slo, attainment=setup.attainment,
                        footer=footer(results, setup))
    winners = best_by_rate(results, "slo_met_percent")
    cross = crossovers(winners)
    kept = {r.layout.name: max_rate_within(r, setup.attainment) for r in results}
    (out / "compare.json").write_text(json.dumps(
        {"title": setup.title, "slo": setup.slo.describe(), "time_scale": setup.time_scale,
         "window_rule": setup.window_rule(), "skipped": setup.skipped,
         "layouts": [{"name": r.layout.name, "gpus": r.layout.gpus, "points": r.points} for r in results],
         "winners": winners, "crossovers": cross, "attainment_target": setup.attainment,
         "max_rate_within": kept, **(extra or {})}, indent=1, default=str) + "\n")
    names = [r.layout.name for r in results]
    rates_tried = [rate for rate, _ in winners] or [0.0]
    short = [(r.layout.name, p["rate"]) for r in results for p in r.points
             if not (p.get("window") or {}).get("steady", True)]
    flagged = [(r.layout.name, p["rate"]) for r in results for p in r.points if (p.get("prefix") or {}).get("flagged")]
    bound = host_bound_points(results)
    unsettled = unsettled_windows(results)
    kv_full = {(r.layout.name, p["rate"]): full for r in results for p in r.points
               if (full := kv_full_count(p.get("router") or {}))}

    def mark(name: str, rate: float) -> str:
        return ("†" if (name, rate) in short else "") + ("§" if (name, rate) in unsettled else "") \
            + ("‡" if (name, rate) in bound else "")

    def table(key: str, fmt: Any) -> list[str]:
        rows = ["| rate | " + " | ".join(names) + " |", "| --- |" + " --- |" * len(names)]
        for rate, _ in winners:
            cells = [(dict(r.curve(key)).get(rate), r.layout.name) for r in results]
            rows.append(f"| {rate:g} | " + " | ".join("–" if v is None else fmt(v) + mark(n, rate) for v, n in cells)
                        + " |")
        return rows

    lines = [f"# {setup.title}", "",
             f"SLO: {setup.slo.describe()}. {_requests(results).capitalize()}, Poisson arrivals; "
             f"{setup.window_rule()}. Figures are in {setup.time_note()}.", ""]
    if short:
        lines += ["† **too short to reach steady state**: " + ", ".join(f"{n} at {r:g} req/s" for n, r in short)
                  + " (see the points below); their figures are less sure.", ""]
    if unsettled:
        lines += ["§ **short to settle**: " + ", ".join(
            f"{n} at {r:g} req/s ({w['lifetimes']:.2g} lifetimes of {w['lifetime_s']:.3g} s)"
            for (n, r), w in unsettled.items())
            + f". Their windows span fewer than {SETTLE_LIFETIMES:g} of their first requests' p90 lifetimes; under a "
              "load that grows the batches, answers lengthen and the requests in flight and the KV booked rise for "
              "a lifetime or two, so what these points served and kept within the SLO may be the ramp's. Longer "
              f"points tell: {settle_hint(list(unsettled.values()))}.", ""]
    if kv_full:
        lines += ["**KV room ran out** (water level peak ≥ "
                  f"{KV_FULL:g} of the pool): " + "; ".join(
                      f"{n} at {r:g} req/s ({full} of {total} workers)" for (n, r), (full, total) in kv_full.items())
                  + ". Requests waited for KV room there (a wait past the router's queue deadline is refused with "
                    "429): at those rates the layout's KV pool was a limit"
                  + (" (on a host-bound point ‡ this machine's delays lengthen the time each request holds its KV "
                     "too)" if any(k in bound for k in kv_full) else "") + ".", ""]
    if bound:
        lines += ["‡ **this machine was busy throughout** (host-bound): " + "; ".join(
            f"{n} at {r:g} req/s ({reason})" for (n, r), reason in bound.items()) + ". Requests also queued in the "
                  "processes on this machine (the router's, the workers', the load generator's), so these points' "
                  "figures hold its queueing too: the layout alone would do at least as well, and a rate a layout "
                  "missed there may be this machine's limit, not the layout's. With simulated GPUs, raise "
                  "--time-scale.", ""]
    if flagged:
        lines += ["**Prefix hits above what the workload allows** (prompts served from a cache they should not "
                  "have been in): " + ", ".join(f"{n} at {r:g} req/s" for n, r in flagged) + ".", ""]
    lines += ["SLO attainment: the share of the measured requests that met every bound (failures count as "
              "misses), the layout keeping the most (within 3%: a tie) and why:", "",
              "| rate | " + " | ".join(names) + " | best | why |", "| --- |" + " --- |" * (len(names) + 2)]
    for rate, winner in winners:
        cells = [(dict(r.curve("slo_met_percent")).get(rate), r.layout.name) for r in results]
        caveat = "; ‡: this machine was measured at this rate too" if any(rate == r for _, r in bound) else ""
        lines.append(f"| {rate:g} | " + " | ".join("–" if v is None else f"{v:.0f}%{mark(n, rate)}" for v, n in cells)
                     + f" | {winner} | {why(results, rate, winner)}{caveat} |")
    skipped = {n: rates for n, rates in setup.skipped.items() if rates}
    if skipped:
        lines += ["", f"–: not run (the layout kept under {setup.stop_below:g}% within the SLO at a lower rate): "
                      + "; ".join(f"{n} at {', '.join(f'{x:g}' for x in rates)} req/s" for n, rates in skipped.items())
                      + "."]
    lines += ["", "Crossovers: " + ("; ".join(f"between {a:g} and {b:g} req/s the best layout changes from "
                                                f"{w0} to {w1}" for a, b, w0, w1 in cross)
                                     if cross else "none: the same layout (or tie) is best at every rate tried."), ""]
    lines += [f"Highest rate each layout served with at least {setup.attainment:g}% of requests within the SLO "
              "(DistServe's goodput; every lower rate of the sweep held it too):", "",
              "| layout | GPUs | highest rate | per GPU |", "| --- | --- | --- | --- |"]
    missed_host_bound = []
    for r in results:
        v = kept[r.layout.name]
        held_all = v is not None and v >= max(rates_tried)
        missed = [p["rate"] for p in sorted(r.points, key=lambda p: p["rate"]) if v is None or p["rate"] > v][:1]
        limit = ""
        if missed and (r.layout.name, missed[0]) in kv_full:
            limit = "; at the rate it missed its KV room ran out"
        if missed and (r.layout.name, missed[0]) in bound:
            limit += "; the rate it missed ‡: host-bound, maybe this machine's limit"
            missed_host_bound.append(r.layout.name)
        lines.append(f"| {r.layout.name} | {r.layout.gpus} | "
                     + ("below the lowest rate" + limit + " | – |" if v is None else
                        f"{'≥ ' if held_all else ''}{v:g} req/s{' (the highest tried)' if held_all else ''}{limit} | "
                        f"{v / r.layout.gpus:.3g} |"))
    served = [(v, n) for n, v in kept.items() if v is not None]
    if served:
        top = max(v for v, _ in served)
        best = [n for v, n in served if v == top]
        lines += ["", f"**{' and '.join(best)}** {'serve' if len(best) > 1 else 'serves'} the highest rate "
                      f"at {setup.attainment:g}% attainment ({top:g} req/s)."
                  + (f" Not shown here: how far {' and '.join(missed_host_bound)} would go on a machine that keeps "
                     f"up (the rate {'they' if len(missed_host_bound) > 1 else 'it'} missed was host-bound ‡)."
                     if missed_host_bound else "")]
    lines += ["", "Goodput over the measured window (requests that met the SLO and ended in it ÷ its length), "
                  "req/s:", "", *table("goodput", lambda v: f"{v:.2f}")]
    lines += ["", "Throughput over the measured window (requests that ended in it ÷ its length), req/s; a layout "
                  "offered more than it can serve shows its capacity here:", "",
              *table("request_rate", lambda v: f"{v:.2f}")]
    lines += ["", "TTFT p99 (ms):", "", *table("ttft_p99", lambda v: f"{v * 1e3:.0f}")]
    lines += ["", "TPOT p99 (ms):", "", *table("tpot_p99", lambda v: f"{v * 1e3:.1f}")]
    lines += ["", "ITL p99 (ms):", "", *table("itl_p99", lambda v: f"{v * 1e3:.1f}")]
    lines += ["", "The points: requests sent, the measured window (seconds of the run), the requests that arrived "
                  "in it, whether it reached steady state, what it served against what it was offered, and the "
                  "prefix hit rate of its measured requests (the server's cached tokens) against the most the "
                  "workload allows:", "", *point_rows(results)]
    lines += ["", "| layout | GPUs | KV water level peak | admission queue peak | KV bytes moved (largest point) | "
                  "simulated time lost to this machine |", "| --- | --- | --- | --- | --- | --- |"]
    for r in results:
        peaks = [max((p["router"].get("kv_water_level_peak") or {0: 0}).values(), default=0) for p in r.points]
        queues = [p["router"].get("admission_queue_peak") or 0 for p in r.points]
        moved = [p["router"].get("kv_transfer_bytes") or 0 for p in r.points]
        late = [p["router"]["sim_late_share"] for p in r.points if p["router"].get("sim_late_share") is not None]
        lines.append(f"| {r.layout.name} | {r.layout.gpus} | {max(peaks, default=0):.2f} | "
                     f"{max(queues, default=0):g} | {max(moved, default=0) / 2**30:.2f} GiB | "
                     + (f"{100 * max(late):.2f}% (worst point)" if late else "–") + " |")
    lines += [""] + [f"![{p.stem}]({p.name})" for p in plots]
    path = out / "report.md"
    path.write_text("\n".join(lines) + "\n")
    return path
