"""The fidelity benchmark's table: cited rows, held-out rows, and errors that recompute."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest

from pdrouter.engine.sim.calibration import Calibration

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


def test_the_table_has_cited_calibration_and_held_out_rows(bench: ModuleType) -> None:
    rows = bench.MEASUREMENTS
    assert len(rows) >= 3
    assert len({m.key for m in rows}) == len(rows)
    assert sum(m.calibrates is None for m in rows) >= 1
    fields = {f.name for f in dataclasses.fields(Calibration)}
    fitted = [m.calibrates for m in rows if m.calibrates]
    assert fitted and len(set(fitted)) == len(fitted) and set(fitted) <= fields
    for m in rows:
        assert "http" in bench.SOURCES[m.source]
        assert m.published > 0 and m.model in bench.MODELS and m.gpu in bench.GPUS


def test_the_printed_errors_are_the_recomputed_ones(bench: ModuleType) -> None:
    result = subprocess.run([sys.executable, str(BENCH), "--json"], capture_output=True, text=True, timeout=120,
                            check=True)
    printed = json.loads(result.stdout)
    held_out = 0
    for m in bench.MEASUREMENTS:
        simulated = bench.simulate(m, Calibration())
        assert printed[f"{m.key}_published"] == m.published
        assert printed[f"{m.key}_sim"] == pytest.approx(simulated, rel=1e-12)
        assert printed[f"{m.key}_error"] == pytest.approx(100 * (simulated - m.published) / m.published, rel=1e-9)
        held_out += m.calibrates is None
    assert printed["fidelity_rows"] == len(bench.MEASUREMENTS)
    assert printed["fidelity_held_out_rows"] == held_out


def test_the_defaults_are_the_fit_to_the_calibration_rows(bench: ModuleType) -> None:
    default, fitted = Calibration(), bench.fit()
    for m in bench.MEASUREMENTS:
        if m.calibrates:
            assert getattr(fitted, m.calibrates) == pytest.approx(getattr(default, m.calibrates), rel=0.05)
            assert bench.simulate(m, default) == pytest.approx(m.published, rel=0.02)
