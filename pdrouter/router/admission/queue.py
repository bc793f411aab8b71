"""The bounded wait queue of requests waiting for KV room: priority first, then arrival order."""

from __future__ import annotations

import asyncio
import contextlib
import heapq
import itertools
from dataclasses import dataclass, field


@dataclass(order=True)
class Waiter:
    """One waiting request's place in the queue; ``wake`` is set when it should look for room."""

    priority: int
    seq: int
    wake: asyncio.Event = field(compare=False, default_factory=asyncio.Event)


class WaitQueue:
    """Requests waiting for room, served one at a time from the head.

    The head is the waiter with the highest priority, the earliest among equals. ``join`` places a
    waiter, ``is_head`` tells whether it is its turn, ``wait`` sleeps until it is woken or the
    timeout passes, and ``leave`` takes it out (whether or not it was admitted) and wakes the new
    head. ``full`` is true once ``limit`` waiters are queued; the queue itself never refuses one.
    Nothing here touches Redis: the owner decides what "room" is and wakes the head when some
    comes back.
    """

    __slots__ = ("_heap", "_seq", "limit")

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._heap: list[Waiter] = []
        self._seq = itertools.count()

    def __len__(self) -> int:
        return len(self._heap)

    @property
    def full(self) -> bool:
        return len(self._heap) >= self.limit

    def join(self, priority: int = 0) -> Waiter:
        """Queue a waiter; a higher ``priority`` goes ahead of every lower one already waiting."""
        waiter = Waiter(-priority, next(self._seq))
        heapq.heappush(self._heap, waiter)
        return waiter

    def is_head(self, waiter: Waiter) -> bool:
        return bool(self._heap) and self._heap[0] is waiter

    async def wait(self, waiter: Waiter, timeout: float) -> None:
        """Sleep until ``waiter`` is woken (after this call began) or ``timeout`` seconds pass."""
        waiter.wake.clear()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(waiter.wake.wait(), timeout)

    def leave(self, waiter: Waiter) -> None:
        """Take ``waiter`` out (nothing if it is not queued) and wake whoever is the head now."""
        if waiter in self._heap:
            self._heap.remove(waiter)
            heapq.heapify(self._heap)
        self.wake_head()

    def wake_head(self) -> None:
        """Room may have come back: the head looks again."""
        if self._heap:
            self._heap[0].wake.set()
