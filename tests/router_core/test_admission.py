"""The admission queue against a real Redis: priority then FIFO, deadlines, limits, too-large."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest
import redis.asyncio as aioredis

from pdcommon.errors import CapacityError, RequestTooLargeError
from pdcommon.ids import Epoch, RequestId, WorkerId
from pdstate.reservations import DecodeCapacity, KvReservations
from router.admission import Admission, AdmissionConfig

WORKER = [DecodeCapacity(WorkerId("d0"), Epoch(1), 10)]


@pytest.fixture
async def client(redis_url: str) -> AsyncIterator[aioredis.Redis]:
    c = aioredis.Redis.from_url(redis_url)
    yield c
    await c.aclose()


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
