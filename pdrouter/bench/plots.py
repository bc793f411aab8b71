"""The comparison's plots (matplotlib, PNG), drawn from specs that are written beside them as JSON.

:func:`plot_specs` describes every plot as data (series, reference lines, axis limits, notes), and
:func:`draw` renders a spec and nothing else, so ``plots.json`` says exactly what each PNG shows.
The plots are built not to mislead:

* ``ttft_p99.png``, ``tpot_p99.png``, ``itl_p99.png``: the tails against the offered rate, with the
  SLO's bound drawn (ITL: its own bound, else the TPOT bound, which bounds a request's mean gap);
* ``slo_met_percent.png``: attainment (DistServe's) on a fixed 0–100% axis, with the target line;
* ``goodput.png``: requests/s within the SLO against the offered rate, with the offered load as
  y = x: a point on it served everything within the SLO, the gap below is what was lost;
* ``pareto.png``: output tokens/s per GPU against tokens/s per user (1 ÷ mean TPOT), each point
  labelled with its rate, with the TPOT bound as the floor of tokens/s per user;
* every y axis starts at 0 (a log axis only when the values span more than ``LOG_SPAN`` ×), so noise
  between close values is not drawn as a trend; each layout has its own marker and line style, later
  layouts drawn smaller on top, and a note names the points where layouts coincide; a point too
  short to reach steady state is drawn hollow, one short to settle half filled, and one over which
  this machine was busy throughout (host-bound, ``pdrouter.bench.host``: a bound on the layout's
  figure) is crossed; the footer gives
  the requests per point, the measured window and the time scale.
"""

from __future__ import annotations

import json
import math
import textwrap
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from pdrouter.bench.compare import LayoutResult
from pdrouter.bench.stats import Slo

LOG_SPAN = 30.0
"""A latency axis turns logarithmic when its largest value exceeds its smallest by this factor."""

TIE_NOTE = 0.01
"""Points of two layouts within this fraction of each other (and at the same rate) coincide on the plot."""

_MARKERS = ("o", "s", "^", "D", "v", "P", "X", "*")
_STYLES = ("-", "--", "-.", ":")

_LATENCIES = (("ttft_p99", "TTFT p99 (ms)", "ttft_s"), ("tpot_p99", "TPOT p99 (ms)", "tpot_s"),
              ("itl_p99", "ITL p99 (ms)", "itl_s"))


def _series(results: Sequence[LayoutResult], key: str, scale: float, *,
            x_offered: bool = False) -> list[dict[str, Any]]:
    """Per layout its points of ``key`` (× ``scale``) against the nominal rate, or with ``x_offered``
    against the rate its window was offered as sent (labelled with the nominal one)."""
    out = []
    for r in results:
        points = []
        for p, (x, y) in zip(r.points, r.curve(key), strict=True):
            if y is None or not math.isfinite(y):
                continue
            point: dict[str, Any] = {"x": x, "y": y * scale, **_marks(p)}
            offered = p.get("offered_rate")
            if x_offered and offered is not None and math.isfinite(offered):
                point |= {"x": offered, "label": f"{x:g}/s"}
            points.append(point)
        out.append({"layout": r.layout.name, "points": points})
    return out


def _marks(p: dict[str, Any]) -> dict[str, bool]:
    """How a point is drawn: ``steady`` (else hollow), ``short_to_settle`` (half filled) and ``host_bound``
    (crossed)."""
    window = p.get("window") or {}
    return {"steady": bool(window.get("steady", True)), "short_to_settle": bool(window.get("short_to_settle")),
            "host_bound": bool((p.get("host") or {}).get("host_bound"))}


def _ties(series: Sequence[dict[str, Any]]) -> list[str]:
    """``"colocated-8 and 2p6d at 8, 16 req/s"`` for every pair of layouts whose points coincide."""
    notes = []
    for i, a in enumerate(series):
        for b in series[i + 1:]:
            ys = {p["x"]: p["y"] for p in b["points"]}
            same = [p["x"] for p in a["points"] if p["x"] in ys
                    and abs(p["y"] - ys[p["x"]]) <= TIE_NOTE * max(abs(p["y"]), abs(ys[p["x"]]), 1e-12)]
            if same:
                notes.append(f"{a['layout']} and {b['layout']} at {', '.join(f'{x:g}' for x in same)} req/s")
    return notes


def _y_axis(series: Sequence[dict[str, Any]], lines: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """From 0 to a little above the largest value or line; log when the values span over ``LOG_SPAN``.

    On a log axis the smallest value or line stays clear of the bottom edge (an SLO of 100 ms drawn on
    an axis that starts at 100 ms would hide in the frame)."""
    ys = [p["y"] for s in series for p in s["points"]] + [ln["value"] for ln in lines if ln["axis"] == "y"]
    positive = [y for y in ys if y > 0]
    if positive and max(positive) / min(positive) > LOG_SPAN:
        return {"scale": "log", "min": 10 ** math.floor(math.log10(min(positive) / 1.5)),
                "max": 10 ** math.ceil(math.log10(max(positive) * 1.05))}
    return {"scale": "linear", "min": 0.0, "max": 1.1 * max(ys, default=1.0) or 1.0}


def plot_specs(results: Sequence[LayoutResult], *, title: str, slo: Slo, attainment: float,
               footer: str) -> dict[str, Any]:
    """Every plot as data: per plot its axes' labels and limits, one series per layout (points with
    ``x``, ``y``, ``steady``; the Pareto points also ``label``), reference ``lines`` (``axis``,
    ``value``, ``label``, ``kind``: ``slo`` | ``target`` | ``offered``) and ``notes``."""
    specs: dict[str, Any] = {}
    for key, label, bound_name in _LATENCIES:
        series = _series(results, key, 1e3)
        bound = getattr(slo, bound_name)
        lines: list[dict[str, Any]] = []
        if bound is not None:
            lines.append({"axis": "y", "value": bound * 1e3, "kind": "slo",
                          "label": f"SLO: {bound_name[:-2].upper()} ≤ {bound * 1e3:g} ms"})
        elif key == "itl_p99" and slo.tpot_s is not None:
            lines.append({"axis": "y", "value": slo.tpot_s * 1e3, "kind": "slo",
                          "label": f"SLO: TPOT ≤ {slo.tpot_s * 1e3:g} ms (a request's mean gap; no ITL bound)"})
        specs[key] = {"x_label": "offered rate (req/s)", "y_label": label, "series": series, "lines": lines,
                      "y": _y_axis(series, lines), "notes": _ties(series)}
    series = _series(results, "slo_met_percent", 1.0)
    specs["slo_met_percent"] = {
        "x_label": "offered rate (req/s)", "y_label": "SLO attainment (% of requests within the SLO)",
        "series": series, "y": {"scale": "linear", "min": 0.0, "max": 100.0, "pad": 4.0},
        "lines": [{"axis": "y", "value": attainment, "kind": "target", "label": f"target {attainment:g}%"}],
        "notes": _ties(series)}
    series = _series(results, "goodput", 1.0, x_offered=True)
    top = max([p["x"] for s in series for p in s["points"]] + [p["y"] for s in series for p in s["points"]],
              default=1.0)
    specs["goodput"] = {
        "x_label": "offered rate as sent in the measured window (req/s; labels: the nominal rate)",
        "y_label": "goodput (req/s within the SLO, measured window)",
        "series": series, "lines": [{"axis": "diagonal", "value": 1.0, "kind": "offered",
                                     "label": "offered load (y = x): everything within the SLO"}],
        "y": {"scale": "linear", "min": 0.0, "max": 1.1 * top}, "x": {"min": 0.0, "max": 1.1 * top},
        "notes": _ties(series)}
    pareto: list[dict[str, Any]] = []
    for r in results:
        points = []
        for p in r.points:
            s = p["summary"]
            tpot = s["tpot"]["mean"]
            if tpot and math.isfinite(tpot) and s.get("output_tokens_per_s") is not None:
                points.append({"x": 1.0 / tpot, "y": s["output_tokens_per_s"] / r.layout.gpus,
                               "label": f"{p['rate']:g}/s", **_marks(p)})
        pareto.append({"layout": r.layout.name, "points": points})
    lines = []
    if slo.tpot_s is not None:
        lines.append({"axis": "x", "value": 1.0 / slo.tpot_s, "kind": "slo",
                      "label": f"SLO: TPOT ≤ {slo.tpot_s * 1e3:g} ms (right of the line)"})
    xs = [p["x"] for s in pareto for p in s["points"]] + [ln["value"] for ln in lines]
    ys = [p["y"] for s in pareto for p in s["points"]]
    specs["pareto"] = {"x_label": "tokens/s per user (1 / mean TPOT)", "y_label": "output tokens/s per GPU",
                       "series": pareto, "lines": lines, "x": {"min": 0.0, "max": 1.1 * max(xs, default=1.0)},
                       "y": {"scale": "linear", "min": 0.0, "max": 1.1 * max(ys, default=1.0)},
                       "notes": _ties(pareto)}
    for spec in specs.values():
        spec["title"] = title
        spec["footer"] = footer
        spec["hollow_means"] = "too short to reach steady state"
        spec["half_means"] = ("short to settle (the window spans under three lifetimes: a longer point may "
                              "read otherwise)")
        spec["crossed_means"] = "this machine was busy throughout (host-bound): a bound on the layout's figure"
    return specs


def draw(spec: dict[str, Any], path: Path) -> None:
    """Render one spec of :func:`plot_specs` into a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.2, 5.0), dpi=100)
    count = len(spec["series"])
    hollow_seen = crossed_seen = half_seen = False
    for i, s in enumerate(spec["series"]):
        pts = s["points"]
        if not pts:
            continue
        size = 9.0 - 4.0 * i / max(count - 1, 1)  # later layouts smaller, drawn on top: ties stay visible
        marker, style = _MARKERS[i % len(_MARKERS)], _STYLES[i % len(_STYLES)]
        (line,) = ax.plot([p["x"] for p in pts], [p["y"] for p in pts], linestyle=style, marker=marker,
                          markersize=size, label=s["layout"], zorder=2 + i)
        for p in pts:
            if not p["steady"]:
                hollow_seen = True
                ax.plot([p["x"]], [p["y"]], marker=marker, markersize=size, color=line.get_color(),
                        markerfacecolor="white", zorder=3 + i)
            elif p.get("short_to_settle"):
                half_seen = True
                ax.plot([p["x"]], [p["y"]], marker=marker, markersize=size, color=line.get_color(),
                        fillstyle="left", markerfacecoloralt="white", zorder=3 + i)
            if p.get("host_bound"):
                crossed_seen = True
                ax.plot([p["x"]], [p["y"]], marker="x", markersize=size + 3, color="black", linestyle="none",
                        zorder=4 + count)
            if "label" in p:
                ax.annotate(p["label"], (p["x"], p["y"]), textcoords="offset points",
                            xytext=(6, 6) if i % 2 == 0 else (6, -12), fontsize=7, color=line.get_color())
    for ln in spec["lines"]:
        color = {"slo": "tab:red", "target": "tab:red", "offered": "0.4"}[ln["kind"]]
        if ln["axis"] == "y":
            ax.axhline(ln["value"], color=color, linestyle="--", linewidth=1.2, label=ln["label"])
        elif ln["axis"] == "x":
            ax.axvline(ln["value"], color=color, linestyle="--", linewidth=1.2, label=ln["label"])
        else:
            top = spec.get("x", {}).get("max") or 1.0
            ax.plot([0, top], [0, top * ln["value"]], color=color, linestyle=":", linewidth=1.2, label=ln["label"])
    y = spec["y"]
    if y["scale"] == "log":
        ax.set_yscale("log")
    ax.set_ylim(y["min"], y["max"] + y.get("pad", 0.0))
    if "x" in spec:
        ax.set_xlim(spec["x"]["min"], spec["x"]["max"])
    else:
        ax.set_xlim(left=0)
    ax.set_xlabel(spec["x_label"])
    ax.set_ylabel(spec["y_label"])
    ax.set_title(textwrap.fill(spec["title"], 80), fontsize=8)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="best")
    notes = [spec["footer"]]
    if hollow_seen:
        notes.append(f"Hollow markers: {spec['hollow_means']}.")
    if half_seen:
        notes.append(f"Half-filled markers: {spec['half_means']}.")
    if crossed_seen:
        notes.append(f"Crossed markers: {spec['crossed_means']}.")
    if spec["notes"]:
        notes.append("Coinciding (within 1%): " + "; ".join(spec["notes"]) + ".")
    fig.text(0.01, 0.01, textwrap.fill(" ".join(notes), 130), fontsize=6.5, va="bottom")
    fig.tight_layout(rect=(0, 0.07 + 0.02 * (len(notes) - 1), 1, 1))
    fig.savefig(path)
    plt.close(fig)


def write_plots(results: Sequence[LayoutResult], out: Path, *, title: str, slo: Slo, attainment: float,
                footer: str) -> list[Path]:
    """Write every plot's PNG and ``plots.json`` (their specs) into ``out``; the PNG paths."""
    out.mkdir(parents=True, exist_ok=True)
    specs = plot_specs(results, title=title, slo=slo, attainment=attainment, footer=footer)
    (out / "plots.json").write_text(json.dumps(specs, indent=1) + "\n")
    paths = []
    for name, spec in specs.items():
        path = out / f"{name}.png"
        draw(spec, path)
        paths.append(path)
    return paths
