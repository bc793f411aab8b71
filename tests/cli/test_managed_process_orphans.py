"""A child started by ``ManagedProcess`` stops when the process that started it dies, by default.

A test or a benchmark killed mid-run (SIGKILL, a CI timeout) must not leave its workers running and
spending the machine's CPU. The parent here is a real process that starts a real simulated worker and
is then killed with SIGKILL, so it runs no clean-up of its own. The wait is a hang guard.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time

WAIT_S = 60.0  # hang guard: the child gets SIGTERM at once and stops in about a second

PARENT = textwrap.dedent("""
    import time
    from pdrouter.cli.local_cluster import ManagedProcess, worker_args

    args = worker_args("worker", "", sim=["--model-preset", "tiny", "--time-scale", "0"])
    child = ManagedProcess("worker", [a for a in args if a not in ("--model", "")])
    child.wait_ready()
    print(child.proc.pid, flush=True)
    time.sleep(600)
""")


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_a_child_stops_when_its_parent_is_killed() -> None:
    parent = subprocess.Popen([sys.executable, "-c", PARENT], stdout=subprocess.PIPE, text=True)
    try:
        assert parent.stdout is not None
        line = parent.stdout.readline()
        assert line.strip().isdigit(), f"the parent printed {line!r}"
        child = int(line)
        assert _alive(child)
    finally:
        parent.kill()
        parent.wait(WAIT_S)
    deadline = time.monotonic() + WAIT_S
    while _alive(child) and time.monotonic() < deadline:
        time.sleep(0.1)
    if _alive(child):
        os.kill(child, 9)
        raise AssertionError(f"the worker {child} outlived its parent by {WAIT_S:.0f} s")
