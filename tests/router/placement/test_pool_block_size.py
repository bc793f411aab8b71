"""A worker whose KV blocks are not the router's size is left out of its pool, with a warning naming ``--block-size``.

The router hashes prompts into blocks of its own ``--block-size`` and books KV in them; a worker with
other blocks (a vLLM worker on the CPU, whose kernels take multiples of 32 tokens) would be read
wrongly by both. Real Redis, the real registry."""

from __future__ import annotations

import logging

import pytest
import redis.asyncio as aioredis

from pdrouter.core.ids import WorkerId
from pdrouter.core.workers import WorkerLoad, WorkerRecord, WorkerRole
from pdrouter.router.placement.worker_pool import WorkerPool
from pdrouter.state.registry import WorkerRegistry


async def _register(registry: WorkerRegistry, worker_id: str, block_size: int) -> None:
    epoch = await registry.new_epoch()
    record = WorkerRecord(worker_id=WorkerId(worker_id), role=WorkerRole.COLOCATED, address="127.0.0.1:1",
                          epoch=epoch, model="m", model_compat_hash=f"c{block_size}", kv_compat_hash="k",
                          block_size=block_size, capacity_blocks=100, engine="vllm", engine_version="0.32.0")
    await registry.register(record)
    await registry.heartbeat(record.worker_id, epoch, WorkerLoad(total_blocks=100, free_blocks=100))


async def test_a_worker_with_other_blocks_is_left_out(redis_url: str, caplog: pytest.LogCaptureFixture) -> None:
    client = aioredis.Redis.from_url(redis_url)
    registry = WorkerRegistry(client, "m", heartbeat_ttl_ms=60_000)
    await _register(registry, "w16", 16)
    await _register(registry, "w32", 32)
    pool = WorkerPool("m", registry, use_lane=False, block_size=16)
    try:
        with caplog.at_level(logging.WARNING):
            await pool.refresh()
            await pool.refresh()
        assert [h.worker_id for h in pool.workers()] == ["w16"]
        warnings = [r.getMessage() for r in caplog.records if "w32" in r.getMessage()]
        assert len(warnings) == 1 and "--block-size 32" in warnings[0]
        assert pool.workers()[0].record.engine == "vllm"  # the record names its engine and version
        assert pool.workers()[0].record.engine_version == "0.32.0"
    finally:
        await pool.stop()
        await client.aclose()
