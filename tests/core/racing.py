"""Threads run so that races show: the interpreter switches between them as often as it can."""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable, Sequence
from typing import Any


def run_racing(target: Callable[..., Any], args: Sequence[tuple[Any, ...]]) -> None:
    """Run ``target(*a)`` for each ``a`` in ``args``, each on its own thread, all at once, with the
    switch interval at its minimum; returns when every thread has ended."""
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        threads = [threading.Thread(target=target, args=a) for a in args]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        sys.setswitchinterval(interval)
