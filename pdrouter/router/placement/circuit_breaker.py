"""A per-worker circuit breaker: stop sending to a worker that keeps failing, probe it later.

CLOSED --(``failure_threshold`` consecutive failures)--> OPEN --(``cooldown_s``)--> HALF_OPEN
HALF_OPEN --(trial succeeds)--> CLOSED;  HALF_OPEN --(trial fails)--> OPEN
"""

from __future__ import annotations

import enum
import time
from collections.abc import Callable


class BreakerState(enum.Enum):
    CLOSED = "closed"
    OPEN = "open"
    HALF_OPEN = "half_open"


class CircuitBreaker:
    """Pure logic; the clock is injectable for tests."""

    def __init__(self, failure_threshold: int = 3, cooldown_s: float = 5.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if failure_threshold < 1 or cooldown_s < 0:
            raise ValueError("failure_threshold must be >= 1 and cooldown_s >= 0")
        self.failure_threshold = failure_threshold
        self.cooldown_s = cooldown_s
        self._clock = clock
        self._state = BreakerState.CLOSED
        self._failures = 0
        self._opened_at = 0.0
        self._trial_in_flight = False

    @property
    def state(self) -> BreakerState:
        if self._state is BreakerState.OPEN and self._clock() - self._opened_at >= self.cooldown_s:
            self._state = BreakerState.HALF_OPEN
            self._trial_in_flight = False
        return self._state

    def allows(self) -> bool:
        """May a request be sent now? (HALF_OPEN lets exactly one trial through.)"""
        if self._state is BreakerState.CLOSED:  # the hot path: nothing to check
            return True
        state = self.state
        if state is BreakerState.CLOSED:
            return True
        return state is BreakerState.HALF_OPEN and not self._trial_in_flight

    def on_attempt(self) -> None:
        if self._state is not BreakerState.CLOSED and self.state is BreakerState.HALF_OPEN:
            self._trial_in_flight = True

    def on_success(self) -> None:
        self._state = BreakerState.CLOSED
        self._failures = 0
        self._trial_in_flight = False

    def on_failure(self) -> None:
        self._failures += 1
        if self._state is BreakerState.HALF_OPEN or self._failures >= self.failure_threshold:
            self._state = BreakerState.OPEN
            self._opened_at = self._clock()
            self._trial_in_flight = False
