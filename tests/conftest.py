"""Fixtures shared by every test package: a real Redis server on a free port."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from pdrouter.state.embedded_redis import EmbeddedRedis


@pytest.fixture(scope="session")
def redis_server() -> Iterator[EmbeddedRedis]:
    """One real redis-server process for the whole test session (flush it per test if needed)."""
    with EmbeddedRedis() as server:
        yield server


@pytest.fixture
def redis_url(redis_server: EmbeddedRedis) -> Iterator[str]:
    """The URL of a real Redis whose database is empty at the start of the test."""
    import redis

    if not redis_server.running:
        redis_server.start()
    client = redis.Redis.from_url(redis_server.url)
    client.flushall()
    client.close()
    yield redis_server.url
