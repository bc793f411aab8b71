"""KV reservations against a real Redis: atomic booking, policies, leases, epochs, shrink."""

from __future__ import annotations

import asyncio
import random
from collections.abc import AsyncIterator

import pytest
import redis.asyncio as aioredis

from pdrouter.core.errors import CapacityError, InvalidRequestError, RequestTooLargeError
from pdrouter.core.ids import Epoch, RequestId, WorkerId
from pdrouter.state.reservations import DecodeCapacity, KvReservations, PickPolicy

D0 = DecodeCapacity(WorkerId("d0"), Epoch(1), 100)
D1 = DecodeCapacity(WorkerId("d1"), Epoch(1), 60)


@pytest.fixture
async def client(redis_url: str) -> AsyncIterator[aioredis.Redis]:
    c = aioredis.Redis.from_url(redis_url)
    yield c
    await c.aclose()


async def test_most_free_and_best_fit(client: aioredis.Redis) -> None:
    spread = KvReservations(client, "tiny")
    r1 = await spread.reserve(RequestId("a"), 30, [D0, D1], lease_ms=10_000)
    assert r1.worker_id == "d0"  # 100 free beats 60
    r2 = await spread.reserve(RequestId("b"), 30, [D0, D1], lease_ms=10_000)
    assert r2.worker_id == "d0"  # 70 free still beats 60
    r3 = await spread.reserve(RequestId("c"), 30, [D0, D1], lease_ms=10_000)
    assert r3.worker_id == "d1"  # 40 < 60
    assert (await spread.used("d0", 1), await spread.used("d1", 1)) == (60, 30)
    pack = KvReservations(client, "tiny", policy=PickPolicy.BEST_FIT)
    r4 = await pack.reserve(RequestId("d"), 30, [D0, D1], lease_ms=10_000)
    assert r4.worker_id == "d1"  # 30 free fits exactly; d0 has 40
    with pytest.raises(CapacityError, match="most free: 40"):
        await pack.reserve(RequestId("e"), 41, [D0, D1], lease_ms=10_000)
    assert await pack.release(r4) == 30
    assert await pack.release(r4) == 0
    assert await spread.used("d1", 1) == 30


async def test_idempotent_and_bad_input(client: aioredis.Redis) -> None:
    res = KvReservations(client, "tiny")
    a = await res.reserve(RequestId("a"), 10, [D0], lease_ms=10_000)
    again = await res.reserve(RequestId("a"), 10, [D0], lease_ms=10_000)
    assert again.worker_id == a.worker_id and await res.used("d0", 1) == 10
    with pytest.raises(RequestTooLargeError, match="largest decode worker holds 100"):
        await res.reserve(RequestId("huge"), 101, [D0, D1], lease_ms=10_000)
    with pytest.raises(InvalidRequestError):
        await res.reserve(RequestId("z"), 0, [D0], lease_ms=10_000)
    with pytest.raises(CapacityError, match="no decode worker"):
        await res.reserve(RequestId("z"), 1, [], lease_ms=10_000)
    assert await res.used("d0", 1) == 10


async def test_leases_expire_and_renew(client: aioredis.Redis) -> None:
    res = KvReservations(client, "tiny")
    short = await res.reserve(RequestId("short"), 40, [D0], lease_ms=150)
    kept = await res.reserve(RequestId("kept"), 40, [D0], lease_ms=150)
    for _ in range(4):
        await asyncio.sleep(0.08)
        assert await res.renew(kept)
    assert await res.used("d0", 1) == 40
    assert not await res.renew(short)
    assert await res.bookings("d0", 1) == {"kept": 40}


async def test_new_epoch_has_fresh_capacity(client: aioredis.Redis) -> None:
    res = KvReservations(client, "tiny")
    await res.reserve(RequestId("a"), 100, [D0], lease_ms=10_000)
    with pytest.raises(CapacityError):
        await res.reserve(RequestId("b"), 1, [D0], lease_ms=10_000)
    restarted = DecodeCapacity(WorkerId("d0"), Epoch(2), 100)
    r = await res.reserve(RequestId("b"), 100, [restarted], lease_ms=10_000)
    assert r.epoch == 2


async def test_shrink_returns_blocks(client: aioredis.Redis) -> None:
    res = KvReservations(client, "tiny")
    r = await res.reserve(RequestId("a"), 50, [D0], lease_ms=10_000)
    assert await res.shrink(r, 20) == 30
    assert await res.shrink(r, 40) == 0  # never grows
    assert await res.used("d0", 1) == 20


async def test_concurrent_routers_never_overbook(redis_url: str) -> None:
    clients = [aioredis.Redis.from_url(redis_url) for _ in range(2)]
    routers = [KvReservations(c, "tiny") for c in clients]
    rng = random.Random(0)
    ok: list[tuple[KvReservations, object]] = []

    async def one(i: int) -> None:
        router = routers[i % 2]
        try:
            r = await router.reserve(RequestId(f"r{i}"), rng.randint(1, 25), [D0, D1], lease_ms=10_000)
            ok.append((router, r))
        except CapacityError:
            pass

    await asyncio.gather(*(one(i) for i in range(200)))
    used0, used1 = await routers[0].used("d0", 1), await routers[0].used("d1", 1)
    assert used0 <= 100 and used1 <= 60
    assert used0 + used1 == sum(r.blocks for _, r in ok)  # type: ignore[attr-defined]
    for router, r in ok:
        await router.release(r)  # type: ignore[arg-type]
    assert (await routers[0].used("d0", 1), await routers[0].used("d1", 1)) == (0, 0)
    for c in clients:
        await c.aclose()


async def test_concurrent_calls_share_round_trips_and_never_overbook(client: aioredis.Redis) -> None:
    res = KvReservations(client, "coalesce")
    pool = [DecodeCapacity(WorkerId("c0"), Epoch(1), 50), DecodeCapacity(WorkerId("c1"), Epoch(1), 50)]
    outcomes = await asyncio.gather(*(res.reserve(RequestId(f"r{i}"), 7, pool, lease_ms=10_000) for i in range(40)),
                                    return_exceptions=True)
    booked = [o for o in outcomes if not isinstance(o, BaseException)]
    assert len(booked) == 14  # 7 blocks each: 7 fit in 50 on each worker
    assert all(isinstance(o, CapacityError) for o in outcomes if isinstance(o, BaseException))
    assert await res.used("c0", 1) == await res.used("c1", 1) == 49
    assert res.round_trips < 10  # 40 requests, a handful of script calls
    assert sorted(await asyncio.gather(*(res.release(r) for r in booked))) == [7] * 14  # type: ignore[arg-type]
    assert await res.used("c0", 1) == await res.used("c1", 1) == 0
    # Shrinks and releases of different workers in one batch.
    a = await res.reserve(RequestId("a"), 10, pool[:1], lease_ms=10_000)
    b = await res.reserve(RequestId("b"), 10, pool[1:], lease_ms=10_000)
    assert await asyncio.gather(res.shrink(a, 4), res.release(b), res.release(b), res.shrink(a, 9)) == [6, 10, 0, 0]
    assert (await res.used("c0", 1), await res.used("c1", 1)) == (4, 0)


async def test_a_cancelled_reserve_gives_its_booking_back(client: aioredis.Redis) -> None:
    res = KvReservations(client, "abandon")
    pool = [DecodeCapacity(WorkerId("x0"), Epoch(1), 20)]
    task = asyncio.ensure_future(res.reserve(RequestId("gone"), 5, pool, lease_ms=10_000))
    while res.round_trips == 0:  # until the batch is on its way to Redis
        await asyncio.sleep(0)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    for _ in range(200):
        if await res.used("x0", 1) == 0 and not await res.bookings("x0", 1):
            break
        await asyncio.sleep(0.01)
    assert await res.used("x0", 1) == 0 and await res.bookings("x0", 1) == {}
    assert res.round_trips == 2  # the booking was made (one call), then given back (another)


async def test_releases_ride_along_with_the_next_reservations(client: aioredis.Redis) -> None:
    res = KvReservations(client, "ride", resize_delay_s=30.0)  # only a reserve (or urgency) sends them
    pool = [DecodeCapacity(WorkerId("w0"), Epoch(1), 10)]
    first = await res.reserve(RequestId("first"), 10, pool, lease_ms=10_000)
    assert res.round_trips == 1
    released = asyncio.ensure_future(res.release(first))
    await asyncio.sleep(0.05)
    assert not released.done() and await res.used("w0", 1) == 10  # held back, waiting for company
    # The next reservation carries the release: the blocks it frees are already free for it.
    second = await res.reserve(RequestId("second"), 10, pool, lease_ms=10_000)
    assert await released == 10 and second.worker_id == "w0"
    assert res.round_trips == 2
    # Urgent releases go at once; flush() sends whatever still waits.
    assert await res.release(second, urgent=True) == 10 and res.round_trips == 3
    third = await res.reserve(RequestId("third"), 4, pool, lease_ms=10_000)
    later = asyncio.ensure_future(res.shrink(third, 1))
    await asyncio.sleep(0)
    await res.flush()
    assert await later == 3 and await res.used("w0", 1) == 1
