"""One thread that fires callbacks at monotonic deadlines (the receiver's transfer deadlines)."""

from __future__ import annotations

import heapq
import itertools
import logging
import threading
import time
from collections.abc import Callable

log = logging.getLogger(__name__)


class DeadlineWatch:
    """Calls each registered callback once its ``time.monotonic()`` deadline passes.

    Callbacks run on the watch's own thread, one at a time, and must tolerate being late or being
    for something that already finished (expiring a finished transfer changes nothing).
    """

    def __init__(self, name: str) -> None:
        self._cv = threading.Condition()
        self._heap: list[tuple[float, int, Callable[[], None]]] = []
        self._seq = itertools.count()
        self._closed = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def add(self, when: float, callback: Callable[[], None]) -> None:
        with self._cv:
            heapq.heappush(self._heap, (when, next(self._seq), callback))
            self._cv.notify()

    def pending(self) -> int:
        with self._cv:
            return len(self._heap)

    def close(self) -> None:
        with self._cv:
            self._closed = True
            self._heap.clear()
            self._cv.notify()
        if self._thread is not threading.current_thread():
            self._thread.join()

    def _run(self) -> None:
        while True:
            with self._cv:
                while not self._closed and (not self._heap or self._heap[0][0] > time.monotonic()):
                    self._cv.wait(None if not self._heap else self._heap[0][0] - time.monotonic())
                if self._closed:
                    return
                _, _, callback = heapq.heappop(self._heap)
            try:
                callback()
            except Exception:  # one bad callback must not stop the others
                log.exception("deadline callback failed")
