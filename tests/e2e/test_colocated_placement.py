"""Colocated workers compute prompts too: a repeated prefix goes to the colocated worker that holds it.

Two colocated workers (simulated GPUs: the project's scheduler, block manager and prefix cache, and
the same block events into the real Redis index) behind a router in colocated mode. Each worker is
given a long prefix of its own directly (not through the router, so the router's own preferences
play no part in who holds what). Requests through the router that share a prefix are then booked
on its holder, as each answer's cached tokens and each worker's own prefix-cache counter
(``prefix_cache_hits`` in the heartbeats) show. Before colocated placement looked at the prefix index,
admission put them all on one worker (the one with this router's credit), so half of them missed.
The same placement serves vLLM workers (``tests/vllm/test_index.py``).
"""

from __future__ import annotations

import httpx
import pytest
import redis.asyncio as aioredis

from pdrouter.core.hashing import BlockHasher
from pdrouter.core.tokenizer import load_tokenizer
from pdrouter.core.workers import WorkerRole
from pdrouter.router.dispatch import DispatchConfig
from pdrouter.router.server import RouterProcess
from pdrouter.state.prefix_index import PrefixIndex
from pdrouter.state.registry import WorkerRegistry
from pdrouter.wire.security import PeerSecurity
from pdrouter.wire.v1 import common_pb2, worker_pb2, worker_pb2_grpc

from .conftest import Cluster

PREFIXES = {f"worker-{i}": f"System {i}: you are a careful assistant; answer in one short sentence only. " * 3
            for i in range(2)}


async def complete(router: RouterProcess, prompt: str) -> int:
    """The cached tokens of a completion through the router."""
    async with httpx.AsyncClient(timeout=30) as http:
        resp = await http.post(f"http://127.0.0.1:{router.http_port}/v1/completions",
                               json={"model": "tiny", "prompt": prompt, "max_tokens": 2, "temperature": 0})
        assert resp.status_code == 200, resp.text
        return int(resp.json()["usage"]["prompt_tokens_details"]["cached_tokens"])


async def prime(cluster: Cluster, address: str, prompt: list[int]) -> None:
    """Compute ``prompt`` on one worker, straight to its ``ColocatedWorker.Generate``."""
    async with PeerSecurity(cluster.internal_token, None).channel(address) as channel:
        stub = worker_pb2_grpc.ColocatedWorkerStub(channel)
        request = worker_pb2.WorkerGenerateRequest(request_id=f"prime-{address}", prompt_token_ids=prompt,
                                                   sampling=common_pb2.SamplingParams(max_tokens=1))
        async for _ in stub.Generate(request):
            pass


async def hits(registry: WorkerRegistry) -> dict[str, int]:
    return {w.record.worker_id: w.load.prefix_cache_hits for w in await registry.live_workers()}


@pytest.mark.parametrize("backend", ["sim"])
async def test_a_repeated_prefix_goes_to_the_colocated_worker_holding_it(cluster: Cluster, wait_for) -> None:
    workers = {name: cluster.spawn("worker", worker_id=name) for name in PREFIXES}
    router = await cluster.router(mode="colocated", dispatch=DispatchConfig(mode="colocated"))
    assert router.pool is not None
    await wait_for(lambda: len(router.pool.workers(WorkerRole.COLOCATED)) == 2, timeout=30)  # type: ignore[union-attr]
    client = aioredis.Redis.from_url(cluster.redis_url)
    registry = WorkerRegistry(client, "tiny")
    tokenizer = load_tokenizer(cluster.model)
    try:
        index = PrefixIndex(client, "tiny")
        for name, prefix in PREFIXES.items():
            ids = tokenizer.encode(prefix)
            address = workers[name].address
            assert address is not None
            await prime(cluster, address, ids)
            hashes = BlockHasher(16).hash_blocks(ids)
            live = [(w.record.worker_id, w.record.epoch) for w in await registry.live_workers()]

            async def indexed(hashes: list[bytes] = hashes, live: list = live, name: str = name) -> bool:
                return {m.worker_id: m.blocks for m in await index.lookup(hashes, live)}.get(name) == len(hashes)
            await wait_for(indexed, timeout=10)
        before = await hits(registry)
        cached = {name: [] for name in PREFIXES}  # type: dict[str, list[int]]
        for i in range(4):
            for name, prefix in PREFIXES.items():
                cached[name].append(await complete(router, prefix + f"Question {i}: what is {i} plus {i}?"))
        blocks = len(tokenizer.encode(PREFIXES["worker-0"])) // 16
        assert all(c >= blocks * 16 for found in cached.values() for c in found), cached  # every one a hit

        async def counted() -> bool:
            after = await hits(registry)
            return all(after[name] - before[name] == sum(cached[name]) for name in PREFIXES)
        await wait_for(counted, timeout=10)  # each counted by its holder's own prefix cache
    finally:
        await client.aclose()
