"""Four router replicas (separate processes) on one Redis: a burst never books a decode worker past its pool.

A small simulated decode pool (2 workers of ``DECODE_BLOCKS`` blocks; a request needs
``REQUEST_BLOCKS``, so ``POOL_REQUESTS`` fit at once) takes a burst of ``BURST`` concurrent
requests spread over the four replicas, so most of the burst queues for room. A poller reads
every worker incarnation's bookings straight from Redis every 2 ms (one ``MULTI``: the bookings
hash and the ``kv:used`` counter) and records every poll in which either exceeded the worker's
registered ``capacity_blocks``, or disagreed with each other.
"""

from __future__ import annotations

import asyncio
import threading
import time
from dataclasses import dataclass, field

import httpx
import pytest
import redis
import redis.asyncio as aioredis

from pdrouter.cli.local_cluster import ManagedProcess
from pdrouter.core.capacity import blocks_for_tokens
from pdrouter.core.workers import WorkerRole
from pdrouter.state.keys import PoolKeys
from pdrouter.state.registry import WorkerRegistry
from pdrouter.wire.security import INTERNAL_TOKEN_ENV

from .conftest import Cluster

ROUTERS = 4
DECODE_WORKERS = 2
DECODE_BLOCKS = 24
PROMPT = "hello replicas"  # byte tokenizer: under --local-prefill-tokens, so the decode worker prefills it
MAX_TOKENS = 48
REQUEST_BLOCKS = blocks_for_tokens(len(PROMPT) + 1 + MAX_TOKENS, 16)  # + BOS
POOL_REQUESTS = DECODE_WORKERS * (DECODE_BLOCKS // REQUEST_BLOCKS)
BURST = 96
POLL_INTERVAL_S = 0.002


@pytest.fixture
def backend() -> str:
    return "sim"


@dataclass(frozen=True)
class Incarnation:
    """One decode worker incarnation's booking keys and its registered pool."""

    worker_id: str
    book_key: str
    lease_key: str
    used_key: str
    capacity: int


@dataclass
class Watch:
    """What the poller saw."""

    polls: int = 0
    peak: dict[str, int] = field(default_factory=dict)
    violations: list[str] = field(default_factory=list)
    """Polls in which a worker's bookings or ``kv:used`` exceeded its capacity."""
    mismatches: list[str] = field(default_factory=list)
    """Polls in which ``kv:used`` was not the sum of the bookings hash."""
    error: str = ""
    """Why the poller stopped before it was told to (empty: it did not)."""


def start_routers(cluster: Cluster, credit: str) -> list[ManagedProcess]:
    """``ROUTERS`` ``pdrouter router`` processes on the cluster's Redis, started at once."""
    procs = [ManagedProcess(f"router-{i}", [
        "router", "--model", str(cluster.model), "--redis", cluster.redis_url, "--http-port", "0",
        "--grpc-port", "0", "--queue-timeout-s", "15", "--lease-ms", "5000", "--admission-credit", credit,
        "--log-level", "WARNING"],
        env={INTERNAL_TOKEN_ENV: cluster.internal_token}) for i in range(ROUTERS)]
    cluster.procs.extend(procs)
    for p in procs:
        p.wait_ready()
    return procs


async def incarnations(client: aioredis.Redis) -> list[Incarnation]:
    """The live decode worker incarnations and their registered pools (waits for all of them)."""
    registry, keys = WorkerRegistry(client, "tiny"), PoolKeys("pdr", "tiny")
    for _ in range(200):
        live = await registry.live_workers(WorkerRole.DECODE)
        if len(live) == DECODE_WORKERS:
            break
        await asyncio.sleep(0.05)
    assert len(live) == DECODE_WORKERS, live
    return [Incarnation(w.record.worker_id, keys.kv_bookings(w.record.worker_id, w.record.epoch),
                        keys.kv_leases(w.record.worker_id, w.record.epoch),
                        keys.kv_used(w.record.worker_id, w.record.epoch), w.record.capacity_blocks) for w in live]


def poll(url: str, workers: list[Incarnation], watch: Watch, stop: threading.Event) -> None:
    """Every ``POLL_INTERVAL_S`` until ``stop``: each worker's bookings and used counter, read in one
    transaction. Runs in a thread with a client of its own, so a busy event loop does not space
    the polls out."""
    client = redis.Redis.from_url(url)
    next_at = time.monotonic()
    try:
        while not stop.is_set():
            pipe = client.pipeline(transaction=True)
            for w in workers:
                pipe.hvals(w.book_key)
                pipe.get(w.used_key)
            values = pipe.execute()
            watch.polls += 1
            for i, w in enumerate(workers):
                booked = sum(int(v) for v in values[2 * i])
                used = int(values[2 * i + 1] or 0)
                watch.peak[w.worker_id] = max(watch.peak.get(w.worker_id, 0), booked)
                if booked > w.capacity or used > w.capacity:
                    watch.violations.append(f"poll {watch.polls}: {w.worker_id} booked {booked}, used {used}, "
                                            f"capacity {w.capacity}")
                if booked != used:
                    watch.mismatches.append(f"poll {watch.polls}: {w.worker_id} bookings sum {booked} != "
                                            f"used {used}")
            next_at += POLL_INTERVAL_S
            time.sleep(max(0.0, next_at - time.monotonic()))
    except Exception as exc:  # recorded: a poller that died must not read as "no violation"
        watch.error = f"{type(exc).__name__}: {exc}"
    finally:
        client.close()


async def send(http: httpx.AsyncClient, address: str) -> int:
    """One completion; its status (a refusal must be a clean one: an error body, Retry-After on 429)."""
    resp = await http.post(f"http://{address}/v1/completions", json={
        "model": "tiny", "prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True})
    if resp.status_code in (429, 503):
        assert resp.json()["error"]["type"], resp.text
        if resp.status_code == 429:
            assert resp.headers.get("retry-after"), resp.headers
    elif resp.status_code == 200:
        assert resp.json()["usage"]["completion_tokens"] == MAX_TOKENS, resp.text
    return resp.status_code


@pytest.mark.parametrize("credit", ["0.05", "0"], ids=["credit", "no-credit"])
async def test_four_replicas_never_overbook_a_decode_pool(cluster: Cluster, credit: str) -> None:
    """With credit (chunks booked ahead, requests admitted in memory) and without (every request
    booked on its own): never over the pool, every request answered, nothing left booked."""
    for i in range(DECODE_WORKERS):
        # Time scale 1: a decode step of the tiny model takes ~1.7 ms, so a request holds its
        # blocks for ~80 ms and the burst has to queue.
        cluster.spawn("decode", worker_id=f"decode-{i}", num_blocks=DECODE_BLOCKS, time_scale=1.0)
    routers = start_routers(cluster, credit)
    addresses = [r.address or "" for r in routers]
    client = aioredis.Redis.from_url(cluster.redis_url)
    try:
        workers = await incarnations(client)
        assert all(w.capacity == DECODE_BLOCKS for w in workers), workers
        assert BURST >= 4 * POOL_REQUESTS  # most of the burst cannot fit at once
        async with httpx.AsyncClient(timeout=60) as http:
            # Every replica serves (and has found both workers) before the burst.
            for address in addresses:
                assert await send(http, address) == 200
            watch, stop = Watch(), threading.Event()
            poller = threading.Thread(target=poll, args=(cluster.redis_url, workers, watch, stop), daemon=True)
            poller.start()
            try:
                statuses = await asyncio.gather(*(send(http, addresses[i % ROUTERS]) for i in range(BURST)))
            finally:
                stop.set()
                await asyncio.to_thread(poller.join, 10)
        assert set(statuses) <= {200, 429, 503}, statuses
        assert statuses.count(200) >= BURST // 2, statuses
        assert not watch.error and watch.polls >= 50, (watch.error, watch.polls)
        assert not watch.violations, watch.violations[:10]
        assert not watch.mismatches, watch.mismatches[:10]
        # The burst did fill the pool: bookings from all replicas reached at least half of every worker.
        assert all(watch.peak[w.worker_id] >= w.capacity // 2 for w in workers), watch.peak
        # Releases and unused credit go back in the background: nothing is left booked.
        for _ in range(200):
            left = [(await client.get(w.used_key), await client.hlen(w.book_key), await client.zcard(w.lease_key))
                    for w in workers]
            if all(int(used or 0) == 0 and n == 0 and leases == 0 for used, n, leases in left):
                break
            await asyncio.sleep(0.05)
        assert all(int(used or 0) == 0 and n == 0 and leases == 0 for used, n, leases in left), left
    finally:
        await client.aclose()
