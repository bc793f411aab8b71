"""Run a module as ``python -m`` would, with a CPU-clock profile of its main thread switched by signals.

    python _cpu_profile.py OUT [-m] MODULE [ARGS...]

``SIGUSR1`` starts the profile (``cProfile`` timed by the thread's CPU clock, ``time.thread_time``, so
time the thread spends waiting or preempted does not count), ``SIGUSR2`` stops it and writes it to
``OUT`` (``pstats`` format). Python runs signal handlers on the main thread, which in a pdrouter
process is the one running the event loop: the profile covers the event loop's work, not other
threads'. Used by ``router_profile.py``.
"""

from __future__ import annotations

import cProfile
import runpy
import signal
import sys
import time
from types import FrameType


def main() -> None:
    out, rest = sys.argv[1], sys.argv[2:]
    if rest[:1] == ["-m"]:  # as a stand-in for the interpreter: ``python -m MODULE ...``
        rest = rest[1:]
    module, args = rest[0], rest[1:]
    profile = cProfile.Profile(time.thread_time)

    def start(signum: int, frame: FrameType | None) -> None:
        profile.enable()

    def stop(signum: int, frame: FrameType | None) -> None:
        profile.disable()
        profile.dump_stats(out)

    signal.signal(signal.SIGUSR1, start)
    signal.signal(signal.SIGUSR2, stop)
    sys.argv = [module, *args]
    runpy.run_module(module, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
