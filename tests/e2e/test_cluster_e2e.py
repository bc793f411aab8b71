"""Disaggregated serving on a Redis Cluster (3 masters, a replica each): simulated workers and
routers given the ``redis+cluster://`` URL admit without over-booking and route to cached prefixes."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest

from pdrouter.core.tokenizer import load_tokenizer
from pdrouter.core.workers import WorkerRole
from pdrouter.router.dispatch import DispatchConfig
from pdrouter.router.server import RouterProcess
from pdrouter.state.client import redis_client
from pdrouter.state.keys import PoolKeys
from pdrouter.state.registry import WorkerRegistry

from .conftest import Cluster, spawn_router

DECODE_BLOCKS = 64
PROMPT = "Summarise the following text in one line: " + "pack my box with five dozen liquor jugs " * 2
SYSTEMS = [f"System prompt number {i}: you are a helpful assistant who answers briefly. " * 4 for i in range(4)]


@pytest.fixture
async def on_cluster(tiny_model: Path, redis_cluster_url: str) -> AsyncIterator[Cluster]:
    """Simulated workers and routers sharing the session's Redis Cluster."""
    c = Cluster(model=tiny_model, redis_url=redis_cluster_url, backend="sim")
    yield c
    try:
        for r in c.routers:
            await asyncio.wait_for(r.stop(grace=1.0), timeout=60)
    finally:
        for p in c.procs:
            p.stop()


async def send(http: httpx.AsyncClient, address: str, max_tokens: int) -> int:
    resp = await http.post(f"http://{address}/v1/completions", json={
        "model": "tiny", "prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True})
    if resp.status_code == 429:
        assert resp.headers.get("retry-after") and resp.json()["error"]["type"]
    return resp.status_code


async def test_two_routers_on_a_cluster_never_overbook(on_cluster: Cluster) -> None:
    on_cluster.spawn("prefill", time_scale=1.0)
    on_cluster.spawn("decode", worker_id="decode-0", num_blocks=DECODE_BLOCKS, time_scale=1.0)
    router_a = spawn_router(on_cluster, "router-a")
    router_b = spawn_router(on_cluster, "router-b")
    client = redis_client(on_cluster.redis_url, max_connections=4, pool_timeout_s=2.0)
    try:
        registry = WorkerRegistry(client, "tiny")
        for _ in range(100):
            decodes = await registry.live_workers(WorkerRole.DECODE)
            if decodes:
                break
            await asyncio.sleep(0.05)
        used_key = PoolKeys("pdr", "tiny", bookings_apart=True).kv_used("decode-0", decodes[0].record.epoch)
        peak, stop = 0, asyncio.Event()

        async def watch() -> None:
            nonlocal peak
            while not stop.is_set():
                peak = max(peak, int(await client.get(used_key) or 0))
                await asyncio.sleep(0.002)

        await asyncio.sleep(1.0)  # both routers have discovered the workers
        watcher = asyncio.create_task(watch())
        try:
            # Each request books 27 of the 64 blocks, so two fit at a time; a simulated decode
            # step takes ~1.7 ms, so 300 tokens hold them far longer than a request may queue.
            async with httpx.AsyncClient(timeout=60) as http:
                statuses = await asyncio.gather(*(send(http, (router_a if i % 2 else router_b).address or "", 300)
                                                  for i in range(20)))
        finally:
            stop.set()
            await watcher
        assert set(statuses) <= {200, 429}, statuses
        assert statuses.count(200) >= 2 and statuses.count(429) >= 1, statuses
        assert 0 < peak <= DECODE_BLOCKS
        for _ in range(200):  # releases go in the background: a reply can reach the client first
            if int(await client.get(used_key) or 0) == 0:
                break
            await asyncio.sleep(0.05)
        assert int(await client.get(used_key) or 0) == 0
    finally:
        await client.aclose()


async def complete(router: RouterProcess, prompt: str) -> dict[str, object]:
    async with httpx.AsyncClient(timeout=30) as http:
        resp = await http.post(f"http://127.0.0.1:{router.http_port}/v1/completions",
                               json={"model": "tiny", "prompt": prompt, "max_tokens": 2, "temperature": 0})
        assert resp.status_code == 200, resp.text
        return dict(resp.json())


async def test_prompts_land_where_they_are_cached_on_a_cluster(on_cluster: Cluster) -> None:
    for i in range(3):
        on_cluster.spawn("prefill", worker_id=f"prefill-{i}")
    on_cluster.spawn("decode")
    router = await on_cluster.router(dispatch=DispatchConfig(local_prefill_tokens=0))
    assert router.pool is not None
    for _ in range(200):
        if len(router.pool.workers(WorkerRole.PREFILL)) == 3 and len(router.pool.workers(WorkerRole.DECODE)) == 1:
            break
        await asyncio.sleep(0.05)
    system_blocks = [len(load_tokenizer(on_cluster.model).encode(s)) // 16 for s in SYSTEMS]
    for rnd in range(3):
        for i, system in enumerate(SYSTEMS):
            answer = await complete(router, f"{system}Question {rnd}?")
            if rnd > 0:
                cached = int(answer["usage"]["prompt_tokens_details"]["cached_tokens"])  # type: ignore[index]
                assert cached >= system_blocks[i] * 16, (rnd, i, answer["usage"])
            await asyncio.sleep(0.05)  # block events reach the index
    assert router.dispatcher is not None
    stats = router.dispatcher.stats
    assert sum(stats.match_tokens.values()) > 0
    assert len([w for w, n in stats.placed_tokens.items() if n > 0]) >= 2  # no collapse onto one worker
    async with httpx.AsyncClient() as http:
        text = (await http.get(f"http://127.0.0.1:{router.http_port}/metrics")).text
    assert "pdrouter_prefix_match_tokens_total" in text and "pdrouter_redis_up 1.0" in text
