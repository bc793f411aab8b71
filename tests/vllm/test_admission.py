"""Admission: the router books KV up to the pool vLLM reported, never past it; the next request waits, then 429.

Each worker registered the blocks vLLM allocated (47 usable blocks of 32 tokens here). A request of
1,024 tokens (prompt and ``max_tokens``) needs 32 of them, so each worker holds one such request and
never two. Two run (one per worker); while they do, the bookings in Redis stay within each worker's
pool and vLLM's own KV usage (its scheduler's ``kv_cache_usage``, carried by the heartbeat) stays
within the bookings. A third request waits in the router's queue and is refused with 429 and
``Retry-After`` when the queue deadline passes (as with the other backends). Once the two are
cancelled, their bookings and vLLM's blocks are given back.
"""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

import httpx

from .conftest import MAX_LEN, MODEL, Stream, VllmPool, booked_blocks, live_workers, poll, registered_workers, run

PROMPT_TOKENS = 24


def long_request() -> dict[str, Any]:
    prompt = f"{uuid.uuid4().hex} keep going"[: PROMPT_TOKENS - 1]
    return {"model": MODEL, "prompt": prompt, "max_tokens": MAX_LEN - PROMPT_TOKENS, "temperature": 0,
            "ignore_eos": True}


def vllm_usage(pool: VllmPool) -> dict[str, tuple[int, int]]:
    """Worker id → (blocks vLLM says requests hold, the pool's blocks), from the last heartbeat."""
    return {w: (int(v["load"]["allocated_blocks"]), int(v["load"]["total_blocks"]))
            for w, v in live_workers(pool).items()}


async def _scenario(pool: VllmPool) -> dict[str, Any]:
    seen: dict[str, Any] = {}
    async with httpx.AsyncClient(base_url=pool.http, timeout=httpx.Timeout(120.0)) as client, \
            Stream(client, long_request()) as first, Stream(client, long_request()) as second:

        async def third() -> tuple[httpx.Response, list[bool]]:
            answer = await client.post("/v1/completions", json=long_request())
            # The refusal only means something while both long requests still held their blocks.
            return answer, [s.ended.is_set() for s in (first, second)]

        # Sent at once, while the long requests have most of their tokens ahead of them: the readings
        # below can take seconds on a loaded machine, and the refusal needs both requests running.
        refused = asyncio.create_task(third())
        # The pool each worker registered (its record, which a late heartbeat does not hide).
        capacity = {w: int(record["capacity_blocks"]) for w, record in registered_workers(pool).items()}
        seen["capacity"] = capacity
        seen["booked"] = await asyncio.to_thread(booked_blocks, pool)
        seen["usage"] = await asyncio.to_thread(
            poll, lambda: vllm_usage(pool),
            lambda u: set(u) == set(capacity) and all(held > 0 for held, _ in u.values()),
            "vLLM reporting both requests' blocks")
        answer, seen["ended_before_third"] = await refused
        seen["third"] = (answer.status_code, answer.headers.get("retry-after"), answer.json())
        seen["booked_after_refusal"] = await asyncio.to_thread(booked_blocks, pool)
    return seen


ATTEMPTS = 3
"""A long request can end before the third is answered (its 1,000 tokens take a few seconds here, and
more or less as the machine's other work lets): that attempt shows nothing, so the scenario runs again."""


def test_bookings_stay_within_vllms_pool_and_the_next_request_gets_429(vllm_pool: VllmPool) -> None:
    for _ in range(ATTEMPTS):
        seen = run(_scenario(vllm_pool))
        if seen["ended_before_third"] == [False, False]:
            break
        poll(lambda: booked_blocks(vllm_pool), lambda b: all(v == 0 for v in b.values()), "every booking released")
    capacity, booked, usage = seen["capacity"], seen["booked"], seen["usage"]
    assert set(capacity) == set(booked) == {"vllm-a", "vllm-b"}
    for worker, pool_blocks in capacity.items():
        assert booked[worker] <= pool_blocks, (worker, booked, capacity)
        assert booked[worker] >= MAX_LEN // 32  # one long request on each worker
        held, total = usage[worker]
        assert total == pool_blocks and 0 < held <= booked[worker], (worker, usage, booked)
    status, retry_after, body = seen["third"]
    assert seen["ended_before_third"] == [False, False], \
        f"a long request ended before the third was answered, {ATTEMPTS} times"
    assert status == 429 and retry_after is not None, body
    assert body["error"]["type"] == "rate_limit_error"
    assert all(seen["booked_after_refusal"][w] <= capacity[w] for w in capacity)
    poll(lambda: booked_blocks(vllm_pool), lambda b: all(v == 0 for v in b.values()), "every booking released")
    poll(lambda: vllm_usage(vllm_pool), lambda u: set(u) == set(capacity) and all(held == 0 for held, _ in u.values()),
         "vLLM's blocks freed")
