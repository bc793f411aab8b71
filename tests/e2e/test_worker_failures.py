"""Workers that die or fail requests: new requests go to the live ones, clients see no internals, and a
request with no deadline of its own still ends.

Simulated workers (no sleeping unless a test needs time to pass), real Redis, a router in the test's loop.
"""

from __future__ import annotations

import asyncio
from typing import Any

import grpc
import httpx
import pytest

from pdrouter.core.workers import WorkerRole
from pdrouter.router.dispatch import DispatchConfig
from pdrouter.router.server import RouterProcess
from pdrouter.wire.v1 import common_pb2, router_pb2, router_pb2_grpc

from .conftest import Cluster
from .test_failing_request import assert_all_serving_and_nothing_left
from .test_router_e2e import wait_workers

PROMPT = "A prompt long enough to be prefilled on a prefill worker, not on the decode worker itself. "


@pytest.fixture
def backend() -> str:
    return "sim"


async def complete(http: httpx.AsyncClient, router: RouterProcess, prompt: str = PROMPT,
                   max_tokens: int = 8) -> httpx.Response:
    return await http.post(f"http://127.0.0.1:{router.http_port}/v1/completions",
                           json={"model": "tiny", "prompt": prompt, "max_tokens": max_tokens})


@pytest.mark.parametrize("concurrent", [False, True], ids=["one-by-one", "ten-at-once"])
async def test_after_a_decode_worker_is_killed_new_requests_go_to_the_live_one(cluster: Cluster,
                                                                               concurrent: bool) -> None:
    cluster.spawn("prefill", worker_id="prefill-0")
    doomed = cluster.spawn("decode", worker_id="decode-a")
    cluster.spawn("decode", worker_id="decode-b")
    router = await cluster.router(dispatch=DispatchConfig(local_prefill_tokens=0))
    await wait_workers(router, {WorkerRole.PREFILL: 1, WorkerRole.DECODE: 2})
    assert router.dispatcher is not None
    async with httpx.AsyncClient(timeout=60) as http:
        for i in range(6):  # both decode workers serve (and the router holds credit on both)
            assert (await complete(http, router, f"{PROMPT} warm-up {i}")).status_code == 200
        doomed.kill()  # kill -9: its registration and heartbeat outlive it for a while
        prompts = [f"{PROMPT} after the kill {i}" for i in range(10)]
        if concurrent:
            answers = await asyncio.gather(*(complete(http, router, p) for p in prompts))
        else:
            answers = [await complete(http, router, p) for p in prompts]
    assert [r.status_code for r in answers] == [200] * 10, [r.text for r in answers if r.status_code != 200]
    # The dead worker was tried at most until its breaker opened (each of those requests went on to the
    # live one); one by one that is the breaker's threshold.
    retries = router.dispatcher.stats.worker_retries
    print(f"{retries} of 10 requests first tried the killed worker")
    assert 1 <= retries <= (10 if concurrent else 3)


async def test_a_worker_error_reaches_the_client_in_the_routers_words(cluster: Cluster, wait_for: Any) -> None:
    """A killed prefill worker: the decode worker's error names it and its address; the client's does not."""
    prefill = cluster.spawn("prefill", worker_id="prefill-secret-name")
    cluster.spawn("decode", worker_id="decode-0")
    router = await cluster.router(dispatch=DispatchConfig(local_prefill_tokens=0))
    await wait_workers(router, {WorkerRole.PREFILL: 1, WorkerRole.DECODE: 1})
    assert prefill.address is not None
    port = prefill.address.rpartition(":")[2]
    async with httpx.AsyncClient(timeout=60) as http:
        assert (await complete(http, router)).status_code == 200
        prefill.kill()  # still registered for a moment: the router names it as the route
        failed = await complete(http, router, f"{PROMPT} after the kill")
        assert failed.status_code == 503, failed.text
        message = failed.json()["error"]["message"]
        assert "prefill" in message and "retry" in message, message
        for internal in ("prefill-secret-name", "decode-0", port, "Errno", "refused", "lane"):
            assert internal not in message, (internal, message)
        async with grpc.aio.insecure_channel(router.grpc_address) as channel:
            with pytest.raises(grpc.aio.AioRpcError) as err:
                async for _ in router_pb2_grpc.RouterStub(channel).Generate(router_pb2.GenerateRequest(
                        model="tiny", text=f"{PROMPT} over gRPC",
                        sampling=common_pb2.SamplingParams(max_tokens=4))):
                    pass
        assert err.value.code() is grpc.StatusCode.UNAVAILABLE
        assert "prefill-secret-name" not in (err.value.details() or "") and port not in (err.value.details() or "")


async def test_a_request_without_a_deadline_gets_the_default_one(cluster: Cluster, wait_for: Any) -> None:
    """A simulated step of the tiny model takes ~1.7 ms of modeled time; at time scale 4, 1,000 tokens
    take several seconds, past a 1 s default deadline: the request ends (504 / DEADLINE_EXCEEDED) and
    its blocks are freed on the worker."""
    worker = cluster.spawn("worker", time_scale=4.0)
    router = await cluster.router(mode="colocated", dispatch=DispatchConfig(mode="colocated", default_deadline_s=1.0))
    await wait_workers(router, {WorkerRole.COLOCATED: 1})
    async with grpc.aio.insecure_channel(router.grpc_address) as channel:
        loop = asyncio.get_running_loop()
        started = loop.time()
        with pytest.raises(grpc.aio.AioRpcError) as err:  # a call with no deadline of its own
            async for _ in router_pb2_grpc.RouterStub(channel).Generate(router_pb2.GenerateRequest(
                    model="tiny", text="Tell me a long story.",
                    sampling=common_pb2.SamplingParams(max_tokens=1000, ignore_eos=True))):
                pass
        assert err.value.code() is grpc.StatusCode.DEADLINE_EXCEEDED, err.value.details()
        print(f"ended after {loop.time() - started:.2f} s")
    async with httpx.AsyncClient(timeout=60) as http:  # the HTTP door: the same default
        resp = await http.post(f"http://127.0.0.1:{router.http_port}/v1/completions",
                               json={"model": "tiny", "prompt": "Tell me a long story.", "max_tokens": 1000,
                                     "ignore_eos": True})
        assert resp.status_code == 504, resp.text
        assert (await complete(http, router, "short", max_tokens=2)).status_code == 200
    await assert_all_serving_and_nothing_left(cluster, [worker], wait_for)
