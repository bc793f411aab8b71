"""Which prefill routes a decode worker calls: ``RegisteredPrefillWorkers`` against a real Redis."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator

import pytest
import redis.asyncio as aioredis

from pdrouter.core.errors import InvalidRequestError
from pdrouter.core.ids import Epoch, WorkerId
from pdrouter.core.workers import WorkerRecord, WorkerRole
from pdrouter.state.registry import WorkerRegistry
from pdrouter.wire.prefill_links import PrefillLinks
from pdrouter.wire.v1 import worker_pb2
from pdrouter.worker.roles.prefill_routes import RegisteredPrefillWorkers

PREFILL = WorkerRecord(worker_id=WorkerId("prefill-0"), role=WorkerRole.PREFILL, address="10.0.0.1:7000",
                       epoch=Epoch(1), model="tiny", model_compat_hash="m", kv_compat_hash="k", block_size=16,
                       capacity_blocks=100, lane_address="10.0.0.1:7001")


def route(worker_id: str = "prefill-0", address: str = "10.0.0.1:7000",
          lane: str = "10.0.0.1:7001") -> worker_pb2.PrefillRoute:
    return worker_pb2.PrefillRoute(worker_id=worker_id, address=address, lane_address=lane)


@pytest.fixture
async def registry(redis_url: str) -> AsyncIterator[WorkerRegistry]:
    client = aioredis.Redis.from_url(redis_url)
    registry = WorkerRegistry(client, pool="tiny")
    await registry.register(PREFILL)
    yield registry
    await client.aclose()


class CountingRegistry(WorkerRegistry):
    """The real registry, counting its reads of the records."""

    reads = 0

    async def records(self) -> list[WorkerRecord]:
        self.reads += 1
        return await super().records()


async def test_a_registered_prefill_worker_at_its_addresses_passes(registry: WorkerRegistry) -> None:
    check = RegisteredPrefillWorkers(registry)
    assert await check.refusal(route()) is None
    assert await check.refusal(route(lane="")) is None  # over gRPC only
    assert await check.refusal(route(address="")) is None  # over the lane only


async def test_unregistered_ids_other_addresses_and_other_roles_are_refused(registry: WorkerRegistry) -> None:
    await registry.register(dataclasses.replace(PREFILL, worker_id=WorkerId("decode-0"), role=WorkerRole.DECODE,
                                                address="10.0.0.2:7000", lane_address=""))
    check = RegisteredPrefillWorkers(registry, min_refresh_s=0.0)
    message = await check.refusal(route("intruder", "10.9.9.9:1", ""))
    assert message is not None and "'intruder' is not a prefill worker registered in pool 'tiny'" in message
    message = await check.refusal(route(address="10.9.9.9:1"))
    assert message is not None and "registered address '10.0.0.1:7000'" in message and "10.9.9.9:1" in message
    assert await check.refusal(route(lane="10.9.9.9:1")) is not None
    assert await check.refusal(route("decode-0", "10.0.0.2:7000", "")) is not None


async def test_known_routes_cost_no_read_and_unknown_ones_wait_for_a_fresh_one(redis_url: str) -> None:
    client = aioredis.Redis.from_url(redis_url)
    registry = CountingRegistry(client, pool="tiny")
    await registry.register(PREFILL)
    check = RegisteredPrefillWorkers(registry, min_refresh_s=0.3, max_age_s=1.0)
    assert await check.refusal(route()) is None and registry.reads == 1
    for _ in range(20):
        assert await check.refusal(route()) is None
    assert registry.reads == 1
    # Twenty concurrent checks of an unknown route: one read, shared, at least min_refresh_s after the last.
    assert all(await asyncio.gather(*(check.refusal(route("late", "10.0.0.3:7000", "")) for _ in range(20))))
    assert registry.reads == 2
    # A worker that registered a moment ago is found: the check waits for a read begun after it asked.
    await registry.register(dataclasses.replace(PREFILL, worker_id=WorkerId("late"), address="10.0.0.3:7000",
                                                lane_address=""))
    assert await check.refusal(route("late", "10.0.0.3:7000", "")) is None and registry.reads == 3
    # A worker that left still passes on the old view; a view older than max_age_s is read again
    # in the background, after which it is refused.
    await registry.deregister(PREFILL.worker_id, PREFILL.epoch)
    assert await check.refusal(route()) is None and registry.reads == 3
    await asyncio.sleep(1.05)
    assert await check.refusal(route()) is None  # passes on the old view, starts a read
    for _ in range(50):
        if registry.reads == 4:
            break
        await asyncio.sleep(0.02)
    assert registry.reads == 4 and await check.refusal(route()) is not None
    await client.aclose()


async def test_without_redis_known_routes_pass_and_others_are_refused(redis_url: str) -> None:
    client = aioredis.Redis.from_url(redis_url)
    registry = WorkerRegistry(client, pool="tiny")
    await registry.register(PREFILL)
    check = RegisteredPrefillWorkers(registry, min_refresh_s=0.0)
    assert await check.refusal(route()) is None
    await client.aclose()
    dead = aioredis.Redis(host="127.0.0.1", port=1, socket_connect_timeout=0.5)  # nothing listens on port 1
    check.registry = WorkerRegistry(dead, pool="tiny")
    assert await check.refusal(route()) is None
    message = await check.refusal(route("other", "10.0.0.5:7000", ""))
    assert message is not None and "cannot check prefill worker 'other' against the registry" in message
    await dead.aclose()


def test_a_route_without_an_address_is_the_callers_error() -> None:
    assert PrefillLinks.key(route(lane="")) == ("grpc", "10.0.0.1:7000")
    assert PrefillLinks.key(route()) == ("lane", "10.0.0.1:7001")
    with pytest.raises(InvalidRequestError, match="names neither an address nor a lane"):
        PrefillLinks.key(route(address="", lane=""))
