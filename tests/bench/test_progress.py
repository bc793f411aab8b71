"""The progress of a load test: what a line says, when it is printed, and the estimate of the time left."""

from __future__ import annotations

import io

from pdrouter.bench.progress import PlannedPoint, Progress


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


PLAN = [PlannedPoint("colocated-2 @ 4 req/s", 40, 4.0, 10.0), PlannedPoint("colocated-2 @ 8 req/s", 80, 8.0, 10.0),
        PlannedPoint("1p1d @ 4 req/s", 40, 4.0, 10.0), PlannedPoint("1p1d @ 8 req/s", 80, 8.0, 10.0)]


def test_a_line_names_the_layout_rate_point_times_and_estimate() -> None:
    clock, out = Clock(), io.StringIO()
    progress = Progress(PLAN, stream=out, terminal=False, clock=clock)
    progress.begin(0)
    clock.now += 50.0  # 50 wall seconds at time scale 10: 5 simulated seconds
    for _ in range(20):
        progress.update(ok=True)
    line = progress.line()
    assert line.startswith("colocated-2 @ 4 req/s  point 1/4  20/40 req  errors 0  sim 5.0s  wall 50s")
    # every point's arrivals take 100 wall seconds; half of the first of four is done after 50 s
    assert line.endswith("ETA 5m50s")


def test_off_a_terminal_a_line_comes_every_ten_seconds_even_without_progress() -> None:
    clock, out = Clock(), io.StringIO()
    progress = Progress(PLAN, stream=out, terminal=False, clock=clock)
    progress.begin(0)
    for _ in range(60):  # a minute with the runner ticking every second and nothing finishing
        clock.now += 1.0
        progress.tick()
    lines = out.getvalue().splitlines()
    assert len(lines) == 7  # at the start, then every 10 s
    assert all("point 1/4" in line and "\r" not in line for line in lines)
    progress.end()
    assert len(out.getvalue().splitlines()) == 8  # each point ends with its line


def test_on_a_terminal_one_line_is_redrawn() -> None:
    clock, out = Clock(), io.StringIO()
    progress = Progress(PLAN[:1], stream=out, terminal=True, clock=clock)
    progress.begin(0)
    for _ in range(8):
        clock.now += 0.5
        progress.update(ok=False)
    progress.end()
    text = out.getvalue()
    assert text.count("\r") == 10 and text.endswith("\n") and text.count("\n") == 1
    assert "errors 8" in text


def test_skipped_and_unplanned_points_move_the_estimate() -> None:
    clock = Clock()
    progress = Progress([], stream=io.StringIO(), enabled=False, clock=clock)
    progress.begin(0, PlannedPoint("6.2 req/s (search)", 20, 6.2))  # a search step is planned as it starts
    progress.update(ok=True)
    assert progress.fraction() == 0.05
    progress.end()
    assert progress.fraction() == 1.0
    planned = Progress(PLAN, stream=io.StringIO(), enabled=False, clock=clock)
    planned.skip(range(2, 4))  # a layout's rates past --stop-below
    assert planned.fraction() == 0.5
