"""Faults with vLLM behind the router: clients that leave mid-stream, and an engine process killed outright.

* 200 clients cancel mid-stream: every booking is released, vLLM's KV usage is back at its idle level
  (a request started afterwards is the only one vLLM counts blocks for), and the prefix index holds
  only blocks vLLM still has (a prompt sent again finds in vLLM's cache exactly what the index says
  its worker holds; the small pools evicted most of them, which the index must have seen).
* ``kill -9`` of a worker's vLLM engine core process: its gRPC health turns NOT_SERVING, the client
  whose stream it was serving gets a clean error event, the router places nothing more there, and a
  restarted worker rejoins and serves.
"""

from __future__ import annotations

import asyncio
import functools
import json
import os
import random
import signal
import uuid
from typing import Any

import grpc
import httpx
import psutil
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pdrouter.core.hashing import BlockHasher

from .conftest import (
    BLOCK,
    MODEL,
    START_S,
    Stream,
    VllmPool,
    booked_blocks,
    completion,
    idle_and_counted,
    index_depths,
    live_workers,
    poll,
    prompt_ids,
    run,
    stop_group,
)

CANCELS = 200
CONCURRENCY = 8
PROMPT_BLOCKS = 3


def cancel_prompt() -> str:
    """A prompt of ``PROMPT_BLOCKS`` whole blocks and a few tokens, unique."""
    return (f"{uuid.uuid4().hex} a client that will not wait for the answer " * 3)[: PROMPT_BLOCKS * BLOCK + 3]


async def _cancel_mid_stream(client: httpx.AsyncClient, prompt: str) -> None:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 200, "temperature": 0, "ignore_eos": True,
            "stream": True}
    async with client.stream("POST", "/v1/completions", json=body) as resp:
        assert resp.status_code == 200, await resp.aread()
        async for line in resp.aiter_lines():
            if line.startswith("data: {"):
                return  # leaving the block closes the connection mid-stream


async def _cancels(pool: VllmPool, prompts: list[str]) -> None:
    limits = httpx.Limits(max_keepalive_connections=0)
    async with httpx.AsyncClient(base_url=pool.http, timeout=120.0, limits=limits) as client:
        queue = list(prompts)

        async def one_client() -> None:
            while queue:
                await _cancel_mid_stream(client, queue.pop())

        await asyncio.gather(*(one_client() for _ in range(CONCURRENCY)))


async def settled(read: Any) -> Any:
    """``read()``'s value once two reads 0.3 s apart agree: the previous request may have evicted blocks
    whose removal events are still on their way to the index."""
    last = await read()
    for _ in range(20):
        await asyncio.sleep(0.3)
        now = await read()
        if now == last:
            return now
        last = now
    return last


def test_clients_cancelling_mid_stream_leave_nothing_behind(vllm_pool: VllmPool) -> None:
    prompts = [cancel_prompt() for _ in range(CANCELS)]
    run(_cancels(vllm_pool, prompts))
    poll(lambda: booked_blocks(vllm_pool), lambda b: len(b) == 2 and all(v == 0 for v in b.values()),
         "every booking released")
    # vLLM's own KV usage with one request running: that request's blocks and nothing else.
    run(_one_request_counted_alone(vllm_pool))
    # The index holds what vLLM holds: a prompt sent again finds exactly the indexed blocks in vLLM's cache.
    # Placement weighs the workers' loads and bookings, so a prefix decides only between idle workers: each
    # probe starts once the previous one is gone from the router's view (``idle_and_counted``).
    queries = idle_and_counted(vllm_pool, -1)
    hasher = BlockHasher(BLOCK, 0)
    for prompt in random.Random(7).sample(prompts, 6):
        hashes = hasher.hash_blocks(prompt_ids(prompt))
        depths = run(settled(functools.partial(index_depths, vllm_pool, hashes)))
        status, body = completion(vllm_pool, prompt, max_tokens=1, temperature=0)
        assert status == 200, body
        cached = body["usage"]["prompt_tokens_details"]["cached_tokens"]
        assert cached in {blocks * BLOCK for blocks in depths.values()} | {0}, (depths, cached)
        if max(depths.values()) * BLOCK >= 2 * BLOCK:  # worth placing by: the router sent it to the holder
            assert cached == max(depths.values()) * BLOCK, (depths, cached, booked_blocks(vllm_pool),
                                                             {w: v["load"] for w, v in live_workers(vllm_pool).items()})
        queries = idle_and_counted(vllm_pool, queries)


async def _one_request_counted_alone(pool: VllmPool) -> None:
    prompt_tokens = BLOCK + 1
    max_tokens = 900  # long enough to outlast a heartbeat (a second apart) on a busy machine
    body = {"model": MODEL, "prompt": "x" * (prompt_tokens - 1), "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True}

    def running() -> dict[str, Any]:
        return {w: v["load"] for w, v in live_workers(pool).items()}

    async with httpx.AsyncClient(base_url=pool.http, timeout=120.0) as client, Stream(client, body):
        loads = await asyncio.to_thread(poll, running, lambda r: sum(v["running"] for v in r.values()) == 1,
                                        "vLLM reporting the one request")
    busy = next(v for v in loads.values() if v["running"] == 1)
    most = -(-(prompt_tokens + max_tokens) // BLOCK)  # the request's blocks at its longest
    assert 1 <= busy["allocated_blocks"] <= most, loads
    assert all(v["allocated_blocks"] == 0 for v in loads.values() if v is not busy), loads


async def _health(address: str) -> int:
    async with grpc.aio.insecure_channel(address) as channel:
        reply = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
    return int(reply.status)


def engine_core_of(worker_pid: int) -> psutil.Process:
    """The vLLM engine core process among a worker's descendants (vLLM names it ``VLLM::EngineCore``)."""
    found = [p for p in psutil.Process(worker_pid).children(recursive=True)
             if "EngineCore" in p.name() or any("EngineCore" in part for part in p.cmdline())]
    assert len(found) == 1, [(p.pid, p.name(), p.cmdline()) for p in found]
    return found[0]


async def _killed_mid_stream(pool: VllmPool) -> tuple[str, list[str]]:
    """A long stream; kill -9 the engine core of the worker serving it; the events that followed.

    The serving worker shows in the heartbeats, seconds apart: a stream that a busy machine let end
    before one showed it running is started again."""
    async with httpx.AsyncClient(base_url=pool.http, timeout=120.0) as client:
        for _ in range(5):
            body = {"model": MODEL, "prompt": f"{uuid.uuid4().hex} a long answer, please", "max_tokens": 900,
                    "temperature": 0, "ignore_eos": True}
            async with Stream(client, body) as stream:
                loads = await asyncio.to_thread(
                    poll, lambda: live_workers(pool),
                    lambda r: stream.ended.is_set() or sum(v["load"]["running"] for v in r.values()) == 1,
                    "one running")
                if stream.ended.is_set():
                    continue
                victim = next(w for w, v in loads.items() if v["load"]["running"] == 1)
                before = len(stream.events)
                os.kill(engine_core_of(pool.workers[victim].proc.pid).pid, signal.SIGKILL)
                await asyncio.wait_for(stream.ended.wait(), 120)
            return victim, stream.events[before:]
    raise AssertionError("every stream ended before a heartbeat showed it running")


def test_a_killed_engine_core_makes_the_worker_unhealthy_and_a_restart_rejoins(vllm_pool: VllmPool) -> None:
    victim, events = run(_killed_mid_stream(vllm_pool))
    errors = [json.loads(e) for e in events if e.startswith("{") and '"error"' in e]
    assert len(errors) == 1, events[-5:]  # a clean error event ends the stream
    assert errors[0]["error"]["code"] == "unavailable", errors  # retryable, in the router's words
    assert "Traceback" not in errors[0]["error"]["message"]
    address = vllm_pool.worker_address(victim)
    poll(lambda: run(_health(address)), lambda s: s == health_pb2.HealthCheckResponse.NOT_SERVING,
         "the worker's health NOT_SERVING")
    poll(lambda: live_workers(vllm_pool)[victim]["load"], lambda load: load["engine_failed"],
         "its heartbeat saying engine_failed")
    # The router reads the flag at its next refresh of the pool (every second); from then on it places
    # nothing there: every request is served, by the other worker.
    poll(lambda: completion(vllm_pool, f"after the failure {uuid.uuid4().hex}", max_tokens=2)[0],
         lambda status: status == 200, "a request served after the failure")
    for i in range(6):
        status, body = completion(vllm_pool, f"after the failure {i} {uuid.uuid4().hex}", max_tokens=2)
        assert status == 200, body
    old_epoch = live_workers(vllm_pool)[victim]["record"]["epoch"]
    assert stop_group(vllm_pool.workers[victim]) == 0  # a failed engine still lets the worker stop cleanly
    vllm_pool.start_worker(victim).wait_ready(START_S)
    poll(lambda: live_workers(vllm_pool).get(victim), lambda v: v is not None and v["record"]["epoch"] != old_epoch
         and not v["load"]["engine_failed"], "the restarted worker registered")
    poll(lambda: run(_health(vllm_pool.worker_address(victim))),
         lambda s: s == health_pb2.HealthCheckResponse.SERVING, "the restarted worker SERVING")
    # The router lists the new incarnation at its next refresh of the pool: until then the second
    # request finds no room (429), after it each worker computes one.
    poll(lambda: run(_both_workers_serve(vllm_pool)), bool, "a request computed on each worker", timeout=120)


async def _both_workers_serve(pool: VllmPool) -> bool:
    """Two requests that each take most of a worker's pool, the second started while the first still
    holds its own: each worker computes one (True). False: the second found no room (429: the router
    does not list the restarted worker yet), or the first had ended by then (nothing shown: again).

    Which worker computed a request shows in its heartbeat's prefix-cache queries (vLLM counts every
    prompt it schedules), a counter: no need to catch both running in the same heartbeat, which a
    busy machine can make the two requests miss."""
    def queries() -> dict[str, int]:
        return {w: int(v["load"]["prefix_cache_queries"]) for w, v in live_workers(pool).items()}

    before = await asyncio.to_thread(queries)
    assert len(before) == 2, before
    body = {"model": MODEL, "max_tokens": 900, "temperature": 0, "ignore_eos": True}
    async with httpx.AsyncClient(base_url=pool.http, timeout=120.0) as client, \
            Stream(client, {**body, "prompt": f"{uuid.uuid4().hex} go"}) as first, \
            Stream(client, {**body, "prompt": f"{uuid.uuid4().hex} go"}, check=False) as second:
        if second.status == 429:
            return False
        held = not first.ended.is_set()  # the second started (its first token) while the first held its pool
        errors = [e for e in (*first.events, *second.events) if '"error"' in e]
        assert not errors, errors
    if not held:
        return False
    await asyncio.to_thread(poll, queries, lambda now: all(now.get(w, 0) > n for w, n in before.items()),
                            "each worker's heartbeat counting one prompt")
    return True
