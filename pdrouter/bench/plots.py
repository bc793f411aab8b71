"""The comparison's plots (matplotlib, PNG), each with its data written beside it as JSON.

* ``goodput.png``: requests/s within the SLO against the offered rate, one line per layout;
* ``slo_met_percent.png``: the share of requests within the SLO against the rate (DistServe's
  attainment curve);
* ``ttft_p99.png`` / ``itl_p99.png``: the tails against the rate;
* ``pareto.png``: output tokens/s per GPU against tokens/s per user (1 ÷ mean TPOT), one point per
  rate: up and to the right is better, and each layout traces the trade-off batching makes.
"""

from __future__ import annotations

import json
import textwrap
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from pdrouter.bench.compare import LayoutResult

_CURVES = (("goodput", "goodput (req/s within the SLO)", 1.0),
           ("slo_met_percent", "SLO attainment (% of requests)", 1.0),
           ("ttft_p99", "TTFT p99 (ms)", 1e3),
           ("itl_p99", "ITL p99 (ms)", 1e3))


def curves(results: Sequence[LayoutResult]) -> dict[str, Any]:
    """The plotted data: per plot, per layout, the (x, y) points."""
    data: dict[str, Any] = {}
    for key, _, scale in _CURVES:
        data[key] = {r.layout.name: [[x, None if y is None else y * scale] for x, y in r.curve(key)]
                     for r in results}
    pareto: dict[str, list[list[float]]] = {}
    for r in results:
        pts = []
        for p in r.points:
            s = p["summary"]
            tpot = s["tpot"]["mean"]
            if tpot and tpot == tpot:  # not None, not NaN
                pts.append([1.0 / tpot, s["output_tokens_per_s"] / r.layout.gpus])
        pareto[r.layout.name] = pts
    data["pareto"] = pareto
    return data


def write_plots(results: Sequence[LayoutResult], out: Path, title: str) -> list[Path]:
    """Write the five PNGs and ``plots.json`` (their data) into ``out``; the PNG paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out.mkdir(parents=True, exist_ok=True)
    title = textwrap.fill(title, 70)
    data = curves(results)
    (out / "plots.json").write_text(json.dumps(data, indent=1) + "\n")
    paths: list[Path] = []
    for key, label, _ in _CURVES:
        fig, ax = plt.subplots(figsize=(6.4, 4.2), dpi=100)
        for name, pts in data[key].items():
            shown = [(x, y) for x, y in pts if y is not None]
            if shown:
                ax.plot([x for x, _ in shown], [y for _, y in shown], marker="o", label=name)
        ax.set_xlabel("offered rate (req/s)")
        ax.set_ylabel(label)
        ax.set_title(title, fontsize=9)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        path = out / f"{key}.png"
        fig.tight_layout()
        fig.savefig(path)
        plt.close(fig)
        paths.append(path)
    fig, ax = plt.subplots(figsize=(6.4, 4.2), dpi=100)
    for name, pts in data["pareto"].items():
        if pts:
            ax.plot([x for x, _ in pts], [y for _, y in pts], marker="o", label=name)
    ax.set_xlabel("tokens/s per user (1 / mean TPOT)")
    ax.set_ylabel("output tokens/s per GPU")
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    path = out / "pareto.png"
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    paths.append(path)
    return paths
