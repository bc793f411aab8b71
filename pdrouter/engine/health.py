"""An engine's failure, once: why it stopped, and who is told.

Both engines behind the worker's contract (the project's, through its driver; vLLM's) stop for good
on an internal error and say so the same way: ``reason`` stays None while the engine serves; the
first ``fail(reason)`` sets it and calls every subscriber once, in order, before the engine fails
its waiting requests (the worker turns NOT_SERVING in a subscriber); a subscriber added later is
called at once. One subscriber that raises is logged and does not keep the others from hearing.
Call it from one thread (the worker's event loop).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

log = logging.getLogger(__name__)


class EngineFailure:
    """A once-only failure signal (see the module docstring)."""

    __slots__ = ("_subscribers", "reason")

    def __init__(self) -> None:
        self.reason: str | None = None
        self._subscribers: list[Callable[[str], None]] = []

    def subscribe(self, callback: Callable[[str], None]) -> None:
        if self.reason is not None:
            callback(self.reason)
            return
        self._subscribers.append(callback)

    def fail(self, reason: str) -> bool:
        """Record the failure and tell every subscriber; False (and nothing done) when it had failed already."""
        if self.reason is not None:
            return False
        self.reason = reason
        for callback in self._subscribers:
            try:
                callback(reason)
            except Exception:  # one subscriber's failure must not keep the others from hearing
                log.exception("engine failure callback %r failed", callback)
        self._subscribers.clear()
        return True
