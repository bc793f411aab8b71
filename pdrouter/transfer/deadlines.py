"""One thread that fires callbacks at monotonic deadlines (the receiver's transfer deadlines)."""

from __future__ import annotations

import heapq
import itertools
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

log = logging.getLogger(__name__)


Entry = list[Any]
"""``[when, sequence, callback or None]``: one registered deadline (``add``'s handle for ``cancel``)."""

COMPACT_AFTER = 64
"""Cancelled entries the heap may hold before it is rebuilt (once they are also half of it)."""


class DeadlineWatch:
    """Calls each registered callback once its ``time.monotonic()`` deadline passes.

    Callbacks run on the watch's own thread, one at a time, and must tolerate being late or being
    for something that already finished (expiring a finished transfer changes nothing).

    ``cancel`` drops a callback (and whatever it holds) at once; the heap is rebuilt without the
    cancelled entries when they reach half of it, so a deadline far in the future does not keep a
    finished transfer alive, and the heap stays within twice the deadlines still pending.
    """

    def __init__(self, name: str) -> None:
        self._cv = threading.Condition()
        self._heap: list[Entry] = []
        self._cancelled = 0
        self._seq = itertools.count()
        self._closed = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def add(self, when: float, callback: Callable[[], None]) -> Entry:
        """Call ``callback`` at ``when``; the returned entry is the handle for :meth:`cancel`."""
        entry: Entry = [when, next(self._seq), callback]
        with self._cv:
            heapq.heappush(self._heap, entry)
            if self._heap[0] is entry:  # the thread sleeps until an earlier deadline: no need to wake it
                self._cv.notify()
        return entry

    def cancel(self, entry: Entry) -> None:
        """Forget ``entry``'s callback (a no-op once it ran or was cancelled)."""
        with self._cv:
            if entry[2] is None:
                return
            entry[2] = None
            self._cancelled += 1
            if self._cancelled > COMPACT_AFTER and 2 * self._cancelled > len(self._heap):
                self._heap = [e for e in self._heap if e[2] is not None]
                heapq.heapify(self._heap)
                self._cancelled = 0

    def pending(self) -> int:
        """Deadlines registered and neither run nor cancelled."""
        with self._cv:
            return len(self._heap) - self._cancelled

    def held(self) -> int:
        """Entries in the heap, cancelled ones not yet dropped included."""
        with self._cv:
            return len(self._heap)

    def close(self) -> None:
        with self._cv:
            self._closed = True
            self._heap.clear()
            self._cancelled = 0
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
                entry = heapq.heappop(self._heap)
                callback, entry[2] = entry[2], None
                if callback is None:
                    self._cancelled -= 1
                    continue
            try:
                callback()
            except Exception:  # one bad callback must not stop the others
                log.exception("deadline callback failed")
