"""``pdrouter bench compare``: layouts on equal GPUs, the winner per rate, the crossovers, the report and plots."""

from __future__ import annotations

import importlib.util
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


def test_a_log_axis_keeps_an_slo_at_a_power_of_ten_off_its_bottom_edge() -> None:
    from pdrouter.bench.plots import _y_axis

    series = [{"points": [{"y": 120.0}, {"y": 9000.0}]}]
    lines = [{"axis": "y", "value": 100.0}]
    axis = _y_axis(series, lines)
    assert axis["scale"] == "log" and axis["min"] < 100.0 and axis["max"] > 9000.0


def test_the_winner_per_rate_ties_and_crossovers() -> None:
    co = LayoutResult(Layout("colocated-2", colocated=2), [point(1, 1.0), point(4, 3.0), point(8, 4.0)])
    pd = LayoutResult(Layout("1p1d", prefill=1, decode=1), [point(1, 0.99), point(4, 3.5), point(8, 6.0)])
    winners = best_by_rate([co, pd])
    assert winners == [(1.0, "tie: colocated-2, 1p1d"), (4.0, "1p1d"), (8.0, "1p1d")]
    assert crossovers(winners) == [(1.0, 4.0, "tie: colocated-2, 1p1d", "1p1d")]


def test_compare_quick_sends_fresh_prompts_to_every_point_and_measures_steady_windows(tmp_path: Path) -> None:
    done = subprocess.run([sys.executable, "-m", "pdrouter", "bench", "compare", "--quick", "--no-progress",
                           "--json", "--out", str(tmp_path)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr + done.stdout
    report = Path(json.loads(done.stdout)["report"])
    folder = report.parent
    text = report.read_text()
    assert "| rate | colocated-2 | 1p1d | best | why |" in text and "Crossovers:" in text
    assert "simulated time lost to this machine" in text and "SLO: ttft <= 1000 ms, tpot <= 50 ms" in text
    assert "60–120 requests a point" in text and "warm-up" in text and "time scale 1" in text
    assert "not run" not in text  # nothing was skipped
    layouts = json.loads((folder / "compare.json").read_text())["layouts"]
    assert [len(layout["points"]) for layout in layouts] == [2, 2]
    digests: list[str] = []
    for layout in layouts:
        for p in layout["points"]:
            assert p["requests"] == 6 * p["rate"]  # rate × 6 simulated seconds
            assert p["window"]["steady"], p["window"]
            assert 0 < p["window"]["start_s"] < p["window"]["end_s"]
            doc = json.loads(Path(p["file"]).read_text())
            records = doc["requests"]
            assert len(records) == p["requests"]  # the warm-up requests are not among the measured ones
            digests += [r["prompt_digest"] for r in records]
            # nothing shared, so nothing may come from a prefix cache: at every rate, for every layout
            assert p["prefix"]["expected_hit_rate"] == 0.0
            assert p["prefix"]["measured_hit_rate"] == 0.0 and not p["prefix"]["flagged"]
            assert p["router"]["prefix_hit_rate"] in (None, 0.0)
            met = p["summary"]["slo_met"]
            assert p["slo_met_percent"] == pytest.approx(100.0 * met / p["window"]["requests"])
            # Simulated workers report how much of their modeled time this machine made late.
            assert p["router"]["sim_late_share"] is not None and 0 <= p["router"]["sim_late_share"] < 1
            # This machine's CPU over the window, with the cluster's own processes by part.
            host = p["host"]
            assert host["cpus"] >= 1 and 0 < host["busy_share"] <= 1 and host["load_generator_cpu"] > 0
            workers = ("workers",) if layout["name"].startswith("colocated") else ("prefill", "decode")
            parts = {"router", "redis", *workers}
            assert parts <= set(host["processes"]), host
            assert all(cpu >= 0 for cpu in host["processes"].values()) and host["processes"]["router"] > 0
            assert doc["host"] == host
            assert parts <= set(host["processes_wait"]), host  # how long each part waited for a CPU
            assert all(w["cpus"] >= 0 for w in host["processes_wait"].values())
            assert doc["steady"]["router_ttft"]["count"] > 0  # the router's own TTFT over the window
    assert len(digests) == 6 * (10 + 20) * 2 and len(set(digests)) == len(digests)  # no prompt sent twice
    check_plots(folder, slo_ms={"ttft_p99": 1000.0, "tpot_p99": 50.0, "itl_p99": 50.0}, target=90.0)


def check_plots(folder: Path, *, slo_ms: dict[str, float], target: float) -> None:
    """Every PNG of a comparison drawn, and its spec in plots.json carries the lines a reader needs."""
    import matplotlib.image

    specs = json.loads((folder / "plots.json").read_text())
    assert set(specs) == {"ttft_p99", "tpot_p99", "itl_p99", "slo_met_percent", "goodput", "pareto"}
    for name, spec in specs.items():
        image = matplotlib.image.imread(folder / f"{name}.png")
        assert image.shape[0] > 200 and image.shape[1] > 300
        assert image[..., :3].std() > 0.05  # not a blank canvas: axes and curves were drawn
        assert {s["layout"] for s in spec["series"]} == {"colocated-2", "1p1d"}
        assert all(len(s["points"]) == 2 for s in spec["series"])
        assert spec["y"]["min"] == 0.0 or spec["y"]["scale"] == "log"  # no axis zooms noise into a trend
        assert "requests a point" in spec["footer"] and "time scale" in spec["footer"]
        if name in slo_ms:
            assert [line["value"] for line in spec["lines"] if line["kind"] == "slo"] == [slo_ms[name]]
            if spec["y"]["scale"] == "log":  # the SLO line inside the frame, not on its bottom edge
                assert spec["y"]["min"] < slo_ms[name] < spec["y"]["max"]
    attainment = specs["slo_met_percent"]
    assert (attainment["y"]["min"], attainment["y"]["max"]) == (0.0, 100.0)
    assert [line["value"] for line in attainment["lines"] if line["kind"] == "target"] == [target]
    assert all(0 <= p["y"] <= 100 for s in attainment["series"] for p in s["points"])
    assert ("offered", "diagonal") in {(line["kind"], line["axis"]) for line in specs["goodput"]["lines"]}
    kinds = {(line["kind"], line["axis"]) for line in specs["pareto"]["lines"]}
    assert kinds == {("slo", "x")}
    assert all(p["label"].endswith("/s") for s in specs["pareto"]["series"] for p in s["points"])


def result(name: str, rates_goodput: list[tuple[float, float]], *, steady: bool = True) -> LayoutResult:
    layout = Layout(name, colocated=2) if name.startswith("colocated") else Layout(name, prefill=1, decode=1)
    points = []
    for rate, goodput in rates_goodput:
        p = point(rate, goodput)
        p |= {"slo_met_percent": 100.0 * goodput / rate, "requests": 100, "offered_rate": rate,
              "window": {"start_s": 1.0, "end_s": 10.0, "requests": 90 if steady else 20, "steady": steady,
                         "reason": "" if steady else "20 requests arrived in the window, fewer than 50"},
              "prefix": {"expected_hit_rate": 0.0, "measured_hit_rate": 0.0, "flagged": False}}
        points.append(p)
    return LayoutResult(layout, points)


def test_a_point_too_short_is_marked_in_the_report_and_drawn_hollow(tmp_path: Path) -> None:
    from pdrouter.bench.compare_report import CompareSetup, write_compare_report
    from pdrouter.bench.stats import Slo

    results = [result("colocated-2", [(4, 4.0), (8, 7.0)], steady=False), result("1p1d", [(4, 4.0), (8, 8.0)])]
    report = write_compare_report(results, tmp_path, CompareSetup("t", Slo.parse("ttft=1s"), 90.0))
    text = report.read_text()
    assert "too short to reach steady state**: colocated-2 at 4 req/s, colocated-2 at 8 req/s" in text
    assert "| 4 | 100%† | 100% |" in text
    assert "fewer than 50" in text
    specs = json.loads((tmp_path / "plots.json").read_text())
    hollow = {s["layout"]: [p["steady"] for p in s["points"]] for s in specs["slo_met_percent"]["series"]}
    assert hollow == {"colocated-2": [False, False], "1p1d": [True, True]}
    assert specs["slo_met_percent"]["notes"] == ["colocated-2 and 1p1d at 4 req/s"]  # the tie is named


def test_prefix_hits_above_the_workloads_are_flagged(tmp_path: Path) -> None:
    from pdrouter.bench.compare_report import CompareSetup, write_compare_report
    from pdrouter.bench.stats import Slo

    results = [result("colocated-2", [(4, 4.0)]), result("1p1d", [(4, 4.0)])]
    results[1].points[0]["prefix"] = {"expected_hit_rate": 0.0, "measured_hit_rate": 0.93, "flagged": True}
    text = write_compare_report(results, tmp_path, CompareSetup("t", Slo.parse("ttft=1s"), 90.0)).read_text()
    assert "Prefix hits above what the workload allows** (prompts served from a cache they should not have been " \
           "in): 1p1d at 4 req/s" in text
    assert "93.0% / 0.0% **above the workload's**" in text


def test_a_host_bound_point_is_marked_and_not_taken_for_the_layouts_limit(tmp_path: Path) -> None:
    """A point over whose window this machine's CPUs were busy all the time measured the machine too: it
    is marked ‡ in the tables, named with its reason, crossed in the plots, and the rate a layout missed
    there is not taken for the layout's limit."""
    from pdrouter.bench.compare_report import CompareSetup, write_compare_report
    from pdrouter.bench.stats import Slo

    results = [result("colocated-2", [(4, 4.0), (8, 5.0)]), result("1p1d", [(4, 4.0), (8, 8.0)])]
    quiet = {"cpus": 2, "busy_share": 0.5, "load_generator_cpu": 0.2, "processes": {}, "host_bound": False,
             "reason": ""}
    for r in results:
        for p in r.points:
            p["host"] = quiet
    results[0].points[1]["host"] = quiet | {"busy_share": 0.97, "host_bound": True,
                                            "reason": "its 2 CPUs were 97% busy"}
    text = write_compare_report(results, tmp_path, CompareSetup("t", Slo.parse("ttft=1s"), 90.0)).read_text()
    assert "‡ **this machine was busy throughout** (host-bound): colocated-2 at 8 req/s (its 2 CPUs were 97% busy)" \
        in text
    assert "| 8 | 62%‡ | 100% | 1p1d |" in text and "; ‡: this machine was measured at this rate too |" in text
    assert "| colocated-2 | 2 | 4 req/s; the rate it missed ‡: host-bound, maybe this machine's limit | 2 |" in text
    assert "| 1p1d | 2 | ≥ 8 req/s (the highest tried) | 4 |" in text
    assert "Not shown here: how far colocated-2 would go on a machine that keeps up" in text
    assert "| 97.0%, 0.20 **‡** |" in text and "| 50.0%, 0.20 |" in text  # the points' table
    specs = json.loads((tmp_path / "plots.json").read_text())
    crossed = {s["layout"]: [p["host_bound"] for p in s["points"]] for s in specs["goodput"]["series"]}
    assert crossed == {"colocated-2": [False, True], "1p1d": [False, False]}
    assert specs["goodput"]["crossed_means"].startswith("this machine was busy throughout")


def test_points_short_to_settle_and_points_out_of_kv_room_are_named(tmp_path: Path) -> None:
    """A steady window of fewer than three lifetimes is marked § with its count of lifetimes; a point whose
    workers' KV peaked full is named, and the rate a layout missed there is said to have run out of KV room
    (not taken for this machine's limit)."""
    from pdrouter.bench.compare_report import CompareSetup, write_compare_report
    from pdrouter.bench.stats import Slo

    results = [result("colocated-2", [(4, 4.0), (8, 8.0)]), result("1p1d", [(4, 4.0), (8, 3.0)])]
    results[0].points[1]["window"] |= {"lifetime_s": 7.0, "lifetimes": 9.0 / 7.0, "short_to_settle": True}
    results[1].points[1]["router"] = {"kv_water_level_peak": {"decode-0": 0.99, "decode-1": 0.6},
                                      "admission_queue_peak": 40}
    text = write_compare_report(results, tmp_path, CompareSetup("t", Slo.parse("ttft=1s"), 90.0)).read_text()
    assert "§ **short to settle**: colocated-2 at 8 req/s (1.3 lifetimes of 7 s). Their windows span fewer than 3" \
        in text
    assert "Longer points tell: --point-duration 30 or more gives its window 3 lifetimes." in text  # 4 × 7 s
    assert "| 8 | 100%§ | 38% | colocated-2 |" in text
    assert "| yes, short to settle §: 1.3 lifetimes |" in text  # the points' table
    assert "**KV room ran out** (water level peak ≥ 0.95 of the pool): 1p1d at 8 req/s (1 of 2 workers). " in text
    assert "| 1p1d | 2 | 4 req/s; at the rate it missed its KV room ran out | 2 |" in text
    assert "host-bound" not in text
    specs = json.loads((tmp_path / "plots.json").read_text())
    half = {s["layout"]: [p["short_to_settle"] for p in s["points"]] for s in specs["goodput"]["series"]}
    assert half == {"colocated-2": [False, True], "1p1d": [False, False]}  # drawn half filled
    assert specs["goodput"]["half_means"].startswith("short to settle")


def test_a_run_report_names_a_short_window_and_kv_that_ran_out() -> None:
    from pdrouter.bench.report import markdown

    window = {"start_s": 7.0, "end_s": 20.0, "length_s": 13.0, "requests": 650, "warmup_s": 7.0, "steady": True,
              "reason": "", "lifetime_s": 6.5, "lifetimes": 2.0, "short_to_settle": True, "settle_lifetimes": 3.0}
    summary = {"completed": 1, "failed": 0, "duration_s": 10.0, "request_rate": 1.0, "input_tokens_per_s": 1.0,
               "output_tokens_per_s": 1.0, "errors": {}, "tokens_per_chunk": None,
               **{k: {"count": 0} for k in ("ttft", "tpot", "itl", "e2e")}}
    router = {"kv_water_level_peak": {"decode-0": 0.98, "decode-1": 1.0}, "admission_queue_peak": 1020.0}
    doc = {"config": {"time_scale": 1}, "summary": summary, "router": router,
           "steady": {"window": window, "saturated": True, "summary": summary}}
    text = markdown(doc)
    assert "**Short to settle:** the window spans 2 of its first requests' p90 lifetimes (6.5 s), fewer than 3." \
        in text
    assert "arrivals over 30 s or more (`--point-duration`, `--num-requests`) give it three lifetimes" in text
    assert ("**KV room ran out** on 2 of 2 workers (water level peak 0.98–1.00; the router's admission queue held "
            "up to 1020 requests)") in text
    calm = markdown(doc | {"router": {"kv_water_level_peak": {"decode-0": 0.5}},
                           "steady": {"window": window | {"lifetimes": 4.0, "short_to_settle": False},
                                      "saturated": False, "summary": summary}})
    assert "Short to settle" not in calm and "KV room ran out" not in calm


def test_a_point_line_flags_a_window_short_to_settle_and_kv_full(tmp_path: Path) -> None:
    """The one-line summary a sweep or comparison prints per point, from a ramping server's records."""
    from pdrouter.bench.point import Outcome, point_line
    from pdrouter.bench.stats import summarize
    from pdrouter.bench.window import measure_window, window_summary

    from .test_window import poisson, ramping

    records = ramping(poisson(50.0, 50 * 20), 6.0, 14.0, 20.0)
    window = measure_window(records)
    router = {"kv_water_level_peak": {"decode-0": 0.97, "decode-1": 0.99, "decode-2": 0.4}}
    outcome = Outcome(summarize(records, 30.0), window_summary(records, window), window,
                      {"prefix": {}, "router": router}, tmp_path / "x.json", False)
    line = point_line("1p1d @ 50/s", outcome)
    assert f"[short to settle: {window.lifetimes:.2g} lifetimes of {window.lifetime_s:.3g} s]" in line
    assert "[KV full on 2 of 3 workers]" in line
    outcome.document["router"] = {}
    assert "KV full" not in point_line("1p1d @ 50/s", outcome)


def test_a_point_too_small_for_a_steady_window_is_refused_before_any_cluster(tmp_path: Path) -> None:
    done = subprocess.run([sys.executable, "-m", "pdrouter", "bench", "compare", "--gpus", "2", "--layouts",
                           "colocated,1p1d", "--rates", "4,8", "--point-duration", "5", "--out", str(tmp_path)],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2, done.stderr
    assert "a point of 20 requests at 4 req/s is too short to reach steady state" in done.stderr
    assert "--point-duration 14" in done.stderr and done.stderr.strip().count("\n") == 0
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize(("args", "expected"), [
    (["--attainment", "0"], "--attainment"),
    (["--attainment", "150"], "--attainment"),
    (["--point-duration", "-1"], "--point-duration"),
    (["--stop-below", "0"], "--stop-below"),
    (["--warmup", "-2"], "--warmup"),
    (["--layouts", "colocated,3p3d"], "--layouts"),
    (["--backend", "torch", "--time-scale", "4"], "--time-scale applies to simulated GPUs"),
    (["--backend", "torch", "--tp", "2"], "--tp applies to simulated GPUs"),
    (["--backend", "vllm", "--time-scale", "0"], "--backend vllm runs in real time"),
])
def test_bad_compare_arguments_are_one_line_errors_before_any_cluster(args: list[str], expected: str,
                                                                      tmp_path: Path) -> None:
    done = subprocess.run([sys.executable, "-m", "pdrouter", "bench", "compare", "--gpus", "2", "--layouts",
                           "colocated,1p1d", "--out", str(tmp_path), *args], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 2, done.stderr
    assert expected in done.stderr and done.stderr.strip().count("\n") == 0, done.stderr
    assert not list(tmp_path.iterdir())  # nothing was brought up or written


@pytest.mark.skipif(importlib.util.find_spec("pdrouter.transfer.vllm") is not None,
                    reason="this install runs prefill and decode workers on vLLM")
def test_a_disaggregated_layout_on_vllm_without_its_connector_is_refused_before_any_cluster(tmp_path: Path) -> None:
    done = subprocess.run([sys.executable, "-m", "pdrouter", "bench", "compare", "--backend", "vllm", "--gpus", "2",
                           "--layouts", "colocated,1p1d", "--out", str(tmp_path)], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 2, done.stderr
    expected = ("1p1d on vLLM needs this pdrouter's vLLM KV connector" if importlib.util.find_spec("vllm")
                else "--backend vllm needs vLLM, which is not installed")
    assert expected in done.stderr and done.stderr.strip().count("\n") == 0, done.stderr
    assert not list(tmp_path.iterdir())
