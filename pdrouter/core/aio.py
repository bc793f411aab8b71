"""Small asyncio helpers shared by the long-lived components."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Coroutine, Iterator
from typing import Any, TypeVar

T = TypeVar("T")


async def cancel_and_wait(task: asyncio.Task[Any] | None) -> None:
    """Cancel a background task and wait until it has really ended (None: nothing to do)."""
    if task is None:
        return
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task


class BackgroundTasks:
    """Tasks that must run to completion although nobody awaits them (a release after a cancelled
    request, a channel closed later, a batch sent on its own).

    The event loop keeps only weak references to tasks, so a task nobody holds may be collected
    before it finishes; this set holds each one until it is done, then forgets it. With a
    ``logger``, a task that fails is logged at WARNING as ``failure_message: <error>`` instead of
    Python's "exception was never retrieved" at collection time; without one its failure is
    retrieved silently (the owner learns of it some other way).
    """

    __slots__ = ("_failure_message", "_logger", "_tasks")

    def __init__(self, logger: logging.Logger | None = None, failure_message: str = "background task failed") -> None:
        self._tasks: set[asyncio.Task[Any]] = set()
        self._logger = logger
        self._failure_message = failure_message

    def spawn(self, aw: Coroutine[Any, Any, T] | asyncio.Task[T], name: str | None = None) -> asyncio.Task[T]:
        """Start ``aw`` (a coroutine, or a task already started) and hold it until it is done; returns the task."""
        task = aw if isinstance(aw, asyncio.Task) else asyncio.ensure_future(aw)
        if name is not None:
            task.set_name(name)
        self._tasks.add(task)
        task.add_done_callback(self._done)
        return task

    def _done(self, task: asyncio.Task[Any]) -> None:
        self._tasks.discard(task)
        if task.cancelled():
            return
        exc = task.exception()
        if exc is not None and self._logger is not None:
            self._logger.warning("%s: %s", self._failure_message, exc)

    def __len__(self) -> int:
        return len(self._tasks)

    def __iter__(self) -> Iterator[asyncio.Task[Any]]:
        return iter(list(self._tasks))

    async def wait(self, timeout: float | None = None) -> None:
        """Wait until every task held now has finished (at most ``timeout`` seconds)."""
        if self._tasks:
            await asyncio.wait(list(self._tasks), timeout=timeout)

    async def cancel_all(self) -> None:
        """Cancel every task held and wait until they have ended."""
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)
