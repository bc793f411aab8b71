"""A comparison run: each layout up in turn, warmed, the same sweep against it, then the report.

:func:`run_comparison` brings every layout of a :class:`ComparePlan` up (``compare.bring_up``),
sends a warm-up it discards (:func:`warm_up`), then each rate's point with requests of its own
(``point.run_point``), skips a layout's higher rates once a point fell below ``stop_below``, and
writes ``compare.json``, the plots and ``report.md`` (``compare_report``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from pdrouter.bench.compare import Layout, LayoutResult, bring_up
from pdrouter.bench.compare_report import CompareSetup, settle_hint, unsettled_windows, write_compare_report
from pdrouter.bench.point import (
    Prepared,
    failure_hint,
    first_failure,
    interruptible,
    metrics_url_beside,
    point_entry,
    point_line,
    run_point,
)
from pdrouter.bench.progress import Progress
from pdrouter.bench.runner import RunConfig, run
from pdrouter.bench.stats import Slo
from pdrouter.core.aio import run_on_event_loop
from pdrouter.core.errors import UnavailableError


@dataclass(frozen=True)
class ComparePlan:
    """What a comparison runs: the layouts, the rates and each rate's point size, the model folder and
    how ``pdrouter up`` runs it, and what the report says."""

    layouts: Sequence[Layout]
    rates: Sequence[float]
    sizes: dict[float, int]
    """Requests a point at each rate sends."""
    folder: Path
    stem: Path
    """The comparison's folder under ``--out``."""
    title: str
    slo: Slo
    attainment: float
    gpu: str
    backend: str
    time_scale: float = 1.0
    up_extra: tuple[str, ...] = ()
    """More ``pdrouter up`` arguments (the simulated KV link)."""
    warmup: int | None = None
    """Warm-up requests per layout (None: 2 per worker)."""
    burstiness: float = 1.0
    seed: int = 0
    timeout_s: float = 600.0
    """Seconds one request may take."""
    stop_below: float | None = None
    echo: bool = True
    """Print a line per point."""


def run_comparison(plan: ComparePlan, prep: Prepared, progress: Progress) -> Path | None:
    """Every layout of ``plan`` measured in turn; the report's path, or None when interrupted. The
    points' JSON and Markdown go beside ``plan.stem``."""
    results: list[LayoutResult] = []
    skipped: dict[str, list[float]] = {}
    rates = list(plan.rates)
    for li, layout in enumerate(plan.layouts):
        result = LayoutResult(layout)
        results.append(result)
        with bring_up(layout, plan.folder, gpu=plan.gpu, time_scale=plan.time_scale, backend=plan.backend,
                      extra=plan.up_extra) as cluster:
            at = RunConfig(base_url=cluster.url, model=prep.model, burstiness=plan.burstiness, seed=plan.seed,
                           metrics_url=metrics_url_beside(cluster.url), timeout_s=plan.timeout_s,
                           time_scale=plan.time_scale, cluster_pid=cluster.pid)
            warm_up(at, prep, layout, plan.warmup)
            for ri, rate in enumerate(rates):
                if result.points and plan.stop_below is not None and \
                        (result.points[-1]["slo_met_percent"] or 0.0) < plan.stop_below:
                    skipped[layout.name] = rates[ri:]
                    progress.skip(range(li * len(rates) + ri, (li + 1) * len(rates)))
                    if plan.echo:
                        print(f"{layout.name:>12}: below {plan.stop_below:g}% within the SLO; higher rates "
                              f"skipped", flush=True)
                    break
                point, specs = prep.source.take(plan.sizes[rate])
                progress.begin(li * len(rates) + ri)
                outcome = run_point(at, plan.stem.parent, prep, rate, f"{plan.stem.name}/{layout.name}/rate-{rate:g}",
                                    point=point, specs=specs, progress=progress)
                progress.end()
                result.points.append(point_entry(rate, outcome, point))
                if plan.echo:
                    print(point_line(f"{layout.name:>12} @ {rate:g}/s", outcome), flush=True)
                if outcome.summary.completed == 0 and outcome.summary.failed:
                    kind, detail = first_failure(outcome)
                    raise UnavailableError(f"every request to {layout.name} at {rate:g}/s failed "
                                           f"({failure_hint(kind, detail, cluster.url, prep.model)}): {outcome.path}")
                if outcome.interrupted:
                    return None
    setup = CompareSetup(plan.title, plan.slo, plan.attainment, plan.time_scale, plan.stop_below, skipped)
    unsettled = list(unsettled_windows(results).values())
    if plan.echo and unsettled:
        print(f"{len(unsettled)} of the points were short to settle (§ in the report): {settle_hint(unsettled)}",
              flush=True)
    return write_compare_report(results, plan.stem, setup)


def warm_up(run_config: RunConfig, prep: Prepared, layout: Layout, count: int | None) -> None:
    """Send ``count`` short requests (default: 2 per worker), two per worker at a time, and discard
    them: a fresh cluster's first requests pay for connections being opened and code paths run for
    the first time, which would otherwise land in the sweep's first point. Their prompts are a point
    of their own, so they share nothing with any measured request. A warm-up that fails stops the
    comparison."""
    from pdrouter.bench import workload as w

    workers = layout.colocated + layout.prefill + layout.decode
    count = 2 * workers if count is None else count
    if count == 0:
        return
    specs = w.synthetic(count, w.LengthDist.parse("64", "warm-up"), w.LengthDist.parse("4", "warm-up"),
                        seed=run_config.seed, point=prep.source.number())
    config = RunConfig(base_url=run_config.base_url, model=prep.model, concurrency=min(count, 2 * workers),
                       timeout_s=run_config.timeout_s, time_scale=run_config.time_scale)
    result = run_on_event_loop(interruptible(run(config, specs)))
    failed = [r for r in result.records if not r.ok]
    if result.interrupted:
        raise KeyboardInterrupt
    if failed:
        first = failure_hint(failed[0].error_kind, failed[0].detail, run_config.base_url, prep.model)
        raise UnavailableError(f"{layout.name}: {len(failed)} of {count} warm-up requests failed (first: {first})")

