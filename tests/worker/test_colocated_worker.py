"""The colocated worker as a real process: outputs, registration, bad input, cancellation."""

from __future__ import annotations

import asyncio
import signal
from pathlib import Path

import grpc
import pytest
import redis.asyncio as aioredis

from pdrouter.core.sampling import SamplingParams
from pdrouter.core.workers import WorkerRole
from pdrouter.engine.config import EngineConfig
from pdrouter.engine.engine import Engine
from pdrouter.state.registry import WorkerRegistry
from pdrouter.wire.convert import sampling_to_pb
from pdrouter.wire.grpc_util import check_health
from pdrouter.wire.v1 import common_pb2, worker_pb2, worker_pb2_grpc

from .conftest import SpawnWorker

PROMPTS = [[257, *b"hello world"], [257, *b"the quick brown fox jumps over the lazy dog" * 3], [257, 65]]
GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


def reference(model: Path) -> list[list[int]]:
    engine = Engine(EngineConfig(model_dir=model, num_blocks=256))
    return engine.generate(PROMPTS, GREEDY)


async def collect(stub: worker_pb2_grpc.ColocatedWorkerStub, request_id: str, prompt: list[int],
                  params: SamplingParams = GREEDY) -> tuple[list[int], common_pb2.TokenChunk]:
    tokens: list[int] = []
    last = None
    async for chunk in stub.Generate(worker_pb2.WorkerGenerateRequest(
            request_id=request_id, prompt_token_ids=prompt, sampling=sampling_to_pb(params))):
        tokens.extend(chunk.token_ids)
        last = chunk
    assert last is not None
    return tokens, last


async def test_outputs_registration_and_errors(spawn_worker: SpawnWorker, redis_url: str, tiny_model: Path) -> None:
    worker = spawn_worker("worker", redis_url=redis_url)
    expected = reference(tiny_model)
    assert await check_health(worker.address)
    async with grpc.aio.insecure_channel(worker.address) as channel:
        stub = worker_pb2_grpc.ColocatedWorkerStub(channel)
        info_stub = worker_pb2_grpc.WorkerInfoServiceStub(channel)
        start_free = (await info_stub.GetLoad(worker_pb2.GetLoadRequest())).free_blocks
        results = await asyncio.gather(*(collect(stub, f"r{i}", p) for i, p in enumerate(PROMPTS)))
        assert [tokens for tokens, _ in results] == expected
        last = results[1][1]
        assert last.finish_reason == common_pb2.FINISH_REASON_LENGTH
        assert (last.usage.prompt_tokens, last.usage.completion_tokens) == (len(PROMPTS[1]), 12)

        info = await info_stub.GetInfo(worker_pb2.GetInfoRequest())
        assert info.role == common_pb2.WORKER_ROLE_COLOCATED and info.model.name == "tiny"
        assert info.capacity_blocks == 256 and info.kv_layout.block_size == 16

        # Bad requests: a clear status, and the worker keeps serving.
        bad = [
            ([], GREEDY, "empty"),
            ([257, 100_000], GREEDY, "vocab"),
            ([257] * 1020, GREEDY, "context"),
        ]
        for prompt, params, needle in bad:
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await collect(stub, f"bad-{needle}", prompt, params)
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, err.value.details()
        with pytest.raises(grpc.aio.AioRpcError) as err:
            async for _ in stub.Generate(worker_pb2.WorkerGenerateRequest(request_id="x", prompt_token_ids=[1],
                                                                          sampling=common_pb2.SamplingParams())):
                pass
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "max_tokens" in (err.value.details() or "")
        again, _ = await collect(stub, "again", PROMPTS[0])
        assert again == expected[0]

        # Cancel mid-stream: the engine request is aborted and every block comes back.
        call = stub.Generate(worker_pb2.WorkerGenerateRequest(
            request_id="cancel-me", prompt_token_ids=PROMPTS[1],
            sampling=sampling_to_pb(SamplingParams(max_tokens=500, temperature=0.0, ignore_eos=True))))
        async for chunk in call:
            if chunk.token_ids:
                break
        call.cancel()
        for _ in range(100):
            load = await info_stub.GetLoad(worker_pb2.GetLoadRequest())
            if load.running == 0 and load.free_blocks == start_free:
                break
            await asyncio.sleep(0.05)
        assert (load.running, load.free_blocks) == (0, start_free)

    client = aioredis.Redis.from_url(redis_url)
    live = await WorkerRegistry(client, "tiny").live_workers()
    await client.aclose()
    assert [(w.record.role, w.record.address) for w in live] == [(WorkerRole.COLOCATED, worker.address)]


async def test_sigterm_drains_in_flight_requests(spawn_worker: SpawnWorker) -> None:
    worker = spawn_worker("worker")
    async with grpc.aio.insecure_channel(worker.address) as channel:
        stub = worker_pb2_grpc.ColocatedWorkerStub(channel)
        params = SamplingParams(max_tokens=300, temperature=0.0, ignore_eos=True)
        call = stub.Generate(worker_pb2.WorkerGenerateRequest(request_id="long", prompt_token_ids=PROMPTS[0],
                                                              sampling=sampling_to_pb(params)))
        tokens: list[int] = []
        last = None
        async for chunk in call:
            if not tokens:
                worker.proc.send_signal(signal.SIGTERM)  # shut down while the request runs
            tokens.extend(chunk.token_ids)
            last = chunk
        assert len(tokens) == 300 and last is not None
        assert last.finish_reason == common_pb2.FINISH_REASON_LENGTH
    assert await asyncio.to_thread(worker.proc.wait, 30) == 0
