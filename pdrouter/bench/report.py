"""What a run leaves behind: one JSON document (config, requests, summary, scrapes) and a Markdown summary.

The document holds two summaries: ``summary``, over the whole run with ``vllm bench serve``'s
definitions (what other tools report for the same run), and ``steady``, over the measured window
(``pdrouter.bench.window``), which sweeps and comparisons score. ``prefix`` sets the prefix hit
rate the workload allows (``expected``) beside the one the server reported for the measured
requests (``measured``) and flags a point where the second exceeds the first. ``host`` is this
machine's CPU over the measured window (``pdrouter.bench.host``) and says whether the point was
host-bound: then its figures hold this machine's queueing too, a bound on the server's.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from pdrouter.bench.host import describe as describe_host
from pdrouter.bench.scrape import MetricsSample, counter_growth, prefix_hit_rate, sim_late_share
from pdrouter.bench.stats import RequestRecord, Summary
from pdrouter.bench.window import Window, saturated, settling_span_s

HIT_RATE_SLACK = 0.01
"""A measured prefix hit rate this far above the expected one is flagged (the expectation is a
bound: a cache serves whole blocks and misses each prefix once per worker)."""


def router_figures(samples: list[MetricsSample]) -> dict[str, Any]:
    """The router-side figures of a run: KV water level (peak and mean per decode worker), the prefix
    index's hit rate at placement, the longest admission queue, KV bytes moved (empty when the
    endpoint exports none)."""
    if not samples:
        return {}
    levels: dict[str, list[float]] = {}
    for s in samples:
        for worker, level in s.water_level.items():
            levels.setdefault(worker, []).append(level)
    queues = [s.queue_length for s in samples if s.queue_length is not None]
    return {
        "kv_water_level_peak": {w: max(v) for w, v in sorted(levels.items())},
        "kv_water_level_mean": {w: sum(v) / len(v) for w, v in sorted(levels.items())},
        "prefix_hit_rate": prefix_hit_rate(samples),
        "admission_queue_peak": max(queues) if queues else None,
        "kv_transfer_bytes": counter_growth(samples, "kv_transfer_bytes"),
        "sim_late_share": sim_late_share(samples),
    }


KV_FULL = 0.95
"""A worker whose KV water level (the share of its pool booked) peaked at or above this ran out of KV room
during the run: requests then waited in the router's admission queue, and were refused when their wait
passed its deadline."""


def kv_full_workers(router: dict[str, Any]) -> dict[str, float]:
    """Worker → its water level peak, for the workers whose KV peaked at ``KV_FULL`` or more."""
    return {w: v for w, v in (router.get("kv_water_level_peak") or {}).items() if v >= KV_FULL}


def kv_full_count(router: dict[str, Any]) -> tuple[int, int] | None:
    """(workers whose KV ran out, workers) of a run's router figures; None where none ran out."""
    full = kv_full_workers(router)
    return (len(full), len(router["kv_water_level_peak"])) if full else None


def kv_full_sentence(router: dict[str, Any]) -> str:
    """What a run's KV room did where it ran out ("" where it did not)."""
    full = kv_full_workers(router)
    if not full:
        return ""
    peaks = router.get("kv_water_level_peak") or {}
    queue = router.get("admission_queue_peak")
    low, high = min(full.values()), max(full.values())
    span = f"{low:.2f}" if f"{low:.2f}" == f"{high:.2f}" else f"{low:.2f}–{high:.2f}"
    return (f"**KV room ran out** on {len(full)} of {len(peaks)} workers (water level peak {span}"
            + (f"; the router's admission queue held up to {queue:.0f} requests" if queue else "")
            + "): requests waited for KV room in the router's queue (a wait past the queue's deadline is refused "
              "with 429). At this rate the KV pool was a limit.")


def short_window_sentence(window: dict[str, Any]) -> str:
    """The caution for a steady window that spans fewer than ``SETTLE_LIFETIMES`` lifetimes ("" otherwise)."""
    if not window.get("short_to_settle"):
        return ""
    return (f"**Short to settle:** the window spans {window['lifetimes']:.2g} of its first requests' p90 lifetimes "
            f"({window['lifetime_s']:.3g} s), fewer than {window['settle_lifetimes']:g}. Under a load that grows the "
            "batches, answers lengthen and the requests in flight and the KV booked keep rising for a lifetime or "
            "two; what was served, the latencies and the KV room here may be the ramp's. A longer point tells: "
            f"arrivals over {settling_span_s(window['lifetime_s']):g} s or more (`--point-duration`, "
            "`--num-requests`) give it three lifetimes.")


def router_ttft_sentence(router: dict[str, float], client: dict[str, Any]) -> str:
    """The router's own TTFT over the window beside the client's: where the client's is far above it, the
    time went outside the router (the client, this machine's queues, the network)."""
    def ms(value: float | None) -> str:
        return "–" if value is None else f"{1e3 * value:.0f} ms"

    quantiles = ("p50", "p90", "p99")
    return (f"The router's own TTFT over the window (its `pdrouter_time_to_first_token_seconds`, from a request's "
            f"arrival at its door to its first token leaving it, read between its histogram's buckets; "
            f"{router['count']:.0f} requests): " + ", ".join(f"{q} {ms(router.get(f'{q}_s'))}" for q in quantiles)
            + "; the client's: " + ", ".join(f"{q} {ms(client.get(q))}" for q in quantiles)
            + ". What the client's holds above the router's was spent outside the router: in the client, in this "
              "machine's queues before the router read a request or after the client's socket had its token, "
              "or on the network.")


def measured_hit_rate(records: Sequence[RequestRecord]) -> float | None:
    """Cached prompt tokens ÷ prompt tokens over the completed ``records`` whose server reported
    ``cached_tokens`` (None: it reported none)."""
    counted = [r for r in records if r.ok and r.cached_tokens is not None]
    total = sum(r.input_tokens for r in counted)
    return sum(r.cached_tokens or 0 for r in counted) / total if total else None


def prefix_figures(expected: float | None, measured: float | None) -> dict[str, Any]:
    """``expected`` (from the workload), ``measured`` (from the server's usage), and ``flagged`` when the
    measured rate exceeds the expected one by more than ``HIT_RATE_SLACK``: prompts were served from a
    cache the workload did not mean them to be in."""
    flagged = expected is not None and measured is not None and measured > expected + HIT_RATE_SLACK
    return {"expected_hit_rate": expected, "measured_hit_rate": measured, "flagged": flagged}


def steady_figures(window: Window, summary: Summary, offered: float,
                   router_ttft: dict[str, float] | None = None) -> dict[str, Any]:
    """The ``steady`` part of a run document; ``router_ttft``: the router's own TTFT over the window
    (``scrape.histogram_quantiles``), where it exports one."""
    return {"window": window.to_dict(), "summary": summary.to_dict(), "offered_rate": offered,
            "saturated": saturated(summary, offered), "router_ttft": router_ttft or {}}


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
                 samples: list[MetricsSample], interrupted: bool, *, steady: dict[str, Any] | None = None,
                 prefix: dict[str, Any] | None = None, host: dict[str, Any] | None = None,
                 client: dict[str, int] | None = None) -> dict[str, Any]:
    return _clean({"config": config, "summary": summary.to_dict(), "steady": steady or {},
                   "prefix": prefix or {}, "router": router_figures(samples), "host": host or {},
                   "client": client or {},
                   "interrupted": interrupted,
                   "requests": records, "metrics_samples": [s.to_dict() for s in samples]})


def write_json(path: Path, document: dict[str, Any]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(document, indent=1) + "\n")
    return path


def _pct(value: float | None) -> str:
    return "–" if value is None else f"{100 * value:.1f}%"


def markdown(document: dict[str, Any]) -> str:
    """A short human summary of a run document."""
    cfg, s, router = document["config"], document["summary"], document["router"]
    scale = cfg.get("time_scale", 1)
    lines = [f"# Load test: {cfg.get('model')} at {cfg.get('base_url')}", "",
             f"Arrivals: {cfg.get('arrivals')}; workload: {cfg.get('workload')}; {cfg.get('num_requests')} requests; "
             f"SLO: {cfg.get('slo') or 'none given'}; time scale {scale}"
             + (" (every time below is simulated: wall-clock time ÷ the scale)." if scale not in (0, 1) else ".")
             + (" **Interrupted**: figures cover what was measured." if document.get("interrupted") else ""), ""]
    steady = document.get("steady") or {}
    host = document.get("host") or {}
    host_bound = bool(host.get("host_bound"))
    if steady:
        w = steady["window"]
        verdict = ("steady" if w["steady"] else f"**too short** to reach steady state: {w['reason']}")
        saturation = ""
        if steady.get("saturated"):  # (on a host-bound point, the sentence below says whose limit it was)
            saturation = (" Less than 90% of the rate offered was served in the window." if host_bound else
                          " The server was **saturated**: it served less than 90% of the rate offered in the window.")
        lines += [f"Measured window: {w['start_s']:.3g}–{w['end_s']:.3g} s of the run ({w['length_s']:.3g} s, "
                  f"{w['requests']} requests arrived in it; warm-up {w['warmup_s']:.3g} s, the drain after the last "
                  f"arrival left out): {verdict}.{saturation}", ""]
        caution = short_window_sentence(w)
        if caution:
            lines += [caution, ""]
        theirs = steady.get("router_ttft") or {}
        ours = (steady.get("summary") or {}).get("ttft") or {}
        if theirs.get("count") and ours.get("count"):
            lines += [router_ttft_sentence(theirs, ours), ""]
    if host:
        lines += [describe_host(host), ""]
    kv = kv_full_sentence(router or {})
    if kv:
        lines += [kv, ""]
    client = document.get("client") or {}
    if client.get("waited_for_a_connection"):
        lines += [f"**{client['waited_for_a_connection']} requests waited for a connection of the client's own** "
                  f"(all {client['connections']} in use; at most {client['peak_in_flight']} requests in flight): their "
                  "TTFT and E2E hold that wait, which is the client's limit, not the server's.", ""]
    prefix = document.get("prefix") or {}
    if prefix:
        lines += [f"Prefix hit rate: {_pct(prefix.get('measured_hit_rate'))} measured (cached ÷ prompt tokens the "
                  f"server reported), {_pct(prefix.get('expected_hit_rate'))} at most by the workload"
                  + (" — **higher than the workload allows: prompts were served from a cache they should not "
                     "have been in**." if prefix.get("flagged") else "."), ""]
    lines += ["| metric | whole run (vllm bench serve) | measured window |", "| --- | --- | --- |"]
    window = steady.get("summary") if steady else None
    for (name, whole), (_, inside) in zip(_summary_rows(s), _summary_rows(window or s), strict=True):
        lines.append(f"| {name} | {whole} | {inside if window else '–'} |")
    if router:
        lines += ["", "Router (scraped from `/metrics` during the whole run):", "", "| metric | value |",
                  "| --- | --- |"]
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
            ("request throughput", f"{s['request_rate']:.2f} req/s" if s.get("request_rate") is not None else "–"),
            ("input / output tokens/s", f"{s['input_tokens_per_s'] or 0:.0f} / {s['output_tokens_per_s'] or 0:.0f}")]
    if s.get("goodput") is not None:
        rows.append(("goodput (meeting the SLO)", f"{s['goodput']:.2f} req/s ({s['slo_met']} requests met it)"))
    else:
        rows.append(("goodput (meeting the SLO)", "– (no SLO)"))
    for name in ("ttft", "tpot", "itl", "e2e"):
        p = s[name]
        rows.append((f"{name.upper()} mean / p50 / p90 / p99",
                     " / ".join(f"{(p[k] or 0) * 1e3:.1f}" for k in ("mean", "p50", "p90", "p99")) + " ms"
                     if p.get("count") else "–"))
    chunk = s.get("tokens_per_chunk")
    rows.append(("tokens per streamed chunk", "–" if chunk is None else f"{chunk:.3f}"))
    rows.append(("errors", ", ".join(f"{k}: {v}" for k, v in sorted(s["errors"].items())) or "none"))
    return rows
