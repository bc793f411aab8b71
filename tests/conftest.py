"""Fixtures shared by every test package: a real Redis server on a free port."""

from __future__ import annotations

import os
import secrets
from collections.abc import Iterator

import pytest

from pdrouter.state.embedded_redis import EmbeddedRedis

_LD_PRELOAD = os.environ.get("LD_PRELOAD")
"""As the test run found it: importing vLLM's CPU platform adds torch's libgomp to ``LD_PRELOAD`` in the
importing process (for the engine processes it spawns), and every process a later test starts would
inherit it (a simulated worker, which must load no torch, among them)."""


@pytest.fixture(autouse=True)
def _ld_preload_as_found() -> Iterator[None]:
    yield
    if os.environ.get("LD_PRELOAD") != _LD_PRELOAD:
        if _LD_PRELOAD is None:
            del os.environ["LD_PRELOAD"]
        else:
            os.environ["LD_PRELOAD"] = _LD_PRELOAD

# Prefill and decode workers refuse to start without a KV secret: the ones the tests start (they
# inherit this environment) share one made for the session.
if not (os.environ.get("PDROUTER_KV_TOKEN") or os.environ.get("PDROUTER_KV_TOKEN_FILE")):
    os.environ["PDROUTER_KV_TOKEN"] = secrets.token_hex(16)


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


@pytest.fixture(scope="session")
def redis_cluster() -> Iterator[object]:
    """One real Redis Cluster for the whole session: 3 masters with a replica each on loopback
    (``pdrouter.testing.redis_cluster.EmbeddedRedisCluster``); see ``redis_cluster_url``."""
    from pdrouter.testing.redis_cluster import EmbeddedRedisCluster

    with EmbeddedRedisCluster() as cluster:
        yield cluster


@pytest.fixture
def redis_cluster_url(redis_cluster: object) -> Iterator[str]:
    """The ``redis+cluster://`` URL of the session's cluster, healthy (nodes an earlier test killed
    are back, as replicas) and empty at the start of the test."""
    from pdrouter.testing.redis_cluster import EmbeddedRedisCluster

    assert isinstance(redis_cluster, EmbeddedRedisCluster)
    redis_cluster.revive()
    redis_cluster.flush()
    yield redis_cluster.url
