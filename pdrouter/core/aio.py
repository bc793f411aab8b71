"""Small asyncio helpers shared by the long-lived components."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from collections.abc import Callable, Coroutine, Iterator
from typing import Any, TypeVar

from pdrouter.core.errors import ConfigError

T = TypeVar("T")


RECANCEL_S = 0.5
"""How long ``cancel_and_wait`` waits for a cancelled task before cancelling it again."""


async def cancel_and_wait(task: asyncio.Task[Any] | None, recancel_s: float = RECANCEL_S) -> None:
    """Cancel a background task and wait until it has really ended (None: nothing to do); an error
    it ended with (other than the cancellation) is raised here.

    The task is cancelled again every ``recancel_s`` while it runs on, because one cancellation can
    be lost: redis-py's blocking connection pool, with its connections contended (many workers of a
    fleet sharing one pool, all stopping at once), was seen to hand a connection to a task whose
    cancellation had been requested without raising ``CancelledError`` in it; a loop like a
    heartbeat's then ran on, and a single cancel-and-wait never returned.
    """
    if task is None:
        return
    while not task.done():
        task.cancel()
        await asyncio.wait({task}, timeout=recancel_s)
    with contextlib.suppress(asyncio.CancelledError):
        task.result()


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


def event_loop_factory(choice: str | None = None) -> Callable[[], asyncio.AbstractEventLoop] | None:
    """The event loop pd-router's processes run on: uvloop when it is installed, else asyncio's.

    ``choice`` (default: the ``PDROUTER_EVENT_LOOP`` environment variable, else ``auto``) is
    ``auto``, ``uvloop`` (an error without it) or ``asyncio``. None means asyncio's default loop.
    uvloop's loop and transports are written in C: every wake-up and system call of the router
    and the workers costs less CPU, which is most of what they do per request; and the load
    generator's, which shares the machine with what it measures.
    """
    choice = (choice or os.environ.get("PDROUTER_EVENT_LOOP") or "auto").strip().lower()
    if choice not in ("auto", "uvloop", "asyncio"):
        raise ConfigError(f"PDROUTER_EVENT_LOOP must be auto, uvloop or asyncio, not {choice!r}")
    if choice == "asyncio":
        return None
    try:
        import uvloop
    except ImportError:
        if choice == "uvloop":
            raise ConfigError("PDROUTER_EVENT_LOOP=uvloop but uvloop is not installed (pip install uvloop)") from None
        return None
    return uvloop.new_event_loop


def run_on_event_loop(main: Coroutine[Any, Any, T], choice: str | None = None) -> T:
    """``asyncio.run(main)`` on the loop :func:`event_loop_factory` picks."""
    with asyncio.Runner(loop_factory=event_loop_factory(choice)) as runner:
        return runner.run(main)
