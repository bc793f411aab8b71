"""The admission queue against a real Redis: priority then FIFO, deadlines, limits, too-large, credit."""

from __future__ import annotations

import asyncio
import dataclasses
import random
import time

import pytest
import redis.asyncio as aioredis

from pdrouter.core.errors import CapacityError, RequestTooLargeError
from pdrouter.core.ids import Epoch, RequestId, WorkerId
from pdrouter.router.admission import Admission, AdmissionConfig
from pdrouter.router.dispatch import engine_priority
from pdrouter.state.reservations import DecodeCapacity, KvReservations, Reservation

from .conftest import until

WORKER = [DecodeCapacity(WorkerId("d0"), Epoch(1), 10)]


async def test_waiters_are_admitted_by_priority_then_fifo(client: aioredis.Redis) -> None:
    adm = Admission(KvReservations(client, "tiny"), AdmissionConfig(queue_timeout_s=10, poll_interval_s=0.01))
    holder = await adm.admit(RequestId("holder"), 10, WORKER)
    order: list[str] = []

    async def wait(name: str, priority: int) -> None:
        res = await adm.admit(RequestId(name), 10, WORKER, priority=priority)
        order.append(name)
        await adm.release(res)

    tasks = []
    for name, prio in (("first", 0), ("urgent", 5), ("second", 0)):
        tasks.append(asyncio.create_task(wait(name, prio)))
        await asyncio.sleep(0.02)
    assert adm.queue_length == 3
    await adm.release(holder)
    await asyncio.gather(*tasks)
    assert order == ["urgent", "first", "second"]
    assert adm.queue_length == 0 and adm.active == 0
    assert adm.stats.admitted == 4


async def test_timeout_limit_and_too_large(client: aioredis.Redis) -> None:
    adm = Admission(KvReservations(client, "tiny"), AdmissionConfig(queue_timeout_s=0.2, queue_limit=1,
                                                                   poll_interval_s=0.01, retry_after_s=3))
    holder = await adm.admit(RequestId("holder"), 8, WORKER)
    with pytest.raises(RequestTooLargeError, match="largest decode worker holds 10"):
        await adm.admit(RequestId("huge"), 11, WORKER)
    waiter = asyncio.create_task(adm.admit(RequestId("w1"), 5, WORKER))
    await asyncio.sleep(0.02)
    with pytest.raises(CapacityError, match="queue is full") as full:
        await adm.admit(RequestId("w2"), 5, WORKER)
    assert full.value.retry_after_s == 3
    with pytest.raises(CapacityError, match=r"within 0\.2s"):
        await waiter
    assert dict(adm.stats.rejections) == {"too_large": 1, "queue_full": 1, "timeout": 1}
    # A request that fits next to the holder is admitted at once.
    small = await adm.admit(RequestId("small"), 2, WORKER)
    await adm.release(small)
    await adm.release(holder)
    assert await adm.reservations.used("d0", 1) == 0


async def test_credit_admits_without_a_round_trip_and_goes_back_when_idle(client: aioredis.Redis) -> None:
    worker = [DecodeCapacity(WorkerId("d1"), Epoch(1), 100)]
    res = KvReservations(client, "credit")
    adm = Admission(res, AdmissionConfig(credit_fraction=0.1, credit_limit=0.5, credit_idle_s=0.2))
    first = await adm.admit(RequestId("first"), 2, worker)  # no credit yet: booked on its own
    assert adm.stats.admitted_on_credit == 0

    async def credit_landed() -> bool:
        return adm.credit_blocks == 10

    await until(credit_landed, "a 10-block credit chunk")
    calls = res.script_calls
    held = [await adm.admit(RequestId(f"r{i}"), 2, worker) for i in range(4)]
    assert adm.stats.admitted_on_credit == 4
    assert res.script_calls - calls <= 1  # at most a top-up: 8 of 10 used leaves under half a chunk
    assert {r.worker_id for r in held} == {"d1"} and adm.active == 5
    # Redis holds the request booked alone plus the credit: every block in use is booked.
    assert await res.used("d1", 1) >= 2 + 8
    for r in held:
        assert adm.release_soon(r) is None  # credit comes back in memory, at once
    exact = adm.release_soon(first)  # booked on its own: released in Redis by a task
    assert exact is not None
    await exact
    assert adm.active == 0

    async def all_given_back() -> bool:
        return adm.credit_blocks == 0 and await res.used("d1", 1) == 0

    await until(all_given_back, "unused credit given back after credit_idle_s")
    await adm.stop()


async def test_credit_is_booked_only_below_the_limit_and_routers_never_overbook(client: aioredis.Redis) -> None:
    capacity = 40
    worker = [DecodeCapacity(WorkerId("d2"), Epoch(1), capacity)]
    config = AdmissionConfig(credit_fraction=0.25, credit_limit=0.5, credit_idle_s=0.1, queue_timeout_s=5,
                             poll_interval_s=0.005)
    routers = [Admission(KvReservations(client, "limits"), config) for _ in range(2)]
    probe = KvReservations(client, "limits")
    peak_used = peak_credit = 0
    stop = asyncio.Event()

    async def watch() -> None:
        nonlocal peak_used, peak_credit
        while not stop.is_set():
            peak_used = max(peak_used, int(await client.get(probe.keys.kv_used("d2", 1)) or 0))
            peak_credit = max(peak_credit, sum(a.credit_blocks for a in routers))
            await asyncio.sleep(0.001)

    rng = random.Random(7)

    async def request(i: int) -> None:
        adm = routers[i % 2]
        r = await adm.admit(RequestId(f"q{i}"), rng.randint(1, 8), worker)
        await asyncio.sleep(rng.random() * 0.02)
        await adm.release(r)

    async def lane(start: int, n: int) -> None:
        for i in range(start, start + n):
            await request(i)

    watcher = asyncio.create_task(watch())
    try:
        # Light load (three at a time: credit) and bursts over capacity (queueing), in turn.
        for wave, width in enumerate((3, 30, 3, 30)):
            per = 30 // width
            await asyncio.gather(*(lane(wave * 30 + k * per, per) for k in range(width)))
    finally:
        stop.set()
        await watcher
    assert 0 < peak_used <= capacity
    assert peak_credit <= capacity // 2  # chunks only ever book up to the limit
    assert sum(a.stats.admitted_on_credit for a in routers) > 0
    assert sum(a.stats.admitted for a in routers) == 120

    async def drained() -> bool:
        return await probe.used("d2", 1) == 0

    await until(drained, "every booking and all credit gone")
    for adm in routers:
        await adm.stop()


async def test_a_waiting_request_takes_back_spare_credit_and_stop_releases_it(client: aioredis.Redis) -> None:
    worker = [DecodeCapacity(WorkerId("d3"), Epoch(1), 20)]
    res = KvReservations(client, "spare")
    adm = Admission(res, AdmissionConfig(credit_fraction=0.25, credit_limit=0.5, credit_idle_s=60,
                                         queue_timeout_s=5, poll_interval_s=0.005))
    small = await adm.admit(RequestId("small"), 1, worker)

    async def credit_landed() -> bool:
        return adm.credit_blocks > 0

    await until(credit_landed, "credit booked")
    await adm.release(small)
    # 16 blocks fit next to the 5 of credit only once it (not due back for a minute) is given back.
    big = await adm.admit(RequestId("big"), 16, worker)
    assert adm.credit_blocks == 0 and big.blocks == 16
    await adm.release(big)
    again = await adm.admit(RequestId("again"), 1, worker)
    await until(credit_landed, "credit booked again")
    await adm.stop()  # gives back the credit with the rest
    assert await res.used("d3", 1) == 1  # only "again", which its owner never released
    await adm.reservations.release(again, urgent=True)


async def test_a_request_waiting_on_one_router_gets_another_routers_spare_credit(client: aioredis.Redis) -> None:
    """Router A holds credit it does not use (not due back for a minute); router B's request needs
    that room. B's waiting request asks, A gives its spare credit back, and B is admitted. (Without
    the request B would time out after 5 s.)"""
    worker = [DecodeCapacity(WorkerId("d4"), Epoch(1), 64)]
    config = AdmissionConfig(credit_fraction=0.25, credit_limit=0.5, credit_idle_s=60, queue_timeout_s=5,
                             poll_interval_s=0.005)
    a = Admission(KvReservations(client, "shared"), config)
    b = Admission(KvReservations(client, "shared"), config)
    a.start()
    b.start()
    await asyncio.sleep(0.1)  # both listen
    small = await a.admit(RequestId("a-small"), 1, worker)

    async def a_holds_credit() -> bool:
        return a.credit_blocks >= 16

    await until(a_holds_credit, "credit booked by router A")
    await a.release(small)
    big = await b.admit(RequestId("b-big"), 56, worker)  # fits only once A's credit is back
    assert big.blocks == 56 and a.credit_blocks == 0 and a.credit_requests_heard >= 1
    assert b.credit_requests_heard == 0  # a router does not answer its own call
    again = await a.admit(RequestId("a-again"), 1, worker)  # booked on its own: A books no credit now
    assert a.stats.admitted_on_credit == 0 and a.credit_blocks == 0
    await a.release(again)
    await b.release(big)
    await a.stop()
    await b.stop()
    assert await a.reservations.used("d4", 1) == 0


async def test_waiting_tenants_are_admitted_by_weight_and_a_priority_class_jumps_the_queue(
        client: aioredis.Redis) -> None:
    """A decode worker with room for one request at a time; three tenants keep a backlog (weights 1,
    2, 3), and an interactive request arriving late is admitted next, before every one of them.
    Arriving in an empty queue, each tenant first has its burst credit's worth admitted (8), then
    they share by weight.

    Each admitted request holds the worker until the test gives it a turn, so the order does not
    depend on how fast the loop runs."""
    adm = Admission(KvReservations(client, "tiny"), AdmissionConfig(queue_timeout_s=30, poll_interval_s=0.005,
                                                                    credit_fraction=0))
    holder = await adm.admit(RequestId("holder"), 10, WORKER)
    weights = {"a": 1.0, "b": 2.0, "c": 3.0}
    order: list[str] = []
    turns: asyncio.Queue[None] = asyncio.Queue()

    async def request(tenant: str, priority: int = 0) -> None:
        res = await adm.admit(RequestId(tenant), 10, WORKER, priority=priority, flow=tenant,
                              weight=weights.get(tenant, 1))
        order.append(tenant)
        await turns.get()
        await adm.release(res)

    tasks = [asyncio.create_task(request(t)) for _ in range(40) for t in weights]
    await until(lambda: _true(adm.queue_length == 120), "the backlog queued")
    await adm.release(holder)
    for _ in range(29):
        turns.put_nowait(None)
    await until(lambda: _true(len(order) == 30), "30 admitted")
    urgent = asyncio.create_task(request("ops", priority=1))
    await until(lambda: _true(adm.queue_length == 91), "the interactive request queued")
    for _ in range(92):  # the 91 waiting and the one holding the worker
        turns.put_nowait(None)
    await asyncio.gather(*tasks, urgent)
    assert order.index("ops") == 30  # admitted as soon as the one holding the worker was done
    credit = int(AdmissionConfig().fair_burst)
    assert all(order[:3 * credit].count(t) == credit for t in weights), order[:3 * credit]
    shared = [t for t in order[3 * credit:] if t != "ops"][:60]  # every tenant still had a backlog then
    shares = {t: shared.count(t) / 60 for t in weights}
    for tenant, w in weights.items():
        assert abs(shares[tenant] - w / 6) <= 0.1 * w / 6 + 1 / 60, shares
    assert adm.queue_length == 0 and adm.active == 0


async def _true(value: bool) -> bool:
    return value


async def _flooded(client: aioredis.Redis, fair_window_s: float) -> tuple[
        Admission, list[DecodeCapacity], list[Reservation], list[asyncio.Task[Reservation]]]:
    """A pool of 100 blocks with a 10 % headroom, filled by tenant a (ten requests of 10 blocks) with
    three more of a's waiting, and tenant b active a moment ago. (No burst credit: a's three waiting
    are past its share at once.)"""
    pool = [DecodeCapacity(WorkerId("d0"), Epoch(1), 100)]
    adm = Admission(KvReservations(client, "tiny"), AdmissionConfig(
        queue_timeout_s=30, poll_interval_s=0.005, credit_fraction=0, fair_headroom=0.1, fair_window_s=fair_window_s,
        fair_burst=0))
    await adm.release(await adm.admit(RequestId("b0"), 10, pool, flow="b"))
    held = [await adm.admit(RequestId(f"a{i}"), 10, pool, flow="a") for i in range(10)]
    waiting = [asyncio.create_task(adm.admit(RequestId(f"a-wait{i}"), 10, pool, flow="a")) for i in range(3)]
    await until(lambda: _true(adm.queue_length == 3), "a's backlog queued")
    return adm, pool, held, waiting


async def _flooded_past_its_credit(client: aioredis.Redis, config: AdmissionConfig, other_blocks: int = 0) -> tuple[
        Admission, list[DecodeCapacity], list[Reservation], list[asyncio.Task[Reservation]]]:
    """A pool of 100 blocks filled by tenant a (ten requests of 10 blocks) with seven more of a's
    waiting, a credit of 2 requests (a's last waiter starts 4 of its requests past the virtual time:
    past its credit) and ``config``'s headroom; with ``other_blocks``, tenant b had a request of that
    size a moment ago."""
    pool = [DecodeCapacity(WorkerId("d0"), Epoch(1), 100)]
    adm = Admission(KvReservations(client, "tiny"), dataclasses.replace(
        config, queue_timeout_s=30, poll_interval_s=0.005, credit_fraction=0, fair_window_s=30, fair_burst=2))
    if other_blocks:
        await adm.release(await adm.admit(RequestId("b0"), other_blocks, pool, flow="b"))
    held = [await adm.admit(RequestId(f"a{i}"), 10, pool, flow="a") for i in range(10)]
    flood = [asyncio.create_task(adm.admit(RequestId(f"a-wait{i}"), 10, pool, flow="a")) for i in range(7)]
    await until(lambda: _true(adm.queue_length == 7), "a's backlog queued")
    return adm, pool, held, flood


async def _release_all(adm: Admission, admitted: list[Reservation], flood: list[asyncio.Task[Reservation]]) -> None:
    """Release ``admitted``, then the flood's requests as they are admitted: nothing is left."""
    for res in admitted:
        await adm.release(res)
    await asyncio.gather(*flood)
    for res in (t.result() for t in flood):
        await adm.release(res)
    assert adm.queue_length == 0 and adm.active == 0


async def test_a_flooding_tenant_leaves_headroom_that_another_tenant_books_on_arrival(
        client: aioredis.Redis) -> None:
    adm, pool, held, waiting = await _flooded(client, fair_window_s=0.5)
    await adm.release(held.pop())  # 10 blocks free: the headroom, which a's backlog may not book
    b = asyncio.create_task(adm.admit(RequestId("b1"), 10, pool, flow="b"))
    await until(lambda: _true(b.done()), "b admitted into the headroom")
    assert b.result().blocks == 10 and adm.queue_length == 3 and not any(t.done() for t in waiting)
    # A tenant's single request waiting behind the flood takes room that comes back before the flood does.
    c = asyncio.create_task(adm.admit(RequestId("c1"), 10, pool, flow="c"))
    await until(lambda: _true(adm.queue_length == 4), "c waits")
    await adm.release(held.pop())
    await until(lambda: _true(c.done()), "c admitted")
    assert adm.queue_length == 3
    # Once the others are quiet (fair_window_s), the flood books the whole pool again, head first.
    for res in (b.result(), c.result(), *held[:1]):
        await adm.release(res)
    await asyncio.gather(*waiting)
    assert [t.result().blocks for t in waiting] == [10, 10, 10]
    for res in [*held[1:], *(t.result() for t in waiting)]:
        await adm.release(res)
    assert adm.queue_length == 0 and adm.active == 0


async def test_a_flood_past_its_share_gets_a_lower_engine_priority_whatever_the_headroom(
        client: aioredis.Redis) -> None:
    """What the dispatcher asks after an admission: a tenant with a backlog past its credit, beside
    another tenant active in the window, is past its share (its prompts go after the others' on the
    workers), with no headroom configured too; the other tenant, and a request without a tenant, are
    not. Alone, the same backlog is not: one tenant alone keeps first come, first served."""
    adm, _, held, flood = await _flooded_past_its_credit(client, AdmissionConfig(fair_headroom=0.0), other_blocks=10)
    assert adm.past_share("a", 0) and not adm.past_share("b", 0) and not adm.past_share(None, 0)
    assert not adm.past_share("a", 1)  # a has nothing waiting in another class
    assert [engine_priority(0, True), engine_priority(0, False), engine_priority(1, False),
            engine_priority(-1, True)] == [1, 0, -2, 3]
    await _release_all(adm, held, flood)
    alone, _, held, flood = await _flooded_past_its_credit(client, AdmissionConfig(fair_headroom=0.0))
    assert not alone.past_share("a", 0)
    await _release_all(alone, held, flood)


async def test_a_tenant_waiting_within_its_credit_books_the_headroom_the_flood_may_not(
        client: aioredis.Redis) -> None:
    """Tenant b has two requests waiting, but within its burst credit (a's backlog is past its own):
    b is not held back from the headroom, so a room that comes back below the headroom is b's, and
    the flood keeps waiting."""
    adm, pool, held, flood = await _flooded_past_its_credit(client, AdmissionConfig(fair_headroom=0.2))
    b = [asyncio.create_task(adm.admit(RequestId(f"b{i}"), 10, pool, flow="b")) for i in range(2)]
    await until(lambda: _true(adm.queue_length == 9), "b's two wait")
    await adm.release(held.pop())
    await adm.release(held.pop())  # 20 blocks free: the headroom
    await until(lambda: _true(all(t.done() for t in b)), "both of b's admitted into the headroom")
    assert not any(t.done() for t in flood) and adm.queue_length == 7
    await _release_all(adm, [*held, *(t.result() for t in b)], flood)


async def test_a_higher_class_with_a_backlog_is_not_held_back_from_the_headroom_of_a_lower_one(
        client: aioredis.Redis) -> None:
    """The headroom is kept for tenants of the backlogged tenant's own class: an interactive burst
    beside a standard flood books the whole pool, and no standard request passes it."""
    adm, pool, held, flood = await _flooded(client, fair_window_s=5)
    burst = [asyncio.create_task(adm.admit(RequestId(f"p{i}"), 10, pool, priority=1, flow="p")) for i in range(2)]
    await until(lambda: _true(adm.queue_length == 5), "the interactive burst queued")
    b = asyncio.create_task(adm.admit(RequestId("b1"), 10, pool, flow="b"))
    await until(lambda: _true(adm.queue_length == 6), "b waits")
    for urgent in burst:
        await adm.release(held.pop())  # the last 10 % of the pool: the burst's, not b's
        await until(lambda: _true(urgent.done()), "the interactive request admitted")  # noqa: B023
        assert not b.done()
    await adm.release(held.pop())
    await until(lambda: _true(b.done()), "b admitted into the headroom")
    assert not any(t.done() for t in flood)
    for res in [*held, b.result(), *(t.result() for t in burst)]:
        await adm.release(res)
    await asyncio.gather(*flood)
    for res in (t.result() for t in flood):
        await adm.release(res)
    assert adm.queue_length == 0 and adm.active == 0


async def test_the_headroom_counted_in_requests_holds_room_for_that_many_of_the_others_requests(
        client: aioredis.Redis) -> None:
    """With ``fair_headroom_requests`` 2 (and no fraction), a flooding tenant leaves room for two of
    the other active tenant's last requests (15 blocks each): of 100 blocks it books 70, and b's two
    requests (within its credit) are admitted into the 30 on arrival."""
    adm, pool, held, flood = await _flooded_past_its_credit(
        client, AdmissionConfig(fair_headroom=0, fair_headroom_requests=2), other_blocks=15)
    for _ in range(3):
        await adm.release(held.pop())
    await asyncio.sleep(0.05)  # a's waiters look for room ten times: none for them
    assert not any(t.done() for t in flood) and adm.queue_length == 7
    b = [asyncio.create_task(adm.admit(RequestId(f"b{i}"), 15, pool, flow="b")) for i in range(2)]
    await until(lambda: _true(all(t.done() for t in b)), "both of b's admitted on arrival")
    assert not any(t.done() for t in flood) and adm.queue_length == 7
    await _release_all(adm, [*held, *(t.result() for t in b)], flood)


async def test_a_tenant_a_few_requests_past_its_share_is_not_held_back_like_the_flood(
        client: aioredis.Redis) -> None:
    """Tenant b has four requests waiting, its last starting one request past the virtual time: past
    its share, but by less than its credit (2), as the Poisson arrivals of a tenant sending at its
    share queue now and then. It books the headroom; the flood, past its share by far more, does not."""
    adm, pool, held, flood = await _flooded_past_its_credit(client, AdmissionConfig(fair_headroom=0.2))
    b = [asyncio.create_task(adm.admit(RequestId(f"b{i}"), 5, pool, flow="b")) for i in range(4)]
    await until(lambda: _true(adm.queue_length == 11), "b's four wait")
    assert adm._queue.over_share("a", 0) and not adm._queue.over_share("b", 0)
    await adm.release(held.pop())
    await adm.release(held.pop())  # 20 blocks free: the headroom
    await until(lambda: _true(all(t.done() for t in b)), "b's four admitted into the headroom")
    assert not any(t.done() for t in flood) and adm.queue_length == 7
    await _release_all(adm, [*held, *(t.result() for t in b)], flood)


async def test_a_tenant_refused_for_want_of_room_is_held_back_whatever_its_queued_tags(
        client: aioredis.Redis) -> None:
    """Tenant a has three requests waiting in a queue of three, its last starting within its credit
    (2) of the virtual time, and a fourth refused: the queue holds less than it asks for, so it is
    past its share whatever the tags of the three say, and it leaves the headroom to b."""
    pool = [DecodeCapacity(WorkerId("d0"), Epoch(1), 100)]
    adm = Admission(KvReservations(client, "tiny"), AdmissionConfig(
        queue_limit=3, queue_timeout_s=30, poll_interval_s=0.005, credit_fraction=0, fair_headroom=0.2,
        fair_window_s=30, fair_burst=2))
    await adm.release(await adm.admit(RequestId("b0"), 10, pool, flow="b"))
    held = [await adm.admit(RequestId(f"a{i}"), 10, pool, flow="a") for i in range(10)]
    flood = [asyncio.create_task(adm.admit(RequestId(f"a-wait{i}"), 10, pool, flow="a")) for i in range(3)]
    await until(lambda: _true(adm.queue_length == 3), "a's backlog queued")
    assert not adm._queue.over_share("a", 0)
    with pytest.raises(CapacityError):
        await adm.admit(RequestId("a-refused"), 10, pool, flow="a")
    await adm.release(held.pop())
    await adm.release(held.pop())  # 20 blocks free: the headroom, which a may not book
    await asyncio.sleep(0.05)
    assert not any(t.done() for t in flood)
    b = await adm.admit(RequestId("b1"), 10, pool, flow="b")  # joining the full queue, it pushed a's last out
    with pytest.raises(CapacityError):
        await flood.pop()
    assert adm.queue_length == 2
    await _release_all(adm, [*held, b], flood)


async def test_a_tenant_whose_requests_timed_out_is_not_taken_for_a_flood(client: aioredis.Redis) -> None:
    """Tenant b's two requests time out in a full pool (a moment's surge took the room), and its next
    two wait within its credit: b is not past its share (a timeout is no sign of a flood, a full queue
    turning it away is), so it books the headroom when room comes back, and the flood keeps waiting."""
    adm, pool, held, flood = await _flooded_past_its_credit(client, AdmissionConfig(fair_headroom=0.2))
    for i in range(2):
        with pytest.raises(CapacityError, match="within"):
            await adm.admit(RequestId(f"b-late{i}"), 10, pool, flow="b", deadline=time.monotonic() + 0.05)
    b = [asyncio.create_task(adm.admit(RequestId(f"b{i}"), 10, pool, flow="b")) for i in range(2)]
    await until(lambda: _true(adm.queue_length == 9), "b's two wait")
    assert adm.past_share("a", 0) and not adm.past_share("b", 0)
    await adm.release(held.pop())
    await adm.release(held.pop())  # 20 blocks free: the headroom
    await until(lambda: _true(all(t.done() for t in b)), "both of b's admitted into the headroom")
    assert not any(t.done() for t in flood) and adm.queue_length == 7
    await _release_all(adm, [*held, *(t.result() for t in b)], flood)


async def test_a_full_queue_costs_the_router_the_heads_polls_not_every_waiters(
        client: aioredis.Redis, monkeypatch: pytest.MonkeyPatch) -> None:
    """A thousand requests waiting for room: only the head (which must see room another router freed)
    looks again every poll interval; the others sleep until they are the head, are pushed out or time
    out. Every waiter polling instead kept the router's one event loop busy with their wake-ups (50 a
    second each): under an overload that filled the queue, the head was admitted late, the queue
    drained at a fraction of what the pool freed, and stayed full. Then, room back: the queue drains
    in order, each head admitted as the one before it leaves."""
    from pdrouter.router.admission.queue import WaitQueue

    looks = 0
    wait = WaitQueue.wait

    async def counted(self: WaitQueue, waiter: object, timeout: float) -> None:
        nonlocal looks
        looks += 1
        await wait(self, waiter, timeout)  # type: ignore[arg-type]

    monkeypatch.setattr(WaitQueue, "wait", counted)
    worker = [DecodeCapacity(WorkerId("d-full"), Epoch(1), 1000)]
    adm = Admission(KvReservations(client, "fullq"), AdmissionConfig(queue_timeout_s=30, poll_interval_s=0.02,
                                                                      credit_fraction=0))
    holder = await adm.admit(RequestId("holder"), 1000, worker)
    admitted: list[int] = []

    async def one(i: int) -> None:
        res = await adm.admit(RequestId(f"w{i}"), 1, worker)
        admitted.append(i)
        await adm.release(res)

    waiters = 1000
    tasks = [asyncio.create_task(one(i)) for i in range(waiters)]

    async def queued() -> bool:
        return adm.queue_length == waiters

    await until(queued, "every request queued")
    looks = 0
    started = time.monotonic()
    await asyncio.sleep(1.0)
    elapsed = time.monotonic() - started
    # Each waiter may look once after joining (woken or not); the head every poll interval.
    assert looks <= waiters + 2 * elapsed / 0.02 + 10, looks
    await adm.release(holder)
    await asyncio.wait_for(asyncio.gather(*tasks), 60)
    assert admitted == list(range(waiters)) and adm.queue_length == 0 and adm.active == 0
