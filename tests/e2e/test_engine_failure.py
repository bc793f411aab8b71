"""A worker whose engine fails: it says so at once, the router routes around it, and a restart rejoins.

The fault is injected (``PDROUTER_ENGINE_FAULT``, ``pdrouter.engine.faults``): a model step whose
work holds token ``FAULT_TOKEN`` raises, as a device fault would. The workers are simulated (their
tokens are printable bytes, so no output ever holds the token); a prompt of token ids holding it
fires the fault at the moment the test chooses.
"""

from __future__ import annotations

import asyncio
import time

import grpc
import httpx
import pytest
import redis.asyncio as aioredis
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pdrouter.cli.local_cluster import ManagedProcess
from pdrouter.core.workers import WorkerRole
from pdrouter.engine.faults import ENGINE_FAULT_ENV
from pdrouter.router.dispatch import DispatchConfig
from pdrouter.router.server import RouterProcess
from pdrouter.state.registry import WorkerRegistry

from .conftest import Cluster

FAULT_TOKEN = 400
"""A reserved id of the byte-level vocabulary: never produced by a text prompt or a simulated worker."""
FAULT_ENV = {ENGINE_FAULT_ENV: f"step-raises:{FAULT_TOKEN}"}
ROLES = {"worker": WorkerRole.COLOCATED, "decode": WorkerRole.DECODE, "prefill": WorkerRole.PREFILL}


async def health(address: str) -> int:
    """The worker's ``grpc.health.v1`` status for the whole server (open to probes, no secret)."""
    async with grpc.aio.insecure_channel(address) as channel:
        reply = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
    return int(reply.status)


async def complete(http: httpx.AsyncClient, router: RouterProcess, prompt: list[int] | str) -> httpx.Response:
    return await http.post(f"http://127.0.0.1:{router.http_port}/v1/completions",
                           json={"model": "tiny", "prompt": prompt, "max_tokens": 4, "temperature": 0})


async def placeable(router: RouterProcess, role: WorkerRole) -> list[str]:
    assert router.pool is not None
    return sorted(h.worker_id for h in router.pool.available(role))


@pytest.mark.parametrize("backend", ["sim"])
@pytest.mark.parametrize("role", ["worker", "decode", "prefill"])
async def test_a_failed_engine_turns_not_serving_the_router_routes_around_it_and_a_restart_rejoins(
        cluster: Cluster, wait_for, role: str) -> None:
    kind = ROLES[role]
    mode = "colocated" if role == "worker" else "disaggregated"
    partner = {"decode": "prefill", "prefill": "decode"}.get(role)
    if partner is not None:
        cluster.spawn(partner, worker_id=f"{partner}-0")
    bad = cluster.spawn(role, worker_id=f"{role}-bad", env=FAULT_ENV)
    # A prefill worker computes only prompts longer than what a decode worker computes itself.
    router = await cluster.router(mode=mode, dispatch=DispatchConfig(
        mode=mode, local_prefill_tokens=0 if role == "prefill" else 32))  # type: ignore[arg-type]
    await wait_for(lambda: _eq(placeable(router, kind), [f"{role}-bad"]), timeout=30)
    assert bad.address is not None and await health(bad.address) == health_pb2.HealthCheckResponse.SERVING
    client = aioredis.Redis.from_url(cluster.redis_url)
    registry = WorkerRegistry(client, "tiny")
    async with httpx.AsyncClient(timeout=60) as http:
        assert (await complete(http, router, "served before the fault")).status_code == 200
        started = time.monotonic()
        failed = await complete(http, router, [FAULT_TOKEN, *range(65, 65 + 20)])
        status = await health(bad.address)
        not_serving_after = time.monotonic() - started
        # The request fails (503: retryable, in words without internals)...
        assert failed.status_code == 503, failed.text
        message = failed.json()["error"]["message"]
        assert "InjectedFault" not in message and ENGINE_FAULT_ENV not in message, message
        # ...and by the time the caller has that answer, the worker's health already says NOT_SERVING.
        assert status == health_pb2.HealthCheckResponse.NOT_SERVING
        print(f"NOT_SERVING {not_serving_after * 1e3:.0f} ms after the trigger was sent")

        async def flagged() -> bool:
            live = {w.record.worker_id: w.load for w in await registry.live_workers()}
            return live[f"{role}-bad"].engine_failed

        await wait_for(flagged, timeout=10)  # its heartbeat says so
        await wait_for(lambda: _eq(placeable(router, kind), []), timeout=10)
        # A healthy worker joins: every request goes there, none to the failed one.
        good = cluster.spawn(role, worker_id=f"{role}-good")
        await wait_for(lambda: _eq(placeable(router, kind), [f"{role}-good"]), timeout=30)
        assert router.pool is not None and router.pool.get(f"{role}-bad") is not None  # type: ignore[arg-type]
        for i in range(8):
            resp = await complete(http, router, f"request {i} after the failure, long enough to be prefilled apart")
            assert resp.status_code == 200, resp.text
        assert await flagged()  # still says so: nothing brought the engine back but a restart
        assert await health(bad.address) == health_pb2.HealthCheckResponse.NOT_SERVING
        # A restart (what Kubernetes does when the liveness probe fails) rejoins as a new incarnation...
        bad.stop()
        restarted = cluster.spawn(role, worker_id=f"{role}-bad")
        await wait_for(lambda: _eq(placeable(router, kind), [f"{role}-bad", f"{role}-good"]), timeout=30)
        # ...and serves: with the good worker gone, requests go to it.
        good.stop()
        await wait_for(lambda: _eq(placeable(router, kind), [f"{role}-bad"]), timeout=30)
        for i in range(3):
            resp = await complete(http, router, f"request {i} after the restart, long enough to be prefilled apart")
            assert resp.status_code == 200, resp.text
        assert restarted.alive and await flagged() is False
    await client.aclose()


async def _eq(value: object, expected: object) -> bool:
    if asyncio.iscoroutine(value):
        value = await value
    return value == expected


def test_the_fault_setting_is_checked() -> None:
    """A malformed ``PDROUTER_ENGINE_FAULT`` stops the worker with one line naming the variable."""
    proc = ManagedProcess("bad-fault", ["worker", "--model-preset", "tiny", "--backend", "sim"],
                          env={ENGINE_FAULT_ENV: "explode"})
    assert proc.proc.wait(60) == 2
    proc.stop()
    out = "\n".join(proc.tail)
    assert ENGINE_FAULT_ENV in out and "Traceback" not in out, out
