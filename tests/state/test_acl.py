"""Redis users per component (``pdrouter.state.acl``) on a real Redis: each reaches its own keys and
channels only, no dangerous command, and nobody gets in without a password."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest
import redis
import redis.asyncio as aioredis

from pdrouter.core.ids import Epoch, WorkerId
from pdrouter.core.tenants import TenantLimits
from pdrouter.core.workers import WorkerLoad, WorkerRecord, WorkerRole
from pdrouter.state.acl import ROUTER_USER, WORKER_USER, acl_rules, component_users
from pdrouter.state.embedded_redis import EmbeddedRedis, find_redis_server, redis_version
from pdrouter.state.prefix_index import PrefixIndex
from pdrouter.state.registry import WorkerRegistry
from pdrouter.state.reservations import KvReservations
from pdrouter.state.tenant_limits import LimitGrant, TenantLimiter

ADMIN, ROUTER, WORKER = "a" * 32, "r" * 32, "w" * 32
NEW_REDIS = redis_version(find_redis_server()) >= (7, 0)


@pytest.fixture(scope="module")
def server() -> AsyncIterator[EmbeddedRedis]:
    users = component_users(ROUTER, WORKER, read_only_patterns=NEW_REDIS)
    with EmbeddedRedis(password=ADMIN, users=users) as running:
        yield running


def record(epoch: int) -> WorkerRecord:
    return WorkerRecord(WorkerId("decode-0"), WorkerRole.DECODE, "127.0.0.1:1", Epoch(epoch), "tiny", "m", "k", 16, 64)


async def test_each_component_reaches_its_own_keys(server: EmbeddedRedis) -> None:
    worker = aioredis.Redis.from_url(server.url_for(WORKER_USER, WORKER))
    router = aioredis.Redis.from_url(server.url_for(ROUTER_USER, ROUTER))
    try:
        registry = WorkerRegistry(worker, "tiny")
        epoch = await registry.new_epoch()
        await registry.register(record(epoch))
        await registry.heartbeat(WorkerId("decode-0"), epoch, WorkerLoad(free_blocks=64, total_blocks=64))
        await PrefixIndex(worker, "tiny").touch(WorkerId("prefill-0"), Epoch(1))
        # The router reads the registry and owns the bookings.
        [live] = await WorkerRegistry(router, "tiny").live_workers()
        assert live.record.worker_id == "decode-0"
        bookings = KvReservations(router, "tiny")
        assert await bookings.bookings(WorkerId("decode-0"), epoch) == {}
        await router.publish("pdr:{tiny}:credit-wanted", "x")
        # The router owns the tenants' limits (the whole acquire / settle / renew cycle).
        limits = TenantLimits(requests_per_minute=5, max_concurrent=2)
        grant = await TenantLimiter(router).acquire("team-a", limits, "b-1", 10, 4)
        assert isinstance(grant, LimitGrant)
        assert await TenantLimiter(router).renew([grant]) == 1
        await TenantLimiter(router).settle(grant, 2)
        # A worker reaches no booking, no tenant's limits, no channel, and no dangerous command.
        with pytest.raises(redis.exceptions.NoPermissionError):
            await TenantLimiter(worker).acquire("team-a", limits, "b-2", 10, 4)
        with pytest.raises(redis.exceptions.NoPermissionError):
            await KvReservations(worker, "tiny").bookings(WorkerId("decode-0"), epoch)
        with pytest.raises(redis.exceptions.NoPermissionError):
            await worker.publish("pdr:{tiny}:credit-wanted", "x")
        for command in (("FLUSHALL",), ("KEYS", "*"), ("CONFIG", "GET", "requirepass"), ("ACL", "LIST")):
            for client in (worker, router):
                with pytest.raises(redis.exceptions.NoPermissionError):
                    await client.execute_command(*command)
        if NEW_REDIS:  # read-only key patterns: the router cannot write the registry
            with pytest.raises(redis.exceptions.NoPermissionError):
                await WorkerRegistry(router, "tiny").register(record(epoch + 1))
    finally:
        await worker.aclose()
        await router.aclose()


async def test_nobody_gets_in_without_a_password(server: EmbeddedRedis) -> None:
    for url in (server.url, server.url_for(WORKER_USER, "wrong-" + "x" * 26), server.url_for(None, "y" * 32)):
        client = aioredis.Redis.from_url(url)
        with pytest.raises((redis.exceptions.AuthenticationError, redis.exceptions.ResponseError)):
            await client.ping()
        await client.aclose()
    admin = aioredis.Redis.from_url(server.url_for(None, ADMIN))
    assert await admin.ping()
    await admin.aclose()


def test_the_rules_name_only_the_layouts_keys() -> None:
    router, worker = acl_rules(ROUTER_USER), acl_rules(WORKER_USER)
    assert "%R~pdr:{*}:workers" in router and "~pdr:{*}:kv:*" in router and "&pdr:{*}:credit-wanted" in router
    assert "kv" not in worker and "&" not in worker and "~pdr:{*}:epoch" in worker
    assert "~pdr:tenant:*" in router and "tenant" not in worker
    assert all(rules.endswith("+@all -@dangerous") for rules in (router, worker))
    assert "%R~" not in acl_rules(ROUTER_USER, read_only_patterns=False)
    with pytest.raises(ValueError):
        acl_rules("default")
    with pytest.raises(Exception, match="password"):
        EmbeddedRedis(users=component_users(ROUTER, WORKER))
