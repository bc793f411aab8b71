"""The colocated worker as a real process: outputs, registration, bad input, cancellation.

Each test runs on both engines: the torch model, and a simulated GPU (whose tokens are pseudo-random,
so only the torch worker's are compared with the reference engine's).
"""

from __future__ import annotations

import asyncio
import signal
from pathlib import Path

import grpc
import pytest
import redis.asyncio as aioredis

from pdrouter.core.model_spec import ModelSpec
from pdrouter.core.sampling import SamplingParams
from pdrouter.core.workers import WorkerRole
from pdrouter.engine.config import EngineConfig
from pdrouter.engine.torch_engine import TorchEngine
from pdrouter.state.registry import WorkerRegistry
from pdrouter.wire.convert import sampling_to_pb
from pdrouter.wire.grpc_util import check_health
from pdrouter.wire.v1 import common_pb2, worker_pb2, worker_pb2_grpc

from .conftest import BACKENDS, SpawnWorker

PROMPTS = [[257, *b"hello world"], [257, *b"the quick brown fox jumps over the lazy dog" * 3], [257, 65]]
GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
SIM_TIME_SCALE = 10.0
"""A simulated worker's time scale here: about 17 ms a step, so a 500-token stream would run for
8 s, longer than the test waits for its blocks to come back, if cancelling it did not abort it."""


def reference(model: Path) -> list[list[int]]:
    engine = TorchEngine(EngineConfig(model_dir=model, num_blocks=256))
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


@pytest.mark.parametrize("backend", BACKENDS)
async def test_outputs_registration_and_errors(spawn_worker: SpawnWorker, redis_url: str, tiny_model: Path,
                                               backend: str) -> None:
    worker = spawn_worker("worker", redis_url=redis_url, time_scale=SIM_TIME_SCALE)
    assert await check_health(worker.address)
    async with grpc.aio.insecure_channel(worker.address) as channel:
        stub = worker_pb2_grpc.ColocatedWorkerStub(channel)
        info_stub = worker_pb2_grpc.WorkerInfoServiceStub(channel)
        start_free = (await info_stub.GetLoad(worker_pb2.GetLoadRequest())).free_blocks
        results = await asyncio.gather(*(collect(stub, f"r{i}", p) for i, p in enumerate(PROMPTS)))
        if backend == "torch":
            expected = reference(tiny_model)
            assert [tokens for tokens, _ in results] == expected
        else:  # pseudo-random tokens: the right number, in the vocabulary, the same for the same greedy prompt
            expected = [tokens for tokens, _ in results]
            assert [len(tokens) for tokens in expected] == [GREEDY.max_tokens] * len(PROMPTS)
            vocab = ModelSpec.from_pretrained_dir(tiny_model).vocab_size
            assert all(0 <= t < vocab for tokens in expected for t in tokens)
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
        with pytest.raises(grpc.aio.AioRpcError) as err:  # a packed prompt that is not whole uint32 ids
            async for _ in stub.Generate(worker_pb2.WorkerGenerateRequest(
                    request_id="torn", prompt_token_bytes=b"\x01\x01", sampling=sampling_to_pb(GREEDY))):
                pass
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "packed token ids are 4 bytes each: got 2 bytes" in (err.value.details() or "")
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
    assert live[0].record.device == ("cpu" if backend == "torch" else "sim:h100-80g")


@pytest.mark.parametrize("backend", BACKENDS)
async def test_sigterm_drains_in_flight_requests(spawn_worker: SpawnWorker) -> None:
    worker = spawn_worker("worker", time_scale=2.0)  # simulated: about 1 s for the 300 tokens
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
