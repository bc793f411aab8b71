"""The transfer lifecycle: states, the allowed transitions (all here), and thread-safe waiting.

::

    WAITING ──▶ TRANSFERRING ──▶ DONE
       │  │           │
       │  └───────────┴────────▶ FAILED
       └──▶ DONE  (nothing to send: every block was already cached on the decode side)

Both ends of a transfer keep one ``Lifecycle``. The first terminal state wins: a late error after
DONE, or a second failure, changes nothing.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import Callable
from enum import Enum

from pdrouter.core.errors import PdRouterError


class TransferState(Enum):
    WAITING = "waiting"
    """Created; no payload has moved yet."""
    TRANSFERRING = "transferring"
    """The sender is bound and blocks are landing."""
    DONE = "done"
    """Every expected block of every expected layer arrived and verified."""
    FAILED = "failed"
    """Stopped for good; ``error`` says why. The destination blocks will not be written again."""

    @property
    def terminal(self) -> bool:
        return self in (TransferState.DONE, TransferState.FAILED)


_ALLOWED: dict[TransferState, frozenset[TransferState]] = {
    TransferState.WAITING: frozenset({TransferState.TRANSFERRING, TransferState.DONE, TransferState.FAILED}),
    TransferState.TRANSFERRING: frozenset({TransferState.DONE, TransferState.FAILED}),
    TransferState.DONE: frozenset(),
    TransferState.FAILED: frozenset(),
}


class IllegalTransitionError(RuntimeError):
    """A programming error: a transition the diagram above does not have."""


class Lifecycle:
    """A state, the error that ended it, and a condition to wait on; safe across threads and loops.

    ``cond`` also guards whatever progress the owner tracks next to the state (e.g. layers done),
    so a waiter's predicate sees both consistently. Listeners run after every ``notify`` and every
    transition, outside the lock; they must be quick (they only wake asyncio waiters).
    """

    def __init__(self) -> None:
        self.cond = threading.Condition()
        self._state = TransferState.WAITING
        self._error: PdRouterError | None = None
        self._listeners: list[Callable[[], None]] = []

    @property
    def state(self) -> TransferState:
        return self._state

    @property
    def error(self) -> PdRouterError | None:
        return self._error

    def advance(self, to: TransferState, error: PdRouterError | None = None, *,
                before_wake: Callable[[], None] | None = None) -> bool:
        """Move to ``to``; False (and no change) when already terminal. FAILED needs an error.

        ``before_wake`` runs once the state has moved, before waiters are woken (outside the lock):
        what the peer must hear first, ahead of this side's own bookkeeping.
        """
        if (to is TransferState.FAILED) != (error is not None):
            raise IllegalTransitionError(f"FAILED needs an error and only FAILED takes one ({to}, {error!r})")
        with self.cond:
            if self._state.terminal:
                return False
            if to not in _ALLOWED[self._state]:
                raise IllegalTransitionError(f"transfer cannot go from {self._state.name} to {to.name}")
            self._state = to
            self._error = None if error is None else error.with_traceback(None)
            if before_wake is None:
                self.cond.notify_all()
        if before_wake is not None:
            before_wake()
            with self.cond:
                self.cond.notify_all()
        self._call_listeners()
        return True

    def notify(self) -> None:
        """Wake waiters after progress changed (call with ``cond`` released)."""
        with self.cond:
            self.cond.notify_all()
        self._call_listeners()

    def wait_for(self, predicate: Callable[[], bool], timeout: float | None) -> bool:
        """Block until ``predicate()`` (evaluated under ``cond``) holds; False on timeout."""
        with self.cond:
            return self.cond.wait_for(predicate, timeout)

    async def wait_for_async(self, predicate: Callable[[], bool], timeout: float | None) -> bool:
        """``wait_for`` for asyncio code: never blocks the event loop.

        A wake is one future set through ``call_soon_threadsafe`` and the timeout one timer on the
        loop: no task, as ``asyncio.wait_for`` would make for every wait."""
        loop = asyncio.get_running_loop()
        pending: list[asyncio.Future[None]] = [loop.create_future()]

        def wake() -> None:
            with contextlib.suppress(RuntimeError):  # the loop closed: nobody waits any more
                loop.call_soon_threadsafe(_resolve, pending[0])

        deadline = None if timeout is None else time.monotonic() + timeout
        with self.cond:
            self._listeners.append(wake)
        try:
            while True:
                with self.cond:
                    if predicate():
                        return True
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    return False
                timer = None if remaining is None else loop.call_later(remaining, _resolve, pending[0])
                try:
                    await pending[0]
                finally:
                    if timer is not None:
                        timer.cancel()
                pending[0] = loop.create_future()
        finally:
            with self.cond:
                self._listeners.remove(wake)

    def _call_listeners(self) -> None:
        if not self._listeners:
            # Read without the lock: a listener added concurrently is added before its waiter checks
            # the predicate under the lock, so that check sees whatever changed before this one.
            return
        with self.cond:
            listeners = list(self._listeners)
        for listener in listeners:
            listener()


def _resolve(future: asyncio.Future[None]) -> None:
    """Wake the waiter of ``future`` (on its loop; once: a later wake of the same wait is a no-op)."""
    if not future.done():
        future.set_result(None)
