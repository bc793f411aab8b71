"""``DeadlineWatch``: callbacks at their deadlines, cancellation that frees what they hold, a bounded heap."""

from __future__ import annotations

import gc
import threading
import time
import weakref

from pdrouter.transfer.deadlines import COMPACT_AFTER, DeadlineWatch

from .factories import wait_until


class Owner:
    """Stands for a transfer: its bound method is the callback."""

    def __init__(self, fired: list[int], n: int) -> None:
        self.fired, self.n = fired, n

    def expire(self) -> None:
        self.fired.append(self.n)


def test_callbacks_run_in_deadline_order_once() -> None:
    watch = DeadlineWatch("test")
    fired: list[int] = []
    now = time.monotonic()
    for n, delay in ((3, 0.15), (1, 0.05), (2, 0.1)):
        watch.add(now + delay, Owner(fired, n).expire)
    assert wait_until(lambda: len(fired) == 3)
    assert fired == [1, 2, 3] and watch.pending() == 0 and watch.held() == 0
    watch.close()


def test_an_earlier_deadline_wakes_the_thread_and_later_ones_wait_their_turn() -> None:
    """The thread sleeps until the earliest deadline: one added before it wakes it, later ones do not need to."""
    watch = DeadlineWatch("test")
    fired: list[int] = []
    now = time.monotonic()
    watch.add(now + 60, Owner(fired, 60).expire)
    time.sleep(0.05)  # the thread now sleeps until the 60 s deadline
    watch.add(now + 120, Owner(fired, 120).expire)
    watch.add(time.monotonic() + 0.05, Owner(fired, 1).expire)
    watch.add(time.monotonic() + 0.1, Owner(fired, 2).expire)
    assert wait_until(lambda: len(fired) == 2, timeout=5)
    assert fired == [1, 2] and watch.pending() == 2
    watch.close()


def test_a_cancelled_deadline_never_fires_and_frees_its_callback_at_once() -> None:
    watch = DeadlineWatch("test")
    fired: list[int] = []
    owner = Owner(fired, 1)
    gone = weakref.ref(owner)
    entry = watch.add(time.monotonic() + 600, owner.expire)
    kept = watch.add(time.monotonic() + 0.05, Owner(fired, 2).expire)
    del owner
    gc.collect()
    assert gone() is not None  # the pending deadline holds it, as it must
    watch.cancel(entry)
    watch.cancel(entry)  # twice: no effect
    gc.collect()
    assert gone() is None  # not kept for the ten minutes its deadline had left
    assert wait_until(lambda: fired == [2])
    watch.cancel(kept)  # after it ran: no effect
    assert watch.pending() == 0
    time.sleep(0.05)
    assert fired == [2]
    watch.close()


def test_the_heap_stays_within_twice_the_pending_deadlines() -> None:
    watch = DeadlineWatch("test")
    far = time.monotonic() + 600
    entries = [watch.add(far, lambda: None) for _ in range(10)]
    for _ in range(5000):  # a busy receiver: every transfer finishes long before its deadline
        watch.cancel(watch.add(far, lambda: None))
        assert watch.held() <= 2 * watch.pending() + COMPACT_AFTER + 1
    assert watch.pending() == 10
    for entry in entries:
        watch.cancel(entry)
    assert watch.pending() == 0 and watch.held() <= COMPACT_AFTER + 1
    watch.close()


def test_cancel_races_the_firing_thread_safely() -> None:
    watch = DeadlineWatch("test")
    count = 0
    lock = threading.Lock()

    def bump() -> None:
        nonlocal count
        with lock:
            count += 1

    now = time.monotonic()
    entries = [watch.add(now + i * 1e-5, bump) for i in range(2000)]
    for entry in entries[::2]:
        watch.cancel(entry)
    assert wait_until(lambda: watch.held() == 0)
    assert 1000 <= count <= 2000 and watch.pending() == 0  # each ran at most once; cancelled ones unless already run
    watch.close()
