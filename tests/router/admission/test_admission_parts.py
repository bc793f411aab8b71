"""The parts of admission on their own: the wait queue, lease renewal, credit and the credit-wanted channel."""

from __future__ import annotations

import asyncio
import logging

import pytest
import redis.asyncio as aioredis

from pdrouter.core.aio import BackgroundTasks
from pdrouter.core.ids import Epoch, RequestId, WorkerId
from pdrouter.router.admission import AdmissionConfig
from pdrouter.router.admission.credit import CreditBook
from pdrouter.router.admission.leases import LeaseRenewer
from pdrouter.router.admission.queue import WaitQueue
from pdrouter.router.admission.signals import CreditWanted
from pdrouter.state.reservations import BookingId, DecodeCapacity, KvReservations, Reservation

from .conftest import until


def _res(name: str, blocks: int = 1) -> Reservation:
    return Reservation(BookingId(name), WorkerId("d0"), Epoch(1), blocks, 30_000)


# -- the wait queue ---------------------------------------------------------------------------
async def test_queue_serves_priority_then_arrival_and_leave_wakes_the_next() -> None:
    queue = WaitQueue(limit=3)
    first, urgent, second = queue.join(0), queue.join(5), queue.join(0)
    assert len(queue) == 3 and queue.full
    assert queue.is_head(urgent) and not queue.is_head(first)
    queue.leave(urgent)
    assert queue.is_head(first) and first.wake.is_set() and not second.wake.is_set()
    queue.leave(second)  # not the head: the head is woken again, nothing else changes
    assert queue.is_head(first) and len(queue) == 1 and not queue.full
    queue.leave(first)
    queue.leave(first)  # leaving twice is harmless
    assert len(queue) == 0 and not queue.is_head(first)


async def test_queue_wait_ends_when_woken_or_after_the_timeout() -> None:
    queue = WaitQueue(limit=1)
    waiter = queue.join()
    waiter.wake.set()  # set before the wait began: it does not count
    start = asyncio.get_running_loop().time()
    await queue.wait(waiter, 0.05)
    assert asyncio.get_running_loop().time() - start >= 0.04
    sleeper = asyncio.create_task(queue.wait(waiter, 10))
    await asyncio.sleep(0.01)
    queue.wake_head()
    await asyncio.wait_for(sleeper, 1)


# -- lease renewal ----------------------------------------------------------------------------
class _Leases:
    """Renews in memory; ``gone`` are no longer held, ``failing`` raises like a Redis that is down."""

    def __init__(self, gone: set[str]) -> None:
        self.gone = gone
        self.failing = 0
        self.renewed: list[str] = []

    async def renew(self, reservation: Reservation) -> bool:
        if self.failing:
            self.failing -= 1
            raise ConnectionError("redis went away")
        self.renewed.append(reservation.booking_id)
        return reservation.booking_id not in self.gone


async def test_renewal_renews_bookings_then_chunks_and_reports_lapsed_chunks_only() -> None:
    leases = _Leases(gone={"b", "c2"})
    lapsed: list[str] = []
    renewer = LeaseRenewer(leases, 30_000, lambda: [_res("a"), _res("b")], lambda: [_res("c1"), _res("c2")],
                           lambda chunk: lapsed.append(chunk.booking_id))
    assert renewer.interval_s == 10.0
    await renewer.renew_once()
    assert leases.renewed == ["a", "b", "c1", "c2"]
    assert lapsed == ["c2"]  # a request's booking that is gone is its owner's business


async def test_renewal_goes_on_after_a_failed_round(caplog: pytest.LogCaptureFixture) -> None:
    leases = _Leases(gone=set())
    leases.failing = 1
    renewer = LeaseRenewer(leases, 30, lambda: [_res("a")], lambda: [], lambda chunk: None)  # every 10 ms
    with caplog.at_level(logging.WARNING):
        renewer.start()
        for _ in range(200):
            if leases.renewed:
                break
            await asyncio.sleep(0.01)
        await renewer.stop()
    assert leases.renewed and "lease renewal failed: redis went away" in caplog.text
    await renewer.stop()  # stopping twice is harmless


# -- credit -----------------------------------------------------------------------------------
WORKER = [DecodeCapacity(WorkerId("c0"), Epoch(1), 100)]


async def test_credit_is_booked_ahead_lent_in_memory_and_goes_back_when_idle(client: aioredis.Redis) -> None:
    res = KvReservations(client, "book")
    tasks = BackgroundTasks()
    book = CreditBook(res, AdmissionConfig(credit_fraction=0.1, credit_idle_s=0.1), "credit-test-", tasks,
                      lambda: False)
    assert book.take(RequestId("r0"), 4, WORKER) is None  # nothing held yet: a chunk is booked meanwhile
    await tasks.wait()
    assert book.held_blocks == 10 and await res.used("c0", 1) == 10
    assert [c.booking_id for c in book.chunks()] == ["credit-test-0"]
    calls = res.script_calls
    lent = book.take(RequestId("r1"), 4, WORKER)
    assert lent is not None and lent.worker_id == "c0" and lent.blocks == 4
    assert book.lends(RequestId("r1")) and res.script_calls == calls  # in memory, no round trip
    book.repay(RequestId("r1"), 1)
    book.settle(RequestId("r1"), 3)
    assert not book.lends(RequestId("r1")) and book.held_blocks == 10

    async def given_back() -> bool:
        await tasks.wait()
        return book.held_blocks == 0 and await res.used("c0", 1) == 0

    await until(given_back, "idle credit given back")
    await res.flush()


async def test_credit_books_nothing_while_someone_waits_or_after_another_router_asked(client: aioredis.Redis) -> None:
    res = KvReservations(client, "book")
    tasks = BackgroundTasks()
    waiting = [True]
    book = CreditBook(res, AdmissionConfig(credit_fraction=0.1, credit_idle_s=60, credit_yield_s=60),
                      "credit-test-", tasks, lambda: waiting[0])
    assert book.take(RequestId("r0"), 1, WORKER) is None
    assert len(tasks) == 0  # a request waits: no top-up
    waiting[0] = False
    book.take(RequestId("r1"), 1, WORKER)
    await tasks.wait()
    assert book.held_blocks == 10
    book.yield_to_others()  # unused credit goes back at once, and none is booked for a while
    assert book.held_blocks == 0
    await tasks.wait()
    assert book.take(RequestId("r2"), 1, WORKER) is None and len(tasks) == 0
    assert await res.used("c0", 1) == 0


async def test_a_lapsed_chunk_is_no_longer_counted_and_stop_gives_back_everything(client: aioredis.Redis) -> None:
    res = KvReservations(client, "book")
    tasks = BackgroundTasks()
    book = CreditBook(res, AdmissionConfig(credit_fraction=0.1, credit_idle_s=60), "credit-test-", tasks,
                      lambda: False)
    book.take(RequestId("r0"), 1, WORKER)
    await tasks.wait()
    lent = book.take(RequestId("r1"), 8, WORKER)  # leaves 2 of 10: a second chunk is booked
    await tasks.wait()
    assert lent is not None and book.held_blocks == 20
    first, second = list(book.chunks())
    book.lapsed(first)
    book.lapsed(first)  # already forgotten: nothing happens
    assert book.held_blocks == 10 and list(book.chunks()) == [second]
    book.give_back_all()  # used or not
    await tasks.wait()
    await res.flush()
    assert book.held_blocks == 0 and await res.used("c0", 1) == 10  # the lapsed chunk is left to its lease


# -- the credit-wanted channel ----------------------------------------------------------------
async def test_a_router_hears_the_others_asking_but_not_itself(client: aioredis.Redis) -> None:
    channel = "test:credit-wanted"
    tasks = BackgroundTasks()
    wanted: list[str] = []
    a = CreditWanted(client, channel, "credit-a-", enabled=True, ask_every_s=60, tasks=tasks,
                     on_wanted=lambda: wanted.append("a"))
    b = CreditWanted(client, channel, "credit-b-", enabled=True, ask_every_s=60, tasks=tasks,
                     on_wanted=lambda: wanted.append("b"))
    off = CreditWanted(client, channel, "credit-off-", enabled=False, ask_every_s=0, tasks=tasks,
                       on_wanted=lambda: wanted.append("off"))
    a.start()
    b.start()
    off.start()

    async def both_listen() -> bool:
        return dict(await client.pubsub_numsub(channel)).get(channel.encode(), 0) == 2

    await until(both_listen, "both routers subscribed")
    b.ask()
    b.ask()  # within ask_every_s: not sent again
    off.ask()  # without credit nothing is sent
    assert len(tasks) == 1

    async def a_heard() -> bool:
        return a.heard == 1

    await until(a_heard, "router A heard router B")
    await asyncio.sleep(0.05)
    assert wanted == ["a"] and b.heard == 0 and off.heard == 0
    for signals in (a, b, off):
        await signals.stop()
