"""This machine's CPUs during a run: how busy they were, and what the load generator and the cluster used.

A load test that runs on the machine it measures (simulated GPUs, ``pdrouter bench compare``'s own
cluster, a ``pdrouter up`` beside the client) can measure the machine instead of the server: when
its CPUs are all busy, requests queue in the router's, the workers' and the load generator's
processes, and the latencies and the served rate are this machine's. Simulated GPUs that keep
their step times (``sim_late_share`` near 0) do not show it: the queue is outside them. Nor does
a load generator whose own event loop is busy all the time: the tokens it times wait in its
socket buffers.

``HostSampler`` reads, once a second, the CPU time of the whole machine (``/proc/stat``), of this
process (the load generator) and, where the server's processes are known (the pid of the
``pdrouter up`` that serves it), of each of its parts: the router, the workers, Redis.
``host_figures`` turns the samples around a run's measured window into shares of a CPU, and
says whether the point was *host-bound*: the machine's CPUs ``HOST_BUSY`` busy or more over the
window, or the load generator ``CLIENT_BUSY`` of one CPU or more (its event loop is one thread).
Where ``/proc`` cannot be read (not Linux), the samples hold only this process's CPU and the
host's share is unknown.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, TypeVar

HOST_BUSY = 0.9
"""A window over which the machine's CPUs were at least this busy is host-bound: runnable work then
waits for a CPU most of the time, whichever process it belongs to."""

CLIENT_BUSY = 0.9
"""A window over which the load generator used at least this much of one CPU is host-bound: its one
event loop is then nearly never idle, so responses wait for it before they are timed."""

SAMPLE_PERIOD_S = 1.0

MIN_JUDGED_S = 2 * SAMPLE_PERIOD_S
"""A window shorter than this is not judged host-bound: its figures are mostly the run's start (the
client's imports and first connections), not the load it measured."""

PROC = Path("/proc")
_TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


@dataclass(frozen=True)
class HostSample:
    """One reading, ``t_s`` wall seconds after the run's start: CPU seconds since each counter began."""

    t_s: float
    busy_s: float | None
    """The machine's CPUs together, busy (user, system, interrupts, stolen), from ``/proc/stat``;
    None where it cannot be read."""
    total_s: float | None
    """The same, busy or idle."""
    own_s: float
    """This process's (the load generator's)."""
    parts: dict[str, float] = field(default_factory=dict)
    """The server's processes by part (``router``, ``workers``, ``prefill``, ``decode``, ``redis``, ``other``)."""
    own_wait: tuple[float, int] | None = None
    """This process's threads' seconds runnable but waiting for a CPU, and the times they were run
    (:class:`WaitCounter`); None where they cannot be read."""
    waits: dict[str, tuple[float, int]] = field(default_factory=dict)
    """The same, for the server's processes by part (a part none of whose could be read is left out)."""


def read_host_cpu(proc: Path = PROC) -> tuple[float, float] | None:
    """(busy, total) CPU seconds of all the machine's CPUs since boot; None where ``/proc/stat`` cannot
    be read. Guest time is part of user time there and is not counted twice."""
    try:
        with open(proc / "stat", "rb") as f:
            fields = f.readline().split()
    except OSError:
        return None
    if not fields or fields[0] != b"cpu" or len(fields) < 5:
        return None
    ticks = [int(v) for v in fields[1:9]]
    idle = ticks[3] + (ticks[4] if len(ticks) > 4 else 0)  # idle, iowait
    total = sum(ticks)
    return (total - idle) / _TICK, total / _TICK


def process_cpu_s(pid: int, proc: Path = PROC) -> float | None:
    """A process's CPU seconds (user + system, all its threads); None once it is gone."""
    try:
        raw = (proc / str(pid) / "stat").read_bytes()
    except OSError:
        return None
    fields = raw[raw.rfind(b")") + 2:].split()  # after the command, which may hold spaces
    return (int(fields[11]) + int(fields[12])) / _TICK  # utime, stime (fields 14 and 15 of stat)


class WaitCounter:
    """How long the threads of some processes waited for a CPU, and how often they were put on one.

    Linux's ``/proc/<pid>/task/<tid>/schedstat`` holds a thread's time on a CPU, its time runnable
    but waiting in a run queue, and how many times it was put on a CPU (nanoseconds, a count). A
    thread that has ended keeps what it was last seen with (threads come and go: vLLM's, a thread
    pool's), so the sums only grow. Over a window, the wait over the number of runs is the mean
    delay between a thread having work (a response arrived, a timer fired) and doing it.
    """

    def __init__(self, proc: Path = PROC) -> None:
        self.proc = proc
        self._last: dict[tuple[int, int], tuple[int, int]] = {}

    def read(self, pids: Sequence[int]) -> tuple[float, int] | None:
        """(seconds waited, times run) of the threads of ``pids`` together; None where none could be read."""
        for pid in pids:
            try:
                tids = os.listdir(self.proc / str(pid) / "task")
            except OSError:
                continue
            for tid in tids:
                try:
                    with open(self.proc / str(pid) / "task" / tid / "schedstat", "rb") as f:
                        fields = f.read().split()
                    self._last[(pid, int(tid))] = (int(fields[1]), int(fields[2]))
                except (OSError, ValueError, IndexError):
                    continue
        wanted = set(pids)
        seen = [v for (pid, _), v in self._last.items() if pid in wanted]
        if not seen:
            return None
        return sum(w for w, _ in seen) / 1e9, sum(n for _, n in seen)


def _part_of(cmdline: list[str]) -> str | None:
    """The part of a ``pdrouter up`` cluster a command line is, or None (inherit its parent's)."""
    # Redis sets its process title, its whole command line in one string: "…/redis-server 127.0.0.1:6379".
    if cmdline and os.path.basename(cmdline[0].split(" ")[0]) == "redis-server":
        return "redis"
    if "pdrouter" in cmdline:
        command = cmdline[cmdline.index("pdrouter") + 1:][:1]
        return {"router": "router", "worker": "workers", "prefill": "prefill", "decode": "decode"}.get(
            command[0] if command else "")
    return None


def cluster_parts(root: int, proc: Path = PROC) -> dict[str, list[int]]:
    """The processes under ``root`` (its pid included), by part: a ``pdrouter router`` is ``router``; a
    ``pdrouter worker`` (colocated), ``pdrouter prefill`` or ``pdrouter decode`` and what it starts (vLLM's
    engine processes) ``workers``, ``prefill`` or ``decode``; a ``redis-server`` ``redis``; the rest
    (``pdrouter up`` itself) ``other``. Empty where ``/proc`` cannot be read."""
    parents: dict[int, int] = {}
    commands: dict[int, list[str]] = {}
    try:
        entries = [e for e in os.listdir(proc) if e.isdigit()]
    except OSError:
        return {}
    for entry in entries:
        pid = int(entry)
        with contextlib.suppress(OSError, ValueError, IndexError):
            raw = (proc / entry / "stat").read_bytes()
            parents[pid] = int(raw[raw.rfind(b")") + 2:].split()[1])
            commands[pid] = (proc / entry / "cmdline").read_bytes().decode(errors="replace").split("\0")
    if root not in parents:
        return {}
    children: dict[int, list[int]] = {}
    for pid, parent in parents.items():
        children.setdefault(parent, []).append(pid)
    parts: dict[str, list[int]] = {}
    stack = [(root, "other")]
    while stack:
        pid, inherited = stack.pop()
        part = _part_of(commands.get(pid, [])) or inherited
        parts.setdefault(part, []).append(pid)
        stack.extend((child, part) for child in children.get(pid, ()))
    return parts


class HostSampler:
    """Samples the machine's CPU, this process's and the server's parts' (``parts``: part → pids) every
    ``period_s`` while a run lasts (``start`` … ``stop``), on the run's event loop."""

    def __init__(self, parts: Mapping[str, Sequence[int]] | None = None, period_s: float = SAMPLE_PERIOD_S,
                 proc: Path = PROC) -> None:
        self.parts = {name: list(pids) for name, pids in (parts or {}).items()}
        self.period_s = period_s
        self.proc = proc
        self.samples: list[HostSample] = []
        self._last: dict[int, float] = {}
        self._waits = WaitCounter(proc)
        self._own = [os.getpid()]
        self._zero = 0.0
        self._task: asyncio.Task[None] | None = None

    def sample(self) -> HostSample:
        """One reading now (a process that has ended keeps the CPU time it was last seen with)."""
        host = read_host_cpu(self.proc)
        parts: dict[str, float] = {}
        for name, pids in self.parts.items():
            total = 0.0
            for pid in pids:
                cpu = process_cpu_s(pid, self.proc)
                if cpu is not None:
                    self._last[pid] = cpu
                total += self._last.get(pid, 0.0)
            parts[name] = total
        waits = {name: w for name, pids in self.parts.items() if (w := self._waits.read(pids)) is not None}
        s = HostSample(time.perf_counter() - self._zero, None if host is None else host[0],
                       None if host is None else host[1], time.process_time(), parts,
                       self._waits.read(self._own), waits)
        self.samples.append(s)
        return s

    def start(self, zero: float) -> None:
        """Sample now and every ``period_s`` after; ``zero``: the run's start (``time.perf_counter()``)."""
        self._zero = zero
        self.sample()
        self._task = asyncio.get_running_loop().create_task(self._loop())

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(self.period_s)
            self.sample()

    async def stop(self) -> None:
        """Stop sampling, with a last reading."""
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None
        self.sample()


class _Timed(Protocol):
    @property
    def t_s(self) -> float: ...


S = TypeVar("S", bound=_Timed)


def enclosing(samples: Sequence[S], start_s: float, end_s: float) -> tuple[S, S]:
    """Of samples taken during a run (two or more), the last at or before ``start_s`` and the first at or
    after ``end_s``: the readings that enclose the stretch most closely (the first and the last sample
    where none does)."""
    ordered = sorted(samples, key=lambda s: s.t_s)
    before = [s for s in ordered if s.t_s <= start_s]
    after = [s for s in ordered if s.t_s >= end_s]
    return (before[-1] if before else ordered[0]), (after[0] if after else ordered[-1])


def host_figures(samples: Sequence[HostSample], start_s: float, end_s: float,
                 cpus: int | None = None) -> dict[str, Any]:
    """The machine over the wall-clock stretch ``start_s`` … ``end_s`` of a run (seconds after its start),
    from the samples that enclose it most closely: ``cpus``, its CPUs' ``busy_share`` (0–1; None where
    unknown), the ``load_generator_cpu`` and each server part's (``processes``) in CPUs, the stretch
    they cover (``span_s``), and whether it was ``host_bound`` with the ``reason``. Empty with fewer
    than two samples."""
    if len(samples) < 2:
        return {}
    a, b = enclosing(samples, start_s, end_s)
    span = b.t_s - a.t_s
    if span <= 0:
        return {}
    busy = None
    if a.busy_s is not None and b.busy_s is not None and a.total_s is not None and b.total_s is not None \
            and b.total_s > a.total_s:
        busy = (b.busy_s - a.busy_s) / (b.total_s - a.total_s)
    client = (b.own_s - a.own_s) / span
    processes = {name: (b.parts.get(name, 0.0) - a.parts.get(name, 0.0)) / span for name in b.parts}
    client_wait = _waited(a.own_wait, b.own_wait, span)
    waits = {name: w for name in b.waits if (w := _waited(a.waits.get(name), b.waits[name], span)) is not None}
    n = cpus if cpus is not None else (os.cpu_count() or 1)
    reasons = []
    if span >= MIN_JUDGED_S:  # (a shorter one: a run that failed at once, or a handful of requests)
        if busy is not None and busy >= HOST_BUSY:
            reasons.append(f"its {n} CPUs were {100 * busy:.0f}% busy")
        if client >= CLIENT_BUSY:
            reasons.append(f"the load generator used {client:.2f} of a CPU")
    return {"cpus": n, "span_s": span, "busy_share": busy, "load_generator_cpu": client, "processes": processes,
            "load_generator_wait": client_wait, "processes_wait": waits,
            "host_bound": bool(reasons), "reason": " and ".join(reasons)}


def _waited(a: tuple[float, int] | None, b: tuple[float, int] | None, span: float) -> dict[str, float | None] | None:
    """Between two readings of a :class:`WaitCounter`: ``cpus``, the seconds waited for a CPU over the
    wall seconds (threads waiting together count each), and ``delay_ms``, the mean wait each time a
    thread was run (None when none was)."""
    if a is None or b is None:
        return None
    waited, runs = b[0] - a[0], b[1] - a[1]
    return {"cpus": waited / span, "delay_ms": 1e3 * waited / runs if runs > 0 else None}


def describe(host: Mapping[str, Any]) -> str:
    """One sentence of a run's host figures ("" without any)."""
    if not host:
        return ""
    busy = host.get("busy_share")
    text = (f"This machine ({host['cpus']} CPUs): "
            + ("busy unknown" if busy is None else f"{100 * busy:.0f}% busy")
            + f" over the window; the load generator used {host['load_generator_cpu']:.2f} of a CPU")
    parts = host.get("processes") or {}
    shown = [f"{name} {cpu:.2f}" for name, cpu in sorted(parts.items(), key=lambda kv: -kv[1]) if name != "other"]
    if shown:
        text += "; the server's processes, in CPUs: " + ", ".join(shown)
    text += "."
    parts_waited = sorted(((name, w) for name, w in (host.get("processes_wait") or {}).items() if name != "other"),
                          key=lambda kv: -kv[1]["cpus"])
    waits = [("the load generator", host.get("load_generator_wait")), *parts_waited]
    known = [f"{name} {w['cpus']:.2f}" + ("" if w["delay_ms"] is None else f" ({w['delay_ms']:.1f} ms a wake-up)")
             for name, w in waits if w is not None]
    if known:
        text += " Runnable but waited for a CPU, in CPUs (and the mean wait each time a thread was run): " \
            + ", ".join(known) + "."
    if host.get("host_bound"):
        text += (f" **This machine was busy throughout** ({host['reason']}): requests also queued in the processes"
                 " on it (the load generator's included), so the point's latencies and served rate hold this"
                 " machine's queueing too; the server alone would do at least as well, and a target missed here"
                 " may be this machine's limit, not the server's. With simulated GPUs, raise --time-scale.")
    return text
