"""``pdrouter bench compare``: layouts on equal GPUs, the winner per rate, the crossovers, the report and plots."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from pdrouter.bench.compare import Layout, LayoutResult, best_by_rate, crossovers, parse_layouts
from pdrouter.core.errors import ConfigError


def test_layouts_split_equal_gpus() -> None:
    names = [layout.name for layout in parse_layouts("all", 8)]
    assert names == ["colocated-8", "1p7d", "2p6d", "3p5d", "4p4d", "5p3d", "6p2d", "7p1d"]
    tp4 = parse_layouts("colocated,1p1d", 8, tp=4)
    assert [(x.gpus, x.up_args()) for x in tp4] == [
        (8, ["--mode", "colocated", "--workers", "2"]),
        (8, ["--mode", "disaggregated", "--prefill", "1", "--decode", "1"])]


@pytest.mark.parametrize(("text", "gpus", "tp", "match"), [
    ("colocated,2p2d", 8, 1, "uses 4 workers"),
    ("colocated,2x6", 8, 1, "neither"),
    ("colocated", 8, 1, "at least two"),
    ("all", 6, 4, "multiple of --tp"),
])
def test_bad_layouts_say_what_to_fix(text: str, gpus: int, tp: int, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        parse_layouts(text, gpus, tp)


def point(rate: float, goodput: float) -> dict[str, Any]:
    stats = {"mean": 0.01, "p50": 0.01, "p90": 0.01, "p99": 0.01, "count": 1}
    return {"rate": rate, "router": {}, "summary": {"goodput": goodput, "ttft": stats, "itl": stats,
                                                    "tpot": stats, "output_tokens_per_s": 100.0}}


def test_max_rate_within_stops_at_the_first_rate_missing_the_target() -> None:
    from pdrouter.bench.compare import max_rate_within, slo_attainment

    def at(rate: float, share: float | None) -> dict[str, Any]:
        return {**point(rate, 0.0), "slo_met_percent": share}

    layout = Layout("1p1d", prefill=1, decode=1)
    assert max_rate_within(LayoutResult(layout, [at(1, 100), at(2, 95), at(4, 80), at(8, 99)]), 90) == 2
    assert max_rate_within(LayoutResult(layout, [at(1, 50)]), 90) is None
    assert max_rate_within(LayoutResult(layout, [at(1, 100), at(2, None)]), 90) == 1
    assert slo_attainment({"slo_met": 9, "requests": 12}) == 75.0
    assert slo_attainment({"slo_met": None, "requests": 12}) is None


def test_the_winner_per_rate_ties_and_crossovers() -> None:
    co = LayoutResult(Layout("colocated-2", colocated=2), [point(1, 1.0), point(4, 3.0), point(8, 4.0)])
    pd = LayoutResult(Layout("1p1d", prefill=1, decode=1), [point(1, 0.99), point(4, 3.5), point(8, 6.0)])
    winners = best_by_rate([co, pd])
    assert winners == [(1.0, "tie: colocated-2, 1p1d"), (4.0, "1p1d"), (8.0, "1p1d")]
    assert crossovers(winners) == [(1.0, 4.0, "tie: colocated-2, 1p1d", "1p1d")]


def test_compare_quick_writes_the_report_and_its_plots(tmp_path: Path) -> None:
    done = subprocess.run([sys.executable, "-m", "pdrouter", "bench", "compare", "--quick", "--no-progress",
                           "--json", "--out", str(tmp_path)], capture_output=True, text=True, timeout=170)
    assert done.returncode == 0, done.stderr + done.stdout
    report = Path(json.loads(done.stdout)["report"])
    folder = report.parent
    text = report.read_text()
    assert "| rate | colocated-2 | 1p1d | best | why |" in text and "Crossovers:" in text
    assert "simulated time lost to this machine" in text
    data = json.loads((folder / "plots.json").read_text())
    for key in ("goodput", "slo_met_percent", "ttft_p99", "itl_p99", "pareto"):
        assert set(data[key]) == {"colocated-2", "1p1d"}
        assert all(len(points) == 2 for points in data[key].values())
    # Goodput cannot exceed the offered rate by more than the noise of 16 Poisson arrivals.
    assert all(0 < y <= 2.0 * x for pts in data["goodput"].values() for x, y in pts)
    import matplotlib.image

    assert all(0 <= y <= 100 for pts in data["slo_met_percent"].values() for _, y in pts)
    assert "SLO attainment" in text and "highest rate" in text
    for name in ("goodput", "slo_met_percent", "ttft_p99", "itl_p99", "pareto"):
        image = matplotlib.image.imread(folder / f"{name}.png")
        assert image.shape[0] > 200 and image.shape[1] > 300
        assert image[..., :3].std() > 0.05  # not a blank canvas: axes and curves were drawn
    layouts = json.loads((folder / "compare.json").read_text())["layouts"]
    assert [len(layout["points"]) for layout in layouts] == [2, 2]
    assert all(p["summary"]["completed"] == 16 for layout in layouts for p in layout["points"])
    for layout in layouts:  # the attainment each point reports is its own records' share within the SLO
        for p in layout["points"]:
            records = json.loads(Path(p["file"]).read_text())["requests"]
            assert len(records) == 16  # the warm-up requests are not among the measured ones
            met = p["summary"]["slo_met"]
            assert p["slo_met_percent"] == pytest.approx(100.0 * met / 16)
            # Simulated workers report how much of their modeled time this machine made late.
            assert p["router"]["sim_late_share"] is not None and 0 <= p["router"]["sim_late_share"] < 1


@pytest.mark.parametrize(("args", "expected"), [
    (["--attainment", "0"], "--attainment"),
    (["--attainment", "150"], "--attainment"),
    (["--point-duration", "-1"], "--point-duration"),
    (["--stop-below", "0"], "--stop-below"),
    (["--warmup", "-2"], "--warmup"),
    (["--layouts", "colocated,3p3d"], "--layouts"),
])
def test_bad_compare_arguments_are_one_line_errors_before_any_cluster(args: list[str], expected: str,
                                                                      tmp_path: Path) -> None:
    done = subprocess.run([sys.executable, "-m", "pdrouter", "bench", "compare", "--gpus", "2", "--layouts",
                           "colocated,1p1d", "--out", str(tmp_path), *args], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 2, done.stderr
    assert expected in done.stderr and done.stderr.strip().count("\n") == 0, done.stderr
    assert not list(tmp_path.iterdir())  # nothing was brought up or written
