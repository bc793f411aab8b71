"""The pure parts of ``benchmarks/sim_dynamics.py`` (its runs against vLLM are in the vLLM group)."""

from __future__ import annotations

import importlib
import os
import sys
from pathlib import Path
from types import ModuleType

import pytest

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "sim_dynamics.py"


@pytest.fixture(scope="module")
def sd() -> ModuleType:
    """The benchmark as a module (it puts its own folder on the path for its helpers)."""
    sys.path.insert(0, str(BENCH.parent))
    return importlib.import_module(BENCH.stem)


def test_busy_shares_are_each_cpus_busy_ticks_over_its_ticks(sd: ModuleType) -> None:
    before = {0: (100, 1000), 1: (500, 1000), 2: (0, 1000)}
    after = {0: (150, 1100), 1: (600, 1100), 3: (5, 10)}
    assert sd.busy_shares(before, after) == {0: 0.5, 1: 1.0}  # CPU 2 gone, CPU 3 new: neither counted


def test_this_machines_cpus_are_read_from_proc_stat(sd: ModuleType) -> None:
    readings = sd.cpu_jiffies()
    if not os.path.exists("/proc/stat"):
        assert readings == {}
        return
    assert set(readings) >= set(os.sched_getaffinity(0))
    assert all(0 <= busy <= total for busy, total in readings.values())


def test_decode_probes_take_enough_tpots_and_prefills_every_round(sd: ModuleType) -> None:
    plan = [sd.Probe("prefill", 16), sd.Probe("decode", 1, 32), sd.Probe("decode", 32, 32)]
    taken: list[str] = []

    async def fake_sample(url: str, model: str, probe: object, prompts: object, workers: int = 1,
                          limits: object = None) -> list[float]:
        taken.append(probe.name)  # type: ignore[attr-defined]
        return [0.01] * (1 if probe.kind == "prefill" else probe.size * workers)  # type: ignore[attr-defined]

    original = sd.sample
    sd.sample = fake_sample
    try:
        import asyncio

        asyncio.run(sd.measure("http://x/v1", "m", plan, sd.Prompts(1), reps=7))
    finally:
        sd.sample = original
    assert taken.count("prefill_16") == 7
    assert taken.count("decode_b1_c32") == sd.DECODE_SAMPLES  # one TPOT a burst
    assert taken.count("decode_b32_c32") == 7 // 3
