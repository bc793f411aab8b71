"""KV admission shared by router replicas: never over-booked, 429 when full, leases of a dead router expire."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from pathlib import Path

import httpx
import redis.asyncio as aioredis

from pdrouter.cli.local_cluster import ManagedProcess
from pdrouter.core.capacity import plan_capacity
from pdrouter.core.gpu import GiB, get_gpu_preset
from pdrouter.core.model_spec import get_model_preset
from pdrouter.core.workers import WorkerRole
from pdrouter.engine.config import EngineConfig
from pdrouter.state.keys import PoolKeys
from pdrouter.state.registry import WorkerRegistry
from pdrouter.state.reservations import KvReservations

from .conftest import Cluster, spawn_router

DECODE_BLOCKS = 64
PROMPT = "Summarise the following text in one line: " + "pack my box with five dozen liquor jugs " * 2


def test_planner_capacity_equals_the_capacity_math() -> None:
    spec, gpu = get_model_preset("llama-3-8b"), get_gpu_preset("h100")
    plan = plan_capacity(spec, gpu, utilization=0.9)
    config = EngineConfig(model_dir=Path("unused"), memory_budget_bytes=gpu.memory_bytes, memory_utilization=0.9,
                          overhead_bytes=2 * GiB)
    assert config.pool_blocks(spec, None) == plan.num_blocks


async def send(http: httpx.AsyncClient, address: str, max_tokens: int = 150) -> int:
    try:
        resp = await http.post(f"http://{address}/v1/completions", json={
            "model": "tiny", "prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True})
    except httpx.HTTPError:
        return -1  # the router died under the request
    if resp.status_code == 429:
        assert resp.headers.get("retry-after")
        assert resp.json()["error"]["type"]
    return resp.status_code


async def test_two_routers_never_overbook_and_dead_router_leases_expire(cluster: Cluster) -> None:
    cluster.spawn("prefill")
    cluster.spawn("decode", worker_id="decode-0", num_blocks=DECODE_BLOCKS)
    router_a = spawn_router(cluster, "router-a")
    router_b = spawn_router(cluster, "router-b")
    client = aioredis.Redis.from_url(cluster.redis_url)
    registry = WorkerRegistry(client, "tiny")
    for _ in range(100):
        decodes = await registry.live_workers(WorkerRole.DECODE)
        if decodes:
            break
        await asyncio.sleep(0.05)
    epoch = decodes[0].record.epoch
    used_key = PoolKeys("pdr", "tiny").kv_used("decode-0", epoch)
    peak = 0
    stop = asyncio.Event()

    async def watch() -> None:
        nonlocal peak
        while not stop.is_set():
            peak = max(peak, int(await client.get(used_key) or 0))
            await asyncio.sleep(0.002)

    async def used_settles_to_zero() -> int:
        # Routers release bookings in the background, so a reply can reach the client first.
        for _ in range(200):
            used = int(await client.get(used_key) or 0)
            if used == 0:
                break
            await asyncio.sleep(0.05)
        return used

    watcher = asyncio.create_task(watch())
    try:
        await burst_and_kill(router_a, router_b, client, used_key, epoch, used_settles_to_zero)
    finally:
        stop.set()
        await watcher
        await client.aclose()
    assert 0 < peak <= DECODE_BLOCKS


async def burst_and_kill(router_a: ManagedProcess, router_b: ManagedProcess,
                         client: aioredis.Redis, used_key: str, epoch: int,
                         used_settles_to_zero: Callable[[], Awaitable[int]]) -> None:
    await asyncio.sleep(1.0)  # both routers have discovered the workers
    assert router_a.address and router_b.address
    # Each request books 27 of the 64 blocks, so two at a time fit; they hold them for 300 decode
    # steps, far longer than the 50 ms a request may queue, so the rest are refused.
    async with httpx.AsyncClient(timeout=60) as http:
        statuses = await asyncio.gather(*(send(http, (router_a if i % 2 else router_b).address or "", 300)
                                          for i in range(20)))
    assert set(statuses) <= {200, 429}, statuses
    assert statuses.count(200) >= 2 and statuses.count(429) >= 1, statuses
    assert await used_settles_to_zero() == 0  # every booking is gone
    # A router killed mid-burst: its bookings expire with their leases.
    async with httpx.AsyncClient(timeout=60) as http:
        burst = [asyncio.create_task(send(http, router_b.address or "", max_tokens=400)) for _ in range(3)]
        for _ in range(200):
            if int(await client.get(used_key) or 0) > 0:
                break
            await asyncio.sleep(0.01)
        router_b.kill()
        await asyncio.gather(*burst)
    assert int(await client.get(used_key) or 0) > 0  # the dead router's bookings are still there...
    reservations = KvReservations(client, "tiny")
    for _ in range(100):
        if await reservations.used("decode-0", epoch) == 0:
            break
        await asyncio.sleep(0.1)
    assert await reservations.used("decode-0", epoch) == 0  # ...until their leases run out
    # The surviving router still serves.
    async with httpx.AsyncClient(timeout=60) as http:
        assert await send(http, router_a.address or "", max_tokens=4) == 200
