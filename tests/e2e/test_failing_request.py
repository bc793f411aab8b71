"""A failing request fails alone: no sampling value, logit or KV block a caller sends stops a worker's engine.

Real worker processes (the torch engine on the CPU, or simulated GPUs where no real values are
needed), real Redis, a router in the test's loop. Each test ends with the workers serving and
nothing left booked or allocated.
"""

from __future__ import annotations

import asyncio
import dataclasses
import math
import os
import time
from typing import Any

import grpc
import httpx
import pytest
import redis.asyncio as aioredis
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pdrouter.cli.local_cluster import ManagedProcess
from pdrouter.core.errors import IncompatibleError
from pdrouter.core.kv_layout import KvLayout
from pdrouter.core.workers import WorkerRole
from pdrouter.engine.faults import ENGINE_FAULT_ENV
from pdrouter.router.server import RouterProcess
from pdrouter.state.keys import PoolKeys
from pdrouter.state.registry import WorkerRegistry
from pdrouter.testing.load import LoadOutcomes, classified_load
from pdrouter.transfer import KvSender, TransferConfig, new_epoch
from pdrouter.transfer.target import TransferTarget
from pdrouter.wire.grpc_util import CHANNEL_OPTIONS
from pdrouter.wire.kv_convert import target_from_pb
from pdrouter.wire.security import PeerSecurity
from pdrouter.wire.v1 import common_pb2, router_pb2, router_pb2_grpc, worker_pb2, worker_pb2_grpc

from .conftest import Cluster
from .test_router_e2e import wait_workers

PROMPT = "The quick brown fox jumps over the lazy dog, and then it runs far away. "
"""Longer than the decode worker computes itself (32 tokens): disaggregated, a prefill worker samples first."""
ROLES = {"colocated": ("worker",), "disaggregated": ("prefill", "decode")}
KINDS = {"colocated": (WorkerRole.COLOCATED,), "disaggregated": (WorkerRole.PREFILL, WorkerRole.DECODE)}


async def completion(http: httpx.AsyncClient, router: RouterProcess, **fields: Any) -> httpx.Response:
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 8, "ignore_eos": True, **fields}
    return await http.post(f"http://127.0.0.1:{router.http_port}/v1/completions", json=body)


async def serving(address: str) -> bool:
    async with grpc.aio.insecure_channel(address) as channel:
        reply = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
    return reply.status == health_pb2.HealthCheckResponse.SERVING


async def assert_all_serving_and_nothing_left(cluster: Cluster, workers: list[ManagedProcess], wait_for: Any) -> None:
    """Every worker SERVING with a working engine, and once idle no request, block or booking left."""
    for proc in workers:
        assert proc.alive and await serving(proc.address or ""), proc.name
    client = aioredis.Redis.from_url(cluster.redis_url)
    registry = WorkerRegistry(client, "tiny")
    try:
        live = await registry.live_workers()
        assert live and not any(w.load.engine_failed for w in live), live
        keys = PoolKeys("pdr", "tiny")

        async def clean() -> bool:
            """Nothing running or allocated on a worker (heartbeats), nothing booked on one (Redis)."""
            live = await registry.live_workers()
            booked = [int(await client.get(keys.kv_used(w.record.worker_id, w.record.epoch)) or 0) for w in live]
            return not any(w.load.running or w.load.allocated_blocks for w in live) and not any(booked)

        await wait_for(clean, timeout=30, interval=0.25)  # the router's unused credit goes back when idle
    finally:
        await client.aclose()


@pytest.mark.parametrize("mode", ["colocated", "disaggregated"])
async def test_a_tiny_temperature_is_greedy_and_the_worker_serves_on(cluster: Cluster, wait_for: Any,
                                                                    mode: str) -> None:
    """vLLM treats temperatures below 1e-5 as greedy; dividing the logits by one overflowed and stopped the engine."""
    workers = [cluster.spawn(role) for role in ROLES[mode]]
    router = await cluster.router(mode=mode)
    await wait_workers(router, {kind: 1 for kind in KINDS[mode]})
    async with httpx.AsyncClient(timeout=60) as http:
        greedy = await completion(http, router, temperature=0)
        assert greedy.status_code == 200, greedy.text
        for temperature in (1e-39, 5e-324, 1e-30, 9.9e-6):
            resp = await completion(http, router, temperature=temperature)
            assert resp.status_code == 200, (temperature, resp.text)
            assert resp.json()["choices"][0]["text"] == greedy.json()["choices"][0]["text"], temperature
        sampled = await completion(http, router, temperature=0.7, seed=1)
        assert sampled.status_code == 200, sampled.text
    await assert_all_serving_and_nothing_left(cluster, workers, wait_for)


HTTP_FUZZ: dict[str, list[Any]] = {
    "temperature": [0, -0.0, 1e-39, 5e-324, 1e-320, 1e-5, 100, 100.000001, 1e308, -1e-39, -1, 10**400, "1", True,
                    [], {}],
    "top_p": [1e-39, 5e-324, 0, -0.0, 1, 1.0000001, 1e308, -1, 10**400, "0.5", False],
    "top_k": [-1, 0, 1, 2**20, 2**20 + 1, 2**31, 2**63, 2**64, -2, 1.5, 1e-39, "5", True],
    "seed": [0, 2**63 - 1, 2**63, 2**64, -1, 1.5, 1e308, "7"],
    "max_tokens": [1, 0, -1, 2**31, 2**64, 1e-39, 1.0, "8"],
    "stop_token_ids": [[], [0], [511], [512], [-1], [2**32], [1e-39], ["1"], 5],
    "presence_penalty": [0, 0.0, -0.0, 1e-39, 5e-324, -2, 2, 1e308],
    "frequency_penalty": [0, 1e-39, 5e-324, 2],
}
"""Values of the sampling fields sent through the HTTP door: tiny, huge, subnormal, out of range, of the wrong type
(JSON has no NaN or infinity; the parser refuses them as constants)."""

FLOAT32_FUZZ = [0.0, -0.0, math.nan, math.inf, -math.inf, 1e-45, 1e-39, 1.17e-38, 1e-5, 9.9e-6, 0.5, 1.0, 1.0000001,
                100.0, 100.01, 3.4e38, -1e-45, -1.0]
GRPC_FUZZ: dict[str, list[Any]] = {
    "temperature": FLOAT32_FUZZ,
    "top_p": FLOAT32_FUZZ,
    "top_k": [0, 1, 2**20, 2**20 + 1, 2**32 - 1],
    "seed": [0, 2**63 - 1, 2**63, 2**64 - 1],
    "max_tokens": [1, 2**32 - 1],
    "stop_token_ids": [[0], [511], [512], [2**32 - 1]],
}
"""The same through the gRPC door and straight into a worker (a caller holding the internal secret):
``SamplingParams``' float32 and unsigned fields, NaN and infinities included."""


def sampling_msg(field: str, value: Any) -> common_pb2.SamplingParams:
    msg = common_pb2.SamplingParams(max_tokens=4)
    if field == "stop_token_ids":
        msg.stop_token_ids.extend(value)
    else:
        setattr(msg, field, value)
    return msg


async def grpc_outcome(call: Any) -> tuple[grpc.StatusCode, str]:
    try:
        async for _ in call:
            pass
    except grpc.aio.AioRpcError as exc:
        return exc.code(), exc.details() or ""
    return grpc.StatusCode.OK, ""


async def test_fuzzed_sampling_fields_never_stop_an_engine_and_others_are_served_throughout(
        cluster: Cluster, wait_for: Any) -> None:
    worker = cluster.spawn("worker")
    router = await cluster.router(mode="colocated")
    await wait_workers(router, {WorkerRole.COLOCATED: 1})
    outcomes = LoadOutcomes()
    loop = asyncio.get_running_loop()
    load = asyncio.create_task(classified_load(router.http_port, outcomes, model="tiny", prompts=[PROMPT],
                                               concurrency=2, until=loop.time() + 3600, bound_s=60.0, max_tokens=4))
    answers: list[str] = []
    try:
        async with httpx.AsyncClient(timeout=60) as http:
            for field, values in HTTP_FUZZ.items():
                for value in values:
                    resp = await completion(http, router, **{"max_tokens": 4, field: value})
                    answers.append(f"http {field}={value!r}: {resp.status_code}")
                    assert resp.status_code in (200, 400), (field, value, resp.text)
                    if resp.status_code == 400:
                        error = resp.json()["error"]
                        assert error["param"] == field or field in error["message"], (field, value, error)
        security = PeerSecurity(cluster.internal_token)
        async with grpc.aio.insecure_channel(router.grpc_address) as door, \
                security.channel(worker.address or "", CHANNEL_OPTIONS) as direct:
            router_stub = router_pb2_grpc.RouterStub(door)
            worker_stub = worker_pb2_grpc.ColocatedWorkerStub(direct)
            n = 0
            for field, values in GRPC_FUZZ.items():
                for value in values:
                    n += 1
                    sampling = sampling_msg(field, value)
                    calls = {"door": router_stub.Generate(router_pb2.GenerateRequest(
                                 model="tiny", text=PROMPT, sampling=sampling), timeout=60),
                             "worker": worker_stub.Generate(worker_pb2.WorkerGenerateRequest(
                                 request_id=f"fuzz-{n}", prompt_token_ids=list(PROMPT.encode()),
                                 sampling=sampling), timeout=60)}
                    for where, call in calls.items():
                        code, details = await grpc_outcome(call)
                        answers.append(f"grpc {where} {field}={value!r}: {code.name}")
                        assert code in (grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT), \
                            (where, field, value, code, details)
                        if code is grpc.StatusCode.INVALID_ARGUMENT:
                            assert field in details, (where, field, value, details)
    finally:
        load.cancel()
        await asyncio.gather(load, return_exceptions=True)
    refused = sum(1 for a in answers if a.endswith((": 400", "INVALID_ARGUMENT")))
    print(f"{len(answers)} fuzzed requests ({refused} refused as invalid); meanwhile {outcomes}")
    assert outcomes.ok > 0 and outcomes.failed_cleanly == 0 and outcomes.hung == 0 and not outcomes.broken, outcomes
    async with httpx.AsyncClient(timeout=60) as http:
        assert (await completion(http, router, temperature=0.8)).status_code == 200
    await assert_all_serving_and_nothing_left(cluster, [worker], wait_for)


@pytest.mark.parametrize("backend", ["sim"])
async def test_a_request_the_engine_cannot_compute_fails_alone_while_its_batch_goes_on(
        cluster: Cluster, wait_for: Any) -> None:
    """``request-fails`` stands in for non-finite logits (a simulated worker has none): that request
    ends with a 500 naming no internals, the requests beside it complete, the worker serves on."""
    worker = cluster.spawn("worker", time_scale=1.0, env={ENGINE_FAULT_ENV: "request-fails:400"})
    router = await cluster.router(mode="colocated")
    await wait_workers(router, {WorkerRole.COLOCATED: 1})
    async with httpx.AsyncClient(timeout=60) as http:
        beside = [asyncio.create_task(completion(http, router, max_tokens=64)) for _ in range(3)]
        await asyncio.sleep(0.05)  # in the batch when the failing request joins it
        started = time.monotonic()
        failed = await completion(http, router, prompt=[65, 400, 66])
        assert failed.status_code == 500, failed.text
        message = failed.json()["error"]["message"]
        assert ENGINE_FAULT_ENV not in message and "400" not in message, message
        done = await asyncio.gather(*beside)
        assert [r.status_code for r in done] == [200] * 3
        assert all(r.json()["usage"]["completion_tokens"] == 64 for r in done)
        print(f"the failing request ended after {time.monotonic() - started:.3f} s, its batch went on")
        assert (await completion(http, router)).status_code == 200
    await assert_all_serving_and_nothing_left(cluster, [worker], wait_for)


def garbage(pool: torch.Tensor, blocks: int, case: str) -> None:
    """Write ``case``'s KV into the first ``blocks`` blocks of the sender's pool."""
    head = pool[:, :, :blocks]
    gen = torch.Generator().manual_seed(len(case))
    head.copy_(torch.randn(head.shape, generator=gen))  # plausible KV...
    if case == "nan everywhere":
        head.fill_(math.nan)
    elif case == "one inf":
        head[-1, 1, blocks - 1, 0, 0, 0] = math.inf
    elif case == "one -inf":
        head[0, 0, 0, 3, 1, 2] = -math.inf
    elif case == "huge":  # finite, past what attention's arithmetic can take
        head.fill_(3e38)
    elif case == "random bits":  # NaNs, infinities and huge values among them
        words = head.contiguous().view(torch.int32)
        torch.randint(-(2**31), 2**31 - 1, words.shape, generator=gen, dtype=torch.int32, out=words)
        head.copy_(words.view(head.dtype))


GARBAGE = ["nan everywhere", "one inf", "one -inf", "huge", "random bits"]


async def test_garbage_kv_from_a_secret_holder_never_stops_a_decode_worker(cluster: Cluster, wait_for: Any) -> None:
    """A caller holding the internal and KV secrets books blocks on a decode worker, sends KV of its own
    into them and asks for the decode: KV that is not finite is refused (UNAVAILABLE) and its blocks
    cleared; KV of another geometry is refused before a byte moves. The worker serves on throughout."""
    workers = [cluster.spawn("prefill"), decode := cluster.spawn("decode")]
    router = await cluster.router()
    await wait_workers(router, {WorkerRole.PREFILL: 1, WorkerRole.DECODE: 1})
    prompt = list(PROMPT.encode())
    security = PeerSecurity(cluster.internal_token)
    async with security.channel(decode.address or "", CHANNEL_OPTIONS) as channel, \
            httpx.AsyncClient(timeout=60) as http:
        info = await worker_pb2_grpc.WorkerInfoServiceStub(channel).GetInfo(worker_pb2.GetInfoRequest())
        kv = info.kv_layout
        layout = KvLayout(num_layers=kv.num_layers, num_kv_heads=kv.num_kv_heads, head_dim=kv.head_dim,
                          block_size=kv.block_size, num_blocks=8, dtype=kv.dtype)
        blocks = -(-len(prompt) // layout.block_size)
        stub = worker_pb2_grpc.DecodeWorkerStub(channel)
        config = TransferConfig(auth_token=os.environ["PDROUTER_KV_TOKEN"], epoch=new_epoch())

        async def allocate(rid: str) -> TransferTarget:
            reply = await stub.Allocate(worker_pb2.AllocateRequest(
                request_id=rid, prompt_token_ids=prompt, max_tokens=8, model_compat_hash=info.model_compat_hash,
                lease_ms=2000, sampling=common_pb2.SamplingParams(max_tokens=8, temperature=1.0)))
            return target_from_pb(reply.target)

        pool = torch.zeros(layout.shape, dtype=torch.float32)
        with KvSender(pool, layout, config) as sender:
            for case in GARBAGE:
                rid = f"garbage-{case.replace(' ', '-')}"
                target = await allocate(rid)
                garbage(pool, blocks, case)

                def send(target: TransferTarget = target) -> None:
                    transfer = sender.open_transfer(target)
                    transfer.send_layers(list(range(blocks)))
                    transfer.finish(timeout=30)

                await asyncio.to_thread(send)
                code, details = await grpc_outcome(stub.Generate(worker_pb2.DecodeRequest(
                    request_id=rid, first_token_id=prompt[-1]), timeout=60))
                assert code is grpc.StatusCode.UNAVAILABLE and "not finite" in details, (case, code, details)
                served = await completion(http, router, temperature=1.0)  # the worker serves on
                assert served.status_code == 200, (case, served.text)
        # KV of another geometry (here: twice the head size) is refused before a byte is sent; the
        # allocation it was for lapses with its lease.
        other = dataclasses.replace(layout, head_dim=2 * layout.head_dim)
        with KvSender(torch.zeros(other.shape), other, config) as sender:
            target = await allocate("garbage-geometry")
            with pytest.raises(IncompatibleError):
                await asyncio.to_thread(sender.open_transfer, target)
        assert (await completion(http, router)).status_code == 200
    await assert_all_serving_and_nothing_left(cluster, workers, wait_for)
