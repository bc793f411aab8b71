"""Admission test fixtures: a client of the real Redis, and a bounded poll for background effects."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable

import pytest
import redis.asyncio as aioredis


@pytest.fixture
async def client(redis_url: str) -> AsyncIterator[aioredis.Redis]:
    c = aioredis.Redis.from_url(redis_url)
    yield c
    await c.aclose()


async def until(predicate: Callable[[], Awaitable[bool]], what: str) -> None:
    """Poll ``predicate`` every 10 ms, at most 400 times (a hang guard, not a latency bound)."""
    for _ in range(400):
        if await predicate():
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"never happened: {what}")
