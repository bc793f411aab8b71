"""An asyncio event loop on a thread of its own: the connector's I/O beside vLLM's engine thread.

vLLM calls the connector's worker side from its engine thread, between and inside forward passes;
nothing there may wait on a socket. The side channel, transfer completions, aborts (which wait for
a frame landing) and dials run on this loop instead; the engine thread only hands work over.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import threading
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

from pdrouter.core.aio import BackgroundTasks

T = TypeVar("T")


class IoThread:
    """One daemon thread running one event loop until ``stop``."""

    def __init__(self, name: str) -> None:
        self.loop = asyncio.new_event_loop()
        self._tasks = BackgroundTasks(logging.getLogger("vllm.pdrouter.connector"), f"{name}: a task failed")
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_forever()
        with contextlib.suppress(RuntimeError):
            self.loop.run_until_complete(self.loop.shutdown_asyncgens())
        self.loop.close()

    def call(self, fn: Callable[..., object], *args: object) -> None:
        """Run ``fn(*args)`` on the loop soon (from any thread)."""
        self.loop.call_soon_threadsafe(fn, *args)

    def submit(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        """Run ``coro`` on the loop (from another thread); its future."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def spawn(self, coro: Coroutine[Any, Any, object]) -> None:
        """Run ``coro`` on the loop to its end, held until done (from any thread; a failure is logged)."""
        self.loop.call_soon_threadsafe(self._tasks.spawn, coro)

    def stop(self, timeout: float = 5.0) -> None:
        if self.loop.is_closed():
            return
        with contextlib.suppress(RuntimeError):
            self.loop.call_soon_threadsafe(self.loop.stop)
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout)
