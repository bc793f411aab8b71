"""Cache-aware routing with real workers, a real Redis prefix index, and Redis failures."""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
import redis.asyncio as aioredis

from pdrouter.core.hashing import hash_blocks
from pdrouter.core.tokenizer import load_tokenizer
from pdrouter.core.workers import WorkerRole
from pdrouter.router.admission.config import AdmissionConfig
from pdrouter.router.dispatch import DispatchConfig
from pdrouter.router.server import RouterProcess
from pdrouter.state.embedded_redis import EmbeddedRedis
from pdrouter.state.prefix_index import PrefixIndex

from .conftest import Cluster

SYSTEMS = [f"System prompt number {i}: you are a helpful assistant who answers briefly. " * 4 for i in range(4)]


async def complete(router: RouterProcess, prompt: str, max_tokens: int = 2) -> dict[str, object]:
    async with httpx.AsyncClient(timeout=30) as http:
        resp = await http.post(f"http://127.0.0.1:{router.http_port}/v1/completions",
                               json={"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0})
        assert resp.status_code == 200, resp.text
        return dict(resp.json())


def cached(answer: dict[str, object]) -> int:
    return int(answer["usage"]["prompt_tokens_details"]["cached_tokens"])  # type: ignore[index]


async def ready(router: RouterProcess, prefill: int, decode: int) -> None:
    assert router.pool is not None
    for _ in range(200):
        if len(router.pool.workers(WorkerRole.PREFILL)) == prefill and \
                len(router.pool.workers(WorkerRole.DECODE)) == decode:
            return
        await asyncio.sleep(0.05)
    raise AssertionError("workers did not register")


async def test_repeated_system_prompts_land_where_they_are_cached(cluster: Cluster) -> None:
    for i in range(3):
        cluster.spawn("prefill", worker_id=f"prefill-{i}")
    cluster.spawn("decode")
    router = await cluster.router(dispatch=DispatchConfig(local_prefill_tokens=0))
    await ready(router, 3, 1)
    system_blocks = [len(load_tokenizer(cluster.model).encode(s)) // 16 for s in SYSTEMS]
    for rnd in range(3):
        for i, system in enumerate(SYSTEMS):
            answer = await complete(router, f"{system}Question {rnd}?")
            if rnd > 0:
                assert cached(answer) >= system_blocks[i] * 16, (rnd, i, answer["usage"])
            await asyncio.sleep(0.05)  # block events reach the index
    assert router.dispatcher is not None
    stats = router.dispatcher.stats
    assert sum(stats.match_tokens.values()) > 0
    # The load spread over more than one worker: no collapse onto a single one.
    assert len([w for w, n in stats.placed_tokens.items() if n > 0]) >= 2
    async with httpx.AsyncClient() as http:
        text = (await http.get(f"http://127.0.0.1:{router.http_port}/metrics")).text
    assert "pdrouter_prefix_match_tokens_total" in text and "pdrouter_redis_up 1.0" in text


async def test_eviction_and_a_killed_worker_remove_entries(cluster: Cluster, redis_url: str) -> None:
    small = cluster.spawn("prefill", worker_id="prefill-small", num_blocks=40)  # 640 tokens of KV
    cluster.spawn("decode")
    router = await cluster.router(dispatch=DispatchConfig(local_prefill_tokens=0))
    await ready(router, 1, 1)
    tok = load_tokenizer(cluster.model)
    prompts = [f"Document {i}: " + "lorem ipsum dolor sit amet " * 18 for i in range(3)]
    client = aioredis.Redis.from_url(redis_url)
    index = PrefixIndex(client, "tiny")
    handle = router.pool.workers(WorkerRole.PREFILL)[0]  # type: ignore[union-attr]
    workers = [(handle.worker_id, handle.record.epoch)]
    first = hash_blocks(tok.encode(prompts[0]), 16)
    await complete(router, prompts[0])
    for _ in range(100):
        if (await index.lookup(first, workers))[0].blocks == len(first):
            break
        await asyncio.sleep(0.05)
    assert (await index.lookup(first, workers))[0].blocks == len(first)
    for p in prompts[1:]:
        await complete(router, p)
    for _ in range(100):  # prompt 0's blocks were evicted for the others: its entries go too
        if (await index.lookup(first, workers))[0].blocks == 0:
            break
        await asyncio.sleep(0.05)
    assert (await index.lookup(first, workers))[0].blocks == 0
    # A killed worker stops counting: it leaves the pool once its heartbeat lapses.
    survivor = cluster.spawn("prefill", worker_id="prefill-2")
    await ready(router, 2, 1)
    small.kill()
    await ready(router, 1, 1)
    assert [h.worker_id for h in router.pool.workers(WorkerRole.PREFILL)] == ["prefill-2"]  # type: ignore[union-attr]
    for _ in range(100):  # the router drops the dead incarnation's entries when it leaves the pool
        if await index.size(*workers[0]) == 0:
            break
        await asyncio.sleep(0.05)
    assert await index.size(*workers[0]) == 0
    assert survivor.alive
    assert (await complete(router, prompts[2]))["choices"]
    await client.aclose()


async def test_redis_restart_and_outage(cluster: Cluster, redis_server: EmbeddedRedis) -> None:
    cluster.spawn("prefill", worker_id="prefill-a")
    cluster.spawn("prefill", worker_id="prefill-b")
    cluster.spawn("decode")
    # --admission-on-redis-error local: with Redis gone, placement by load alone (the default refuses).
    router = await cluster.router(dispatch=DispatchConfig(local_prefill_tokens=0),
                                  admission_config=AdmissionConfig(queue_timeout_s=2.0, on_redis_error="local"))
    await ready(router, 2, 1)
    prompt = SYSTEMS[0] + "What now?"
    await complete(router, prompt)
    for _ in range(100):  # the first request's block events reach the index
        if cached(await complete(router, prompt)) > 0:
            break
        await asyncio.sleep(0.1)
    assert cached(await complete(router, prompt)) > 0
    # Redis goes away: requests are still served, on load alone, and the metrics say so.
    redis_server.stop()
    for i in range(3):
        assert (await complete(router, f"{SYSTEMS[1]} outage {i}"))["choices"]
    orch = router.dispatcher
    assert orch is not None and not orch.index_ok and not orch.admission_ok
    async with httpx.AsyncClient() as http:
        assert "pdrouter_redis_up 0.0" in (await http.get(f"http://127.0.0.1:{router.http_port}/metrics")).text
    # Redis comes back empty: workers re-register and republish, and hits return.
    # Until the decode worker has re-registered, a prefill worker refuses to send it KV (it is not in the
    # registry): those requests are 503, to retry; none fails any other way.
    redis_server.start()
    answer: dict[str, object] = {}
    for _ in range(400):
        async with httpx.AsyncClient(timeout=30) as http:
            resp = await http.post(f"http://127.0.0.1:{router.http_port}/v1/completions",
                                   json={"model": "tiny", "prompt": prompt, "max_tokens": 2, "temperature": 0})
        assert resp.status_code in (200, 503), resp.text
        if resp.status_code == 200:
            answer = resp.json()
            if cached(answer) > 0 and orch.index_ok:
                break
        await asyncio.sleep(0.1)
    assert cached(answer) > 0 and orch.index_ok and orch.admission_ok


async def test_redis_up_returns_to_one_when_redis_does_whatever_requests_arrive(
        cluster: Cluster, redis_server: EmbeddedRedis, wait_for: Any) -> None:
    """The metric followed the request path's last view: after a long prompt's lookup failed in the
    outage it stayed 0 until another long prompt came. Now the router's periodic reads of Redis say."""
    cluster.spawn("prefill", worker_id="prefill-a")
    cluster.spawn("decode")
    router = await cluster.router(dispatch=DispatchConfig(local_prefill_tokens=0),
                                  admission_config=AdmissionConfig(queue_timeout_s=2.0, on_redis_error="local"))
    await ready(router, 1, 1)
    metrics = f"http://127.0.0.1:{router.http_port}/metrics"

    async def redis_up(value: str) -> bool:
        async with httpx.AsyncClient(timeout=10) as http:
            return f"pdrouter_redis_up {value}" in (await http.get(metrics)).text

    await complete(router, SYSTEMS[0] + "before")
    await wait_for(lambda: redis_up("1.0"), timeout=10)
    redis_server.stop()
    await complete(router, SYSTEMS[1] + "during the outage")  # its index lookup and booking fail
    assert await redis_up("0.0")
    redis_server.start()
    # No request at all now: the metric comes back by itself (within a few of the router's 1 s refreshes).
    await wait_for(lambda: redis_up("1.0"), timeout=30, interval=0.25)
