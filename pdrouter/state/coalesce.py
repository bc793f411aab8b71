"""Group concurrent Redis calls into one: fewer round trips, far less client CPU per call.

A :class:`Coalescer` sends a call at once, from the caller's own task, when nothing is on its way
for its key (one caller pays no extra event-loop turns); calls submitted while a batch is on its
way wait and go together as the next batch (one script call). Under load batches grow by
themselves to what arrives during one round trip.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Hashable, Sequence
from typing import Generic, TypeVar

from pdrouter.core.aio import BackgroundTasks

K = TypeVar("K", bound=Hashable)
I = TypeVar("I")  # noqa: E741 - the item type
R = TypeVar("R")


class Coalescer(Generic[K, I, R]):
    """``await submit(key, item)`` → ``send(key, items)``'s result for that item.

    ``send`` must return one result per item, in order; an exception it raises is raised to every
    caller of the batch. ``abandoned(key, item, result)`` is called for a result whose caller was
    cancelled meanwhile (e.g. to undo a booking nobody will use); ``interrupted(key, item)`` for a
    call cancelled while it was on its way, whose outcome is unknown.
    """

    def __init__(self, send: Callable[[K, Sequence[I]], Awaitable[Sequence[R]]], max_batch: int = 256,
                 abandoned: Callable[[K, I, R], None] | None = None,
                 interrupted: Callable[[K, I], None] | None = None) -> None:
        if max_batch <= 0:
            raise ValueError("max_batch must be > 0")
        self._send = send
        self._max_batch = max_batch
        self._abandoned = abandoned
        self._interrupted = interrupted
        self._pending: dict[K, list[tuple[I, asyncio.Future[R]]]] = {}
        self._busy: set[K] = set()  # a batch is scheduled or in flight
        self._tasks = BackgroundTasks()  # a batch's failure goes to its callers' futures
        self.batches = 0
        self.items = 0

    async def submit(self, key: K, item: I) -> R:
        if key not in self._busy:
            return await self._inline(key, item)
        fut: asyncio.Future[R] = asyncio.get_running_loop().create_future()
        self._pending.setdefault(key, []).append((item, fut))
        return await fut

    async def _inline(self, key: K, item: I) -> R:
        """Send ``item`` alone from the caller's task; what queues meanwhile goes next."""
        self._busy.add(key)
        self.batches += 1
        self.items += 1
        try:
            results = await self._send(key, [item])
        except asyncio.CancelledError:
            if self._interrupted is not None:
                self._interrupted(key, item)
            raise
        finally:
            self._flush(key)
        if len(results) != 1:
            raise RuntimeError(f"batch of 1 got {len(results)} results")
        return results[0]

    def _flush(self, key: K) -> None:
        pending = self._pending.get(key)
        if not pending:
            self._pending.pop(key, None)
            self._busy.discard(key)
            return
        batch, rest = pending[:self._max_batch], pending[self._max_batch:]
        if rest:
            self._pending[key] = rest
        else:
            del self._pending[key]
        self._tasks.spawn(self._run(key, batch))

    async def _run(self, key: K, batch: list[tuple[I, asyncio.Future[R]]]) -> None:
        try:
            live = [(item, fut) for item, fut in batch if not fut.cancelled()]
            if not live:
                return
            self.batches += 1
            self.items += len(live)
            try:
                results = await self._send(key, [item for item, _ in live])
                if len(results) != len(live):
                    raise RuntimeError(f"batch of {len(live)} got {len(results)} results")
            except BaseException as exc:
                for _, fut in live:
                    if not fut.done():
                        if isinstance(exc, asyncio.CancelledError):
                            fut.cancel()
                        else:
                            fut.set_exception(exc)
                if isinstance(exc, asyncio.CancelledError):
                    if self._interrupted is not None:
                        for item, _ in live:
                            self._interrupted(key, item)
                    raise
                return
            for (item, fut), result in zip(live, results, strict=True):
                if not fut.done():
                    fut.set_result(result)
                elif self._abandoned is not None:
                    self._abandoned(key, item, result)
        finally:
            self._flush(key)

    async def drain(self) -> None:
        """Wait until every batch submitted so far has been answered."""
        while self._tasks:
            await self._tasks.wait()
