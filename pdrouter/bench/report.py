"""What a run leaves behind: one JSON document (config, requests, summary, scrapes) and a Markdown summary."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from pdrouter.bench.scrape import MetricsSample, prefix_hit_rate, sim_late_share
from pdrouter.bench.stats import Summary


def router_figures(samples: list[MetricsSample]) -> dict[str, Any]:
    """The router-side figures of a run: KV water level (peak and mean per decode worker), prefix hit
    rate, the longest admission queue, KV bytes moved (empty when the endpoint exports none)."""
    if not samples:
        return {}
    levels: dict[str, list[float]] = {}
    for s in samples:
        for worker, level in s.water_level.items():
            levels.setdefault(worker, []).append(level)
    queues = [s.queue_length for s in samples if s.queue_length is not None]
    moved = [s.kv_transfer_bytes for s in samples if s.kv_transfer_bytes is not None]
    return {
        "kv_water_level_peak": {w: max(v) for w, v in sorted(levels.items())},
        "kv_water_level_mean": {w: sum(v) / len(v) for w, v in sorted(levels.items())},
        "prefix_hit_rate": prefix_hit_rate(samples),
        "admission_queue_peak": max(queues) if queues else None,
        "kv_transfer_bytes": (moved[-1] - moved[0]) if len(moved) >= 2 else None,
        "sim_late_share": sim_late_share(samples),
    }


def _clean(value: Any) -> Any:
    """NaN/inf → None, so the document is strict JSON."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _clean(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_clean(v) for v in value]
    return value


def run_document(config: dict[str, Any], summary: Summary, records: list[dict[str, object]],
                 samples: list[MetricsSample], interrupted: bool) -> dict[str, Any]:
    return _clean({"config": config, "summary": summary.to_dict(), "router": router_figures(samples),
                   "interrupted": interrupted, "requests": records,
                   "metrics_samples": [s.to_dict() for s in samples]})


def write_json(path: Path, document: dict[str, Any]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(document, indent=1) + "\n")
    return path


def markdown(document: dict[str, Any]) -> str:
    """A short human summary of a run document."""
    cfg, s, router = document["config"], document["summary"], document["router"]
    lines = [f"# Load test: {cfg.get('model')} at {cfg.get('base_url')}", "",
             f"Arrivals: {cfg.get('arrivals')}; workload: {cfg.get('workload')}; "
             f"time scale {cfg.get('time_scale', 1)} (latencies in simulated time when ≠ 1)."
             + (" **Interrupted**: figures cover what was measured." if document.get("interrupted") else ""), "",
             "| metric | value |", "| --- | --- |"]
    lines += [f"| {name} | {value} |" for name, value in _summary_rows(s)]
    if router:
        lines += ["", "Router (scraped from `/metrics` during the run):", "", "| metric | value |", "| --- | --- |"]
        for key, value in router.items():
            if isinstance(value, dict):
                value = ", ".join(f"{w}: {v:.2f}" for w, v in value.items()) or "–"
            elif isinstance(value, float):
                value = f"{value:.3g}"
            lines.append(f"| {key} | {value if value is not None else '–'} |")
    return "\n".join(lines) + "\n"


def _summary_rows(s: dict[str, Any]) -> list[tuple[str, str]]:
    rows = [("requests (completed / failed)", f"{s['completed']} / {s['failed']}"),
            ("duration", f"{s['duration_s']:.2f} s"),
            ("request throughput", f"{s['request_rate']:.2f} req/s"),
            ("input / output tokens/s", f"{s['input_tokens_per_s']:.0f} / {s['output_tokens_per_s']:.0f}")]
    if s.get("goodput") is not None:
        rows.append(("goodput (meeting the SLO)", f"{s['goodput']:.2f} req/s ({s['slo_met']} requests)"))
    for name in ("ttft", "tpot", "itl", "e2e"):
        p = s[name]
        if p.get("count"):
            rows.append((f"{name.upper()} mean / p50 / p90 / p99",
                         " / ".join(f"{(p[k] or 0) * 1e3:.1f}" for k in ("mean", "p50", "p90", "p99")) + " ms"))
    if s.get("errors"):
        rows.append(("errors", ", ".join(f"{k}: {v}" for k, v in sorted(s["errors"].items()))))
    return rows
