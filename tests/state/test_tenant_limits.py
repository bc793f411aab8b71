"""Tenants' limits on a real Redis (and a real Redis Cluster): exact counts under races, token
budgets, output reconciliation, running requests with leases, and the time a refusal says to wait."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest
import redis.asyncio as aioredis

from pdrouter.core.tenants import TenantLimits
from pdrouter.state.client import redis_client
from pdrouter.state.keys import TenantKeys
from pdrouter.state.tenant_limits import LimitGrant, LimitRefusal, TenantLimiter


@pytest.fixture
async def client(redis_url: str) -> AsyncIterator[aioredis.Redis]:
    c = aioredis.Redis.from_url(redis_url)
    yield c
    await c.aclose()


async def _burst(limiters: list[TenantLimiter], tenant: str, limits: TenantLimits, n: int,
                 prompt: int = 1, output: int = 1) -> list[LimitGrant | LimitRefusal]:
    """``n`` acquisitions at once, spread over ``limiters`` (routers) in turn."""
    return await asyncio.gather(*(limiters[i % len(limiters)].acquire(tenant, limits, f"b-{i}", prompt, output)
                                  for i in range(n)))


async def test_requests_per_minute_is_exact_when_routers_race(redis_url: str) -> None:
    clients = [aioredis.Redis.from_url(redis_url) for _ in range(2)]
    try:
        limiters = [TenantLimiter(c) for c in clients]
        limits = TenantLimits(requests_per_minute=25)
        results = await _burst(limiters, "team-a", limits, 80)
        assert sum(isinstance(r, LimitGrant) for r in results) == 25
        refusals = [r for r in results if isinstance(r, LimitRefusal)]
        assert {r.limit for r in refusals} == {"requests_per_minute"}
        assert all(r.value == 25 and r.used == 25 for r in refusals)
        # The oldest admitted request leaves the window within a minute: that is the wait.
        assert all(50_000 < r.retry_after_ms <= 60_000 for r in refusals)
        assert all(50 < r.retry_after_s <= 60 for r in refusals)
        assert (await limiters[0].usage("team-a"))["requests"] == 25
        # Another tenant has a budget of its own.
        assert isinstance(await limiters[1].acquire("team-b", limits, "b-x", 1, 1), LimitGrant)
    finally:
        for c in clients:
            await c.aclose()


async def test_the_window_slides(client: aioredis.Redis) -> None:
    limiter = TenantLimiter(client, window_ms=400)
    limits = TenantLimits(requests_per_minute=3)
    assert all(isinstance(r, LimitGrant) for r in await _burst([limiter], "t", limits, 3))
    refused = await limiter.acquire("t", limits, "late", 1, 1)
    assert isinstance(refused, LimitRefusal) and 0 < refused.retry_after_ms <= 400
    await asyncio.sleep(refused.retry_after_ms / 1000 + 0.05)
    assert isinstance(await limiter.acquire("t", limits, "later", 1, 1), LimitGrant)
    assert (await limiter.usage("t"))["requests"] == 1  # the three left the window


async def test_prompt_tokens_never_pass_the_limit(client: aioredis.Redis) -> None:
    limiter = TenantLimiter(client)
    limits = TenantLimits(prompt_tokens_per_minute=1000)
    results = await _burst([limiter], "t", limits, 30, prompt=90)
    assert sum(isinstance(r, LimitGrant) for r in results) == 11  # 11 × 90 = 990; a 12th makes 1080
    usage = await limiter.usage("t")
    assert usage["prompt_tokens"] == 990
    small = await limiter.acquire("t", limits, "small", 10, 1)  # 10 more still fit exactly
    assert isinstance(small, LimitGrant)
    refused = await limiter.acquire("t", limits, "one-more", 1, 1)
    assert isinstance(refused, LimitRefusal) and refused.limit == "prompt_tokens_per_minute"
    assert refused.used == 1000 and 0 < refused.retry_after_ms <= 60_000
    too_big = await limiter.acquire("t", limits, "huge", 1001, 1)
    assert isinstance(too_big, LimitRefusal) and too_big.retry_after_ms == -1


async def test_output_tokens_count_max_tokens_then_what_was_generated(client: aioredis.Redis) -> None:
    limiter = TenantLimiter(client)
    limits = TenantLimits(output_tokens_per_minute=100)
    first = await limiter.acquire("t", limits, "a", 5, 60)
    assert isinstance(first, LimitGrant)
    refused = await limiter.acquire("t", limits, "b", 5, 60)  # 60 + 60 would pass 100
    assert isinstance(refused, LimitRefusal) and refused.limit == "output_tokens_per_minute"
    await limiter.settle(first, 10)  # it generated 10 of its 60
    assert (await limiter.usage("t"))["output_tokens"] == 10
    assert isinstance(await limiter.acquire("t", limits, "b", 5, 60), LimitGrant)
    assert (await limiter.usage("t"))["output_tokens"] == 70
    members = await client.zrange(TenantKeys("pdr", "t").window, 0, -1)
    assert sorted(members) == [b"a|5|10", b"b|5|60"]


async def test_max_concurrent_frees_on_settle_and_lapses_without_renewal(client: aioredis.Redis) -> None:
    limiter = TenantLimiter(client, lease_ms=300)
    limits = TenantLimits(max_concurrent=2)
    results = await _burst([limiter], "t", limits, 5)
    grants = [r for r in results if isinstance(r, LimitGrant)]
    assert len(grants) == 2
    assert {r.limit for r in results if isinstance(r, LimitRefusal)} == {"max_concurrent"}
    await limiter.settle(grants[0], 1)
    third = await limiter.acquire("t", limits, "c", 1, 1)
    assert isinstance(third, LimitGrant)
    # A router that keeps renewing keeps its places; one that stopped loses them when the lease lapses.
    for _ in range(4):
        await asyncio.sleep(0.1)
        assert await limiter.renew([third]) == 1
    assert (await limiter.usage("t"))["running"] == 1  # grants[1] lapsed, ``third`` was renewed
    assert isinstance(await limiter.acquire("t", limits, "d", 1, 1), LimitGrant)
    assert isinstance(await limiter.acquire("t", limits, "e", 1, 1), LimitRefusal)


async def test_a_renewal_in_the_millisecond_of_its_booking_still_counts_it(client: aioredis.Redis) -> None:
    limiter = TenantLimiter(client)
    grant = await limiter.acquire("t", TenantLimits(max_concurrent=2), "a", 1, 1)
    assert isinstance(grant, LimitGrant)
    # Back to back, several renewals fall in one millisecond: each finds the request running.
    assert [await limiter.renew([grant]) for _ in range(50)] == [1] * 50


async def test_limits_are_checked_together_and_nothing_is_counted_on_refusal(client: aioredis.Redis) -> None:
    limiter = TenantLimiter(client)
    limits = TenantLimits(requests_per_minute=10, prompt_tokens_per_minute=50, max_concurrent=1)
    grant = await limiter.acquire("t", limits, "a", 30, 1)
    assert isinstance(grant, LimitGrant)
    refused = await limiter.acquire("t", limits, "b", 30, 1)  # over the prompt budget
    assert isinstance(refused, LimitRefusal) and refused.limit == "prompt_tokens_per_minute"
    refused = await limiter.acquire("t", limits, "c", 10, 1)  # within it, but one is running
    assert isinstance(refused, LimitRefusal) and refused.limit == "max_concurrent"
    assert await limiter.usage("t") == {"requests": 1, "prompt_tokens": 30, "output_tokens": 1, "running": 1}


async def test_a_retried_call_is_counted_once(client: aioredis.Redis) -> None:
    """A client's retry of a call Redis ran (its reply lost) admits the booking again without
    counting it twice, even when the budget is spent by then."""
    limiter = TenantLimiter(client)
    for limits in (TenantLimits(requests_per_minute=2, prompt_tokens_per_minute=100), TenantLimits(max_concurrent=2)):
        tenant = f"t{limits.max_concurrent}"
        assert isinstance(await limiter.acquire(tenant, limits, "b-1", 10, 1), LimitGrant)
        assert isinstance(await limiter.acquire(tenant, limits, "b-2", 10, 1), LimitGrant)
        assert isinstance(await limiter.acquire(tenant, limits, "b-2", 10, 1), LimitGrant)  # the retry
        assert isinstance(await limiter.acquire(tenant, limits, "b-3", 10, 1), LimitRefusal)
        usage = await limiter.usage(tenant)
        if limits.max_concurrent:
            assert usage["running"] == 2
        else:
            assert usage["requests"] == 2 and usage["prompt_tokens"] == 20


async def test_on_a_redis_cluster(redis_cluster_url: str) -> None:
    cluster = redis_client(redis_cluster_url, max_connections=16, pool_timeout_s=5.0)
    try:
        limiter = TenantLimiter(cluster)
        # redis-py's cluster client learns the cluster on its first calls, and calls racing that
        # (a connection closed under them) fail with ConnectionError; a router's first calls are
        # its registry's, so the bursts below meet a client that knows the cluster, as they would.
        await limiter.usage("warm-up")
        limits = TenantLimits(requests_per_minute=7, output_tokens_per_minute=1000, max_concurrent=50)
        for tenant in ("team-a", "team-b", "team-c"):  # tags spread the tenants over the shards
            results = await _burst([limiter], tenant, limits, 20)
            grants = [r for r in results if isinstance(r, LimitGrant)]
            assert len(grants) == 7
            await limiter.settle(grants[0], 0)
            assert await limiter.renew(grants[1:]) == 6
    finally:
        await cluster.aclose()
