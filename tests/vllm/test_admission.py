"""Admission: the router books KV up to the pool vLLM reported, never past it; the next request waits, then 429.

Each worker registered the blocks vLLM allocated (47 usable blocks of 32 tokens here). A request of
1,024 tokens (prompt and ``max_tokens``) needs 32 of them, so each worker holds one such request and
never two. Two run (one per worker); while they do, the bookings in Redis stay within each worker's
pool and vLLM's own KV usage (its scheduler's ``kv_cache_usage``, carried by the heartbeat) stays
within the bookings. A third request waits in the router's queue and is refused with 429 and
``Retry-After`` when the queue deadline passes (as with the other backends). Once the two are
cancelled, their bookings and vLLM's blocks are given back.

The requests go through a second router over the same Redis and workers, whose queue deadline is
``QUEUE_TIMEOUT_S``: the refusal has to come while both long requests still run, and with the group's
router's 2 s deadline a fresh-clone run once saw them end before it, three attempts out of three.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from pdrouter.cli.local_cluster import ManagedProcess

from .conftest import (
    MAX_LEN,
    MODEL,
    Stream,
    VllmPool,
    booked_blocks,
    listed_workers,
    live_workers,
    poll,
    registered_workers,
    run,
    wait_until,
)

PROMPT_TOKENS = 24
QUEUE_TIMEOUT_S = 0.25
"""The refusing router's queue deadline: a small part of the long requests' time (about 10 s for 1,000
tokens with both engines busy on this machine)."""


@pytest.fixture(scope="module")
def router(vllm_pool: VllmPool) -> Iterator[str]:
    """A second router over the pool's Redis (bookings shared with the pool's router), refusing after
    ``QUEUE_TIMEOUT_S`` in its queue; its HTTP base URL."""
    proc = ManagedProcess("admission-router", vllm_pool.router_argv("--queue-timeout-s", str(QUEUE_TIMEOUT_S)),
                          env=vllm_pool.env)
    try:
        proc.wait_ready()
        http = f"http://{proc.address}"
        wait_until(lambda: listed_workers(vllm_pool, http) == {"vllm-a", "vllm-b"}, "the router listing both workers")
        yield http
    finally:
        proc.stop()


def long_request() -> dict[str, Any]:
    prompt = f"{uuid.uuid4().hex} keep going"[: PROMPT_TOKENS - 1]
    return {"model": MODEL, "prompt": prompt, "max_tokens": MAX_LEN - PROMPT_TOKENS, "temperature": 0,
            "ignore_eos": True}


def vllm_usage(pool: VllmPool) -> dict[str, tuple[int, int]]:
    """Worker id → (blocks vLLM says requests hold, the pool's blocks), from the last heartbeat."""
    return {w: (int(v["load"]["allocated_blocks"]), int(v["load"]["total_blocks"]))
            for w, v in live_workers(pool).items()}


async def _scenario(pool: VllmPool, http: str) -> dict[str, Any]:
    seen: dict[str, Any] = {}
    async with httpx.AsyncClient(base_url=http, timeout=httpx.Timeout(120.0)) as client, \
            Stream(client, long_request()) as first, Stream(client, long_request()) as second:

        async def third() -> tuple[httpx.Response, list[bool], float]:
            sent = time.monotonic()
            answer = await client.post("/v1/completions", json=long_request())
            # The refusal only means something while both long requests still held their blocks.
            return answer, [s.ended.is_set() for s in (first, second)], time.monotonic() - sent

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
        answer, seen["ended_before_third"], waited = await refused
        seen["third"] = (answer.status_code, answer.headers.get("retry-after"), answer.json())
        seen["attempt"] = (f"third answered {answer.status_code} after {waited:.2f} s, "
                           f"long requests ended: {seen['ended_before_third']}")
        seen["booked_after_refusal"] = await asyncio.to_thread(booked_blocks, pool)
    return seen


ATTEMPTS = 3
"""A long request can end before the third is answered (its 1,000 tokens take a few seconds here, and
more or less as the machine's other work lets): that attempt shows nothing, so the scenario runs again.
Each attempt's third answer, the time it took and which long requests had ended go into the failure."""


def test_bookings_stay_within_vllms_pool_and_the_next_request_gets_429(vllm_pool: VllmPool, router: str) -> None:
    attempts: list[str] = []
    for _ in range(ATTEMPTS):
        seen = run(_scenario(vllm_pool, router))
        attempts.append(seen["attempt"])
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
        f"a long request ended before the third was answered, {ATTEMPTS} times: {attempts}"
    assert status == 429 and retry_after is not None, body
    assert body["error"]["type"] == "rate_limit_error"
    assert all(seen["booked_after_refusal"][w] <= capacity[w] for w in capacity)
    poll(lambda: booked_blocks(vllm_pool), lambda b: all(v == 0 for v in b.values()), "every booking released")
    poll(lambda: vllm_usage(vllm_pool), lambda u: set(u) == set(capacity) and all(held == 0 for held, _ in u.values()),
         "vLLM's blocks freed")
