"""The worker registry against a real Redis: epochs, heartbeats, liveness, fencing."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest
import redis.asyncio as aioredis

from pdrouter.core.errors import StaleEpochError
from pdrouter.core.ids import Epoch, WorkerId
from pdrouter.core.workers import WorkerLoad, WorkerRecord, WorkerRole
from pdrouter.state.registry import WorkerRegistry


def make_record(worker_id: str = "decode-0", epoch: int = 1, role: WorkerRole = WorkerRole.DECODE,
                ) -> WorkerRecord:
    return WorkerRecord(worker_id=WorkerId(worker_id), role=role, address="127.0.0.1:5000",
                        epoch=Epoch(epoch), model="tiny", model_compat_hash="m", kv_compat_hash="k",
                        block_size=16, capacity_blocks=100, kv_address="127.0.0.1:5001",
                        kv_backends=("tcp",))


@pytest.fixture
async def registry(redis_url: str) -> AsyncIterator[WorkerRegistry]:
    client = aioredis.Redis.from_url(redis_url)
    yield WorkerRegistry(client, pool="tiny", heartbeat_ttl_ms=300)
    await client.aclose()


async def test_register_heartbeat_and_list(registry: WorkerRegistry) -> None:
    e1 = await registry.new_epoch()
    e2 = await registry.new_epoch()
    assert e2 > e1
    await registry.register(make_record("decode-0", e1))
    await registry.register(make_record("prefill-0", e2, WorkerRole.PREFILL))
    load = WorkerLoad(running=3, free_blocks=90, total_blocks=100)
    await registry.heartbeat(WorkerId("decode-0"), e1, load)
    live = await registry.live_workers(WorkerRole.DECODE)
    assert [w.record.worker_id for w in live] == ["decode-0"]
    assert live[0].load == WorkerLoad(running=3, free_blocks=90, total_blocks=100)
    assert live[0].record == make_record("decode-0", e1)
    assert live[0].record.capacity_tokens == 1600
    assert {w.record.worker_id for w in await registry.live_workers()} == {"decode-0", "prefill-0"}


async def test_the_backlog_by_priority_travels_and_a_newer_workers_fields_are_left_out(
        registry: WorkerRegistry, redis_url: str) -> None:
    epoch = await registry.new_epoch()
    await registry.register(make_record("prefill-0", epoch, WorkerRole.PREFILL))
    load = WorkerLoad(queued_prefill_tokens=700, queued_prefill_by_priority=((-2, 100), (0, 200), (1, 400)))
    await registry.heartbeat(WorkerId("prefill-0"), epoch, load)
    (live,) = await registry.live_workers(WorkerRole.PREFILL)
    assert live.load == load
    assert [live.load.prefill_tokens_ahead(p) for p in (-3, -2, 0, 1, 5)] == [0, 100, 300, 700, 700]
    # A worker of a later version heartbeats a field this one does not know: the load still reads.
    client = aioredis.Redis.from_url(redis_url)
    try:
        key = registry.keys.heartbeat(WorkerId("prefill-0"))
        await client.set(key, f'{epoch} {{"running":2,"queued_prefill_tokens":5,"a_later_field":[1]}}', px=5000)
    finally:
        await client.aclose()
    (live,) = await registry.live_workers(WorkerRole.PREFILL)
    assert live.load == WorkerLoad(running=2, queued_prefill_tokens=5)
    # Without the split (vLLM), the whole backlog is ahead of every prompt.
    assert live.load.prefill_tokens_ahead(-4) == 5


async def test_lapsed_heartbeat_stops_counting(registry: WorkerRegistry) -> None:
    await registry.register(make_record("decode-0", 1))
    assert len(await registry.live_workers()) == 1
    await asyncio.sleep(0.45)  # TTL is 300 ms
    assert await registry.live_workers() == []
    assert len(await registry.records()) == 1  # still registered, just not live


async def test_restart_takes_new_epoch_and_fences_the_old_one(registry: WorkerRegistry) -> None:
    await registry.register(make_record("decode-0", 1))
    await registry.register(make_record("decode-0", 2))
    with pytest.raises(StaleEpochError, match="superseded"):
        await registry.heartbeat(WorkerId("decode-0"), Epoch(1), WorkerLoad())
    with pytest.raises(StaleEpochError, match="older"):
        await registry.register(make_record("decode-0", 1))
    assert not await registry.deregister(WorkerId("decode-0"), Epoch(1))
    live = await registry.live_workers()
    assert [w.record.epoch for w in live] == [2]
    assert await registry.deregister(WorkerId("decode-0"), Epoch(2))
    assert await registry.live_workers() == []


async def test_heartbeat_after_redis_flush_asks_to_register(registry: WorkerRegistry, redis_url: str) -> None:
    await registry.register(make_record("decode-0", 1))
    client = aioredis.Redis.from_url(redis_url)
    await client.flushall()
    await client.aclose()
    with pytest.raises(StaleEpochError, match="not registered"):
        await registry.heartbeat(WorkerId("decode-0"), Epoch(1), WorkerLoad())
