"""The fidelity benchmark's table: cited rows, a split fixed by rule, presets that are the fit, recomputed errors."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import subprocess
import sys
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest

from pdrouter.engine.sim.calibration import CALIBRATION_PRESETS, Calibration

BENCH = Path(__file__).resolve().parents[3] / "benchmarks" / "sim_fidelity.py"


@pytest.fixture(scope="module")
def bench() -> Iterator[ModuleType]:
    """The benchmark script as a module (it puts its folder on sys.path for ``_report``; undone after)."""
    path_before = list(sys.path)
    spec = importlib.util.spec_from_file_location("sim_fidelity", BENCH)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses resolve their module through sys.modules
    try:
        spec.loader.exec_module(module)
        yield module
    finally:
        sys.modules.pop(spec.name, None)
        sys.modules.pop("_report", None)
        sys.path[:] = path_before


def test_the_table_is_wide_and_every_row_is_cited(bench: ModuleType) -> None:
    rows = bench.MEASUREMENTS
    assert len(rows) >= 40
    assert len({m.key for m in rows}) == len(rows)
    for m in rows:
        assert "http" in bench.SOURCES[m.source] and m.locator
        assert m.published > 0 and m.model in bench.MODELS and m.kind in bench.KINDS
        assert m.preset in CALIBRATION_PRESETS and m.engine in bench.ENGINES
    assert {m.gpu for m in rows} >= {"a100-80g", "h100-80g", "h200", "l40s"}
    assert {m.tp for m in rows} == {1, 2, 4, 8}
    assert {m.dtype for m in rows} >= {"float16", "bfloat16", "float8"}
    assert min(m.batch for m in rows) == 1 and max(m.batch for m in rows) >= 1000
    assert any(bench.MODELS[m.model].is_moe for m in rows)


def test_the_added_rows_are_cited_held_out_and_outside_the_split(bench: ModuleType) -> None:
    added, rows = bench.ADDED, bench.MEASUREMENTS
    assert len(added) >= 40
    assert not {m.key for m in added} & {m.key for m in rows}
    for m in added:
        assert "http" in bench.SOURCES[m.source] and m.locator
        assert m.published > 0 and m.model in bench.MODELS and m.kind in bench.KINDS
        assert m.preset in CALIBRATION_PRESETS and m.engine in bench.ENGINES
    # Adding rows leaves the split where the rule put it, and no added row calibrates.
    assert bench.calibration_rows(rows) == bench.CALIBRATION
    assert not {m.key for m in added} & bench.CALIBRATION
    assert all(m not in added for engine in bench.FITTED for m in bench.fit_rows(engine))


def test_a_variant_presets_rows_calibrate_its_family_with_its_own_fields(bench: ModuleType) -> None:
    rows = bench.fit_rows("vllm")
    assert rows and {m.preset for m in rows} == {"torch-compile"}
    assert bench.variant_fields("torch-compile") == {"dequant_convert_ops": 1.0}
    assert bench.variant_fields("vllm") == {}


def test_the_split_is_the_rule_and_at_most_a_third(bench: ModuleType) -> None:
    rows, chosen = bench.MEASUREMENTS, bench.CALIBRATION
    assert 0 < len(chosen) <= len(rows) / 3
    groups = Counter((m.engine, m.regime) for m in rows)
    picked = Counter((m.engine, m.regime) for m in rows if m.key in chosen)
    for group, n in groups.items():
        assert picked[group] == n // 3
    # The rule depends on the keys alone: reordering the table changes nothing.
    assert bench.calibration_rows(tuple(reversed(rows))) == chosen


def test_the_printed_errors_are_the_recomputed_ones(bench: ModuleType) -> None:
    result = subprocess.run([sys.executable, str(BENCH), "--json"], capture_output=True, text=True, timeout=300,
                            check=True)
    printed = json.loads(result.stdout)
    held = []
    for m in bench.MEASUREMENTS:
        simulated = bench.simulate(m, Calibration.preset(m.preset))
        error = 100 * (simulated - m.published) / m.published
        assert printed[f"{m.key}_published"] == m.published
        assert printed[f"{m.key}_sim"] == pytest.approx(simulated, rel=1e-12)
        assert printed[f"{m.key}_error"] == pytest.approx(error, rel=1e-9)
        if m.key not in bench.CALIBRATION:
            held.append(abs(error))
    assert printed["fidelity_rows"] == len(bench.MEASUREMENTS)
    assert printed["fidelity_held_out_rows"] == len(held)
    assert printed["fidelity_held_out_within_target"] == sum(e <= 15.0 for e in held)
    added = []
    for m in bench.ADDED:
        error = 100 * (bench.simulate(m, Calibration.preset(m.preset)) - m.published) / m.published
        assert printed[f"{m.key}_error"] == pytest.approx(error, rel=1e-9)
        assert "added, held out" in printed[m.key]
        added.append(abs(error))
    assert printed["added_rows"] == len(added)
    assert printed["added_within_target"] == sum(e <= 15.0 for e in added)
    assert printed["all_held_out_rows"] == len(added) + len(held)
    # The measured mode gives back the published operator times it was built from.
    assert printed["measured_published_points"] > 2000
    assert printed["measured_max_abs_error"] <= 5.0


def test_the_presets_are_the_fit_to_the_calibration_rows(bench: ModuleType) -> None:
    fitted = bench.fit_all()
    assert set(fitted) == set(bench.FITTED) | set(bench.VARIANTS)
    for engine, cal in fitted.items():
        preset, mine = CALIBRATION_PRESETS[engine], bench.FITTED[bench.VARIANTS.get(engine, engine)]
        for name in mine:
            assert getattr(preset, name) == pytest.approx(getattr(cal, name), rel=0.05, abs=1e-7), (engine, name)
        # The others are the preset's (a release preset's inherited ones, its family's fit).
        others = {f.name for f in dataclasses.fields(Calibration)} - set(mine)
        for name in others:
            assert getattr(cal, name) == pytest.approx(getattr(preset, name), rel=0.05, abs=1e-7), (engine, name)
