"""Where a load test stands, on stderr: the point (layout, rate, i of n), its requests, simulated and
wall time, errors, and an estimate of the time left for the whole command.

On a terminal one line is redrawn (at most four times a second); elsewhere (a log file, a pipe, CI)
a full line is printed every ``interval_s`` (10 s) and at the end of each point, so a long run in a
log still shows that it moves. The estimate weighs each planned point by the wall time its arrivals
take (requests ÷ rate × time scale; requests alone for a closed loop) and scales the time spent so
far by the share of that work done.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TextIO


@dataclass(frozen=True)
class PlannedPoint:
    """One point a command means to run: its label (``colocated-2 @ 8 req/s``), request count and
    arrival rate (None: a closed loop or a burst), and the time scale its clock runs at."""

    label: str
    requests: int
    rate: float | None = None
    time_scale: float = 1.0

    @property
    def weight(self) -> float:
        """The wall seconds its arrivals take (a closed loop's: its request count)."""
        scale = self.time_scale if self.time_scale > 0 else 1.0
        return self.requests / self.rate * scale if self.rate else float(self.requests)


def _clock(seconds: float) -> str:
    seconds = max(seconds, 0.0)
    if seconds < 60:
        return f"{seconds:.0f}s"
    minutes, s = divmod(int(seconds), 60)
    if minutes < 60:
        return f"{minutes}m{s:02d}s"
    hours, m = divmod(minutes, 60)
    return f"{hours}h{m:02d}m"


class Progress:
    """The progress of one command over its planned points (see the module docstring).

    ``begin(i)`` starts point ``i`` of ``plan``, ``update`` counts a finished request, ``tick`` (the
    runner calls it every second) prints when it is time, ``end`` closes the point."""

    def __init__(self, plan: Sequence[PlannedPoint], *, stream: TextIO | None = None, enabled: bool = True,
                 terminal: bool | None = None, interval_s: float = 10.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.plan = list(plan)
        self.stream = stream or sys.stderr
        self.enabled = enabled
        self.terminal = self.stream.isatty() if terminal is None else terminal
        self.interval_s = interval_s
        self.clock = clock
        self.started = clock()
        self.point: int | None = None
        self.point_started = self.started
        self.done = self.errors = 0
        self.finished_weight = 0.0
        self._shown = -1e18

    @property
    def total_weight(self) -> float:
        return sum(p.weight for p in self.plan) or 1.0

    def begin(self, index: int, plan: PlannedPoint | None = None) -> None:
        """Start point ``index`` (``plan``: what it is, when it was not known ahead, e.g. a search step)."""
        if plan is not None:
            while len(self.plan) <= index:
                self.plan.append(plan)
            self.plan[index] = plan
        self.point = index
        self.point_started = self.clock()
        self.done = self.errors = 0
        self._shown = -1e18
        self.tick()

    def update(self, ok: bool) -> None:
        self.done += 1
        self.errors += not ok
        self.tick()

    def fraction(self) -> float:
        """The share of the planned work done."""
        if self.point is None:
            return self.finished_weight / self.total_weight
        current = self.plan[self.point]
        share = min(self.done / current.requests, 1.0) if current.requests else 1.0
        return min((self.finished_weight + current.weight * share) / self.total_weight, 1.0)

    def line(self) -> str:
        now = self.clock()
        if self.point is None:
            return f"elapsed {_clock(now - self.started)}"
        p = self.plan[self.point]
        wall = now - self.point_started
        scale = p.time_scale if p.time_scale > 0 else 1.0
        done = self.fraction()
        elapsed = now - self.started
        eta = _clock(elapsed * (1 - done) / done) if done > 0.001 else "–"
        return (f"{p.label}  point {self.point + 1}/{len(self.plan)}  {self.done}/{p.requests} req  "
                f"errors {self.errors}  sim {wall / scale:.1f}s  wall {_clock(wall)}  "
                f"total {_clock(elapsed)}  ETA {eta}")

    def tick(self) -> None:
        """Print if it is time: on a terminal at most every 0.25 s, elsewhere every ``interval_s``."""
        if not self.enabled:
            return
        now = self.clock()
        if now - self._shown < (0.25 if self.terminal else self.interval_s):
            return
        self._shown = now
        self._write(self.line())

    def end(self) -> None:
        """Close the current point: its final line, then the estimate moves on."""
        if self.point is None:
            return
        if self.enabled:
            self._write(self.line())
            if self.terminal:
                self.stream.write("\n")
                self.stream.flush()
        self.finished_weight += self.plan[self.point].weight
        self.point = None

    def skip(self, indexes: range) -> None:
        """Points of the plan that will not run (a layout's rates past ``--stop-below``)."""
        self.finished_weight += sum(self.plan[i].weight for i in indexes)

    def _write(self, text: str) -> None:
        if self.terminal:
            self.stream.write("\r\x1b[2K" + text)
        else:
            self.stream.write(text + "\n")
        self.stream.flush()
