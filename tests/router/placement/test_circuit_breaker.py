"""Circuit breaker transitions, with a fake clock."""

from __future__ import annotations

from pdrouter.router.placement.circuit_breaker import BreakerState, CircuitBreaker


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_opens_after_threshold_and_half_opens_after_cooldown() -> None:
    clock = Clock()
    cb = CircuitBreaker(failure_threshold=2, cooldown_s=5.0, clock=clock)
    cb.on_failure()
    assert cb.state is BreakerState.CLOSED and cb.allows()
    cb.on_failure()
    assert cb.state is BreakerState.OPEN and not cb.allows()
    clock.now += 4.9
    assert not cb.allows()
    clock.now += 0.2
    assert cb.state is BreakerState.HALF_OPEN and cb.allows()
    cb.on_attempt()
    assert not cb.allows()  # one trial at a time
    cb.on_success()
    assert cb.state is BreakerState.CLOSED and cb.allows()


def test_failed_trial_reopens() -> None:
    clock = Clock()
    cb = CircuitBreaker(failure_threshold=1, cooldown_s=1.0, clock=clock)
    cb.on_failure()
    clock.now += 1.0
    cb.on_attempt()
    cb.on_failure()
    assert cb.state is BreakerState.OPEN
    clock.now += 0.5
    assert not cb.allows()


def test_success_resets_the_count() -> None:
    cb = CircuitBreaker(failure_threshold=2, cooldown_s=1.0, clock=Clock())
    cb.on_failure()
    cb.on_success()
    cb.on_failure()
    assert cb.state is BreakerState.CLOSED
