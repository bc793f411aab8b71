"""Group concurrent Redis calls into one: fewer round trips, far less client CPU per call.

A :class:`Coalescer` collects the calls submitted for one key during the current event-loop
iteration, and while the previous batch for that key is still on its way, and sends them as one
batch (one script call). With one caller it adds no wait (the batch goes out in the same loop
iteration); under load batches grow by themselves to what arrives during one round trip.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Hashable, Sequence
from typing import Generic, TypeVar

K = TypeVar("K", bound=Hashable)
I = TypeVar("I")  # noqa: E741 - the item type
R = TypeVar("R")


class Coalescer(Generic[K, I, R]):
    """``await submit(key, item)`` → ``send(key, items)``'s result for that item.

    ``send`` must return one result per item, in order; an exception it raises is raised to every
    caller of the batch. ``abandoned(key, item, result)`` is called for a result whose caller was
    cancelled meanwhile (e.g. to undo a booking nobody will use).
    """

    def __init__(self, send: Callable[[K, Sequence[I]], Awaitable[Sequence[R]]], max_batch: int = 256,
                 abandoned: Callable[[K, I, R], None] | None = None) -> None:
        if max_batch <= 0:
            raise ValueError("max_batch must be > 0")
        self._send = send
        self._max_batch = max_batch
        self._abandoned = abandoned
        self._pending: dict[K, list[tuple[I, asyncio.Future[R]]]] = {}
        self._busy: set[K] = set()  # a batch is scheduled or in flight
        self._tasks: set[asyncio.Task[None]] = set()
        self.batches = 0
        self.items = 0

    async def submit(self, key: K, item: I) -> R:
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[R] = loop.create_future()
        self._pending.setdefault(key, []).append((item, fut))
        if key not in self._busy:
            self._busy.add(key)
            loop.call_soon(self._flush, key)
        return await fut

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
        task = asyncio.ensure_future(self._run(key, batch))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

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
            await asyncio.gather(*self._tasks, return_exceptions=True)
