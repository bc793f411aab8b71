"""Prefill and decode workers as real processes with real Redis and a real KV transport.

A small client drives them the way the router does (Allocate → Prefill → Generate), so the
workers are tested on their own contract: outputs equal the colocated worker's, every stage can
be cancelled without leaking blocks, a killed prefill worker strands nothing, restarts fence old
state, and bad requests get the right status while the worker keeps serving.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
import redis.asyncio as aioredis

from pdrouter.cli.local_cluster import ManagedProcess
from pdrouter.core.hashing import hash_blocks
from pdrouter.core.ids import Epoch, WorkerId
from pdrouter.core.sampling import SamplingParams
from pdrouter.core.tokens import pack_token_ids
from pdrouter.engine.config import EngineConfig
from pdrouter.engine.torch_engine import TorchEngine
from pdrouter.state.prefix_index import PrefixIndex
from pdrouter.state.registry import WorkerRegistry
from pdrouter.wire.convert import sampling_to_pb
from pdrouter.wire.lane import DecodeLane, LaneChannel, PrefillLane
from pdrouter.wire.v1 import common_pb2, worker_pb2, worker_pb2_grpc

from .conftest import BACKENDS, SpawnWorker, load_of, settle

GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
PROMPTS = [[257, *b"hello world"], [257, *(b"the quick brown fox jumps over the lazy dog " * 4)],
           [257, 65, 66], [257, *(b"the quick brown fox jumps over the lazy dog " * 4), *b"again"]]


@dataclass
class Stubs:
    channels: list[grpc.aio.Channel]
    prefill: worker_pb2_grpc.PrefillWorkerStub
    decode: worker_pb2_grpc.DecodeWorkerStub
    prefill_info: worker_pb2_grpc.WorkerInfoServiceStub
    decode_info: worker_pb2_grpc.WorkerInfoServiceStub
    compat: str

    async def free(self, info: worker_pb2_grpc.WorkerInfoServiceStub) -> tuple[int, int]:
        return await load_of(info)

    async def settle(self, info: worker_pb2_grpc.WorkerInfoServiceStub, free: int) -> tuple[int, int]:
        return await settle(info, free)

    async def allocate(self, rid: str, prompt: list[int], params: SamplingParams = GREEDY,
                       **kw: object) -> worker_pb2.AllocateResponse:
        msg = worker_pb2.AllocateRequest(request_id=rid, prompt_token_ids=prompt, max_tokens=params.max_tokens,
                                         model_compat_hash=self.compat, sampling=sampling_to_pb(params))
        for key, value in kw.items():
            setattr(msg, key, value)
        return await self.decode.Allocate(msg)

    def prefill_call(self, rid: str, prompt: list[int], target: common_pb2.TransferTarget,
                     params: SamplingParams = GREEDY) -> grpc.aio.UnaryUnaryCall:
        return self.prefill.Prefill(worker_pb2.PrefillRequest(
            request_id=rid, prompt_token_ids=prompt, sampling=sampling_to_pb(params), target=target,
            model_compat_hash=self.compat))

    async def generate(self, rid: str, prompt: list[int], params: SamplingParams = GREEDY) -> list[int]:
        alloc = await self.allocate(rid, prompt, params)
        resp = await self.prefill_call(rid, prompt, alloc.target, params)
        tokens = [resp.first_token_id]
        async for chunk in self.decode.Generate(worker_pb2.DecodeRequest(request_id=rid,
                                                                         first_token_id=resp.first_token_id)):
            tokens.extend(chunk.token_ids)
        return tokens


async def connect(prefill: ManagedProcess, decode: ManagedProcess) -> Stubs:
    assert prefill.address and decode.address
    pc, dc = grpc.aio.insecure_channel(prefill.address), grpc.aio.insecure_channel(decode.address)
    info = await worker_pb2_grpc.WorkerInfoServiceStub(dc).GetInfo(worker_pb2.GetInfoRequest())
    return Stubs([pc, dc], worker_pb2_grpc.PrefillWorkerStub(pc), worker_pb2_grpc.DecodeWorkerStub(dc),
                 worker_pb2_grpc.WorkerInfoServiceStub(pc), worker_pb2_grpc.WorkerInfoServiceStub(dc),
                 info.model_compat_hash)


PREFILL_TIME_SCALE = 200.0
"""A simulated prefill worker's time scale in ``pd``: a prefill step of the tiny model takes about
0.34 s, so a Prefill call is still running when a test cancels it or kills the worker (as the
torch worker's is)."""
DECODE_TIME_SCALE = 30.0
"""A simulated decode worker's in ``pd``: about 50 ms a token, so a stream of 200 tokens would run
for 10 s, longer than ``settle`` waits, if cancelling it did not abort it."""


@pytest.fixture
async def pd(spawn_worker: SpawnWorker, redis_url: str, request: pytest.FixtureRequest) -> AsyncIterator[Stubs]:
    # "KV_BACKEND" or "KV_BACKEND+lane": the request RPCs go over the workers' lanes instead of gRPC.
    # The engine is the ``backend`` fixture's (torch unless the test is parametrized over BACKENDS).
    kv_backend, _, via = getattr(request, "param", "tcp").partition("+")
    prefill = spawn_worker("prefill", redis_url=redis_url, kv_backend=kv_backend, time_scale=PREFILL_TIME_SCALE)
    decode = spawn_worker("decode", redis_url=redis_url, kv_backend=kv_backend, extra=("--lease-ms", "1500"),
                          time_scale=DECODE_TIME_SCALE)
    stubs = await connect(prefill, decode)
    stubs.procs = (prefill, decode)  # type: ignore[attr-defined]
    lanes = []
    if via == "lane":
        p_info = await stubs.prefill_info.GetInfo(worker_pb2.GetInfoRequest())
        d_info = await stubs.decode_info.GetInfo(worker_pb2.GetInfoRequest())
        lanes = [LaneChannel(p_info.lane_address), LaneChannel(d_info.lane_address)]
        stubs.prefill, stubs.decode = PrefillLane(lanes[0]), DecodeLane(lanes[1])
    yield stubs
    for ch in stubs.channels:
        await ch.close()
    for lane in lanes:
        await lane.close()


def reference(model: Path) -> list[list[int]]:
    return TorchEngine(EngineConfig(model_dir=model, num_blocks=256)).generate(PROMPTS, GREEDY)


@pytest.mark.parametrize("pd", ["tcp", "gloo", "tcp+lane"], indirect=True)
async def test_disaggregated_outputs_equal_colocated(pd: Stubs, tiny_model: Path) -> None:
    start_free = (await pd.free(pd.decode_info))[0]
    expected = reference(tiny_model)
    got = await asyncio.gather(*(pd.generate(f"r{i}", p) for i, p in enumerate(PROMPTS)))
    assert got == expected
    # The prompt shared with PROMPTS[1] hits both caches the second time round.
    again = await pd.allocate("again", PROMPTS[3])
    assert again.cached_blocks == len(PROMPTS[1]) // 16
    assert again.target.skip_blocks == again.cached_blocks
    await pd.decode.Release(worker_pb2.ReleaseRequest(request_id="again"))
    assert await pd.settle(pd.decode_info, start_free) == (start_free, 0)


async def test_the_prefill_worker_feeds_the_prefix_index_and_the_decode_worker_does_not(
        pd: Stubs, redis_url: str) -> None:
    """Both workers cache the prompt's blocks; only the prefill worker's go to the index (only prefill
    placement reads it): the decode worker holds no entry, and no liveness either."""
    await asyncio.gather(*(pd.generate(f"r{i}", p) for i, p in enumerate(PROMPTS)))
    client = aioredis.Redis.from_url(redis_url)
    try:
        index = PrefixIndex(client, "tiny")
        live = {w.record.role.value: w.record for w in await WorkerRegistry(client, "tiny").live_workers()}
        prefill, decode = live["prefill"], live["decode"]
        deadline = time.monotonic() + 10
        while await index.size(prefill.worker_id, prefill.epoch) == 0 and time.monotonic() < deadline:
            await asyncio.sleep(0.05)  # the publisher flushes every 10 ms
        assert await index.size(prefill.worker_id, prefill.epoch) >= sum(len(p) // 16 for p in PROMPTS[:3])
        assert await index.size(decode.worker_id, decode.epoch) == 0
        hashes = hash_blocks(PROMPTS[1], 16)
        matches = await index.lookup(hashes, [(WorkerId(r.worker_id), Epoch(r.epoch)) for r in (prefill, decode)])
        assert {m.worker_id: m.blocks for m in matches} == {prefill.worker_id: len(hashes), decode.worker_id: 0}
        assert await client.zscore(index.keys.prefix_live, f"{prefill.worker_id}:{prefill.epoch}")
        assert not await client.zscore(index.keys.prefix_live, f"{decode.worker_id}:{decode.epoch}")
    finally:
        await client.aclose()


@pytest.mark.parametrize("pd", ["tcp", "tcp+lane"], indirect=True)
@pytest.mark.parametrize("backend", BACKENDS)
async def test_cancel_at_every_stage_frees_everything(pd: Stubs) -> None:
    d_free = (await pd.free(pd.decode_info))[0]
    p_free = (await pd.free(pd.prefill_info))[0]
    long_prompt = [257, *([7, 8, 9, 10] * 200)]
    # Before allocation: nothing is held, release says so.
    resp = await pd.decode.Release(worker_pb2.ReleaseRequest(request_id="never"))
    assert not resp.released
    # Allocated, then released before prefill.
    await pd.allocate("a1", long_prompt)
    assert (await pd.free(pd.decode_info))[0] < d_free
    resp = await pd.decode.Release(worker_pb2.ReleaseRequest(request_id="a1"))
    assert resp.released and resp.freed_blocks == -(-len(long_prompt) // 16)
    # During prefill / transfer: cancel the Prefill call at several points of a whole call's time (timed
    # here: the engine's speed sets where the points fall), then release decode. A call that finished
    # before its cancel landed is released like the rest; the early points always land.
    alloc = await pd.allocate("timed", long_prompt)
    began = time.monotonic()
    await pd.prefill_call("timed", long_prompt, alloc.target)
    whole = time.monotonic() - began
    await pd.decode.Release(worker_pb2.ReleaseRequest(request_id="timed"))
    cancelled = 0
    for i, share in enumerate((0.0, 0.05, 0.25, 0.5, 0.8)):
        alloc = await pd.allocate(f"c{i}", long_prompt)
        call = pd.prefill_call(f"c{i}", long_prompt, alloc.target)
        await asyncio.sleep(share * whole)
        call.cancel()
        try:
            await call
        except asyncio.CancelledError:
            cancelled += 1
        await pd.decode.Release(worker_pb2.ReleaseRequest(request_id=f"c{i}"))
    assert cancelled >= 2, (cancelled, whole)
    # Mid-decode: stop reading the stream and cancel it.
    alloc = await pd.allocate("m", long_prompt, SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True))
    first = (await pd.prefill_call("m", long_prompt, alloc.target)).first_token_id
    stream = pd.decode.Generate(worker_pb2.DecodeRequest(request_id="m", first_token_id=first))
    async for chunk in stream:
        if chunk.token_ids:
            break
    stream.cancel()
    assert await pd.settle(pd.decode_info, d_free) == (d_free, 0)
    assert await pd.settle(pd.prefill_info, p_free) == (p_free, 0)


@pytest.mark.parametrize("backend", BACKENDS)
async def test_unclaimed_allocation_expires(pd: Stubs) -> None:
    d_free = (await pd.free(pd.decode_info))[0]
    await pd.allocate("lonely", [257, *range(100)])
    assert (await pd.free(pd.decode_info))[0] < d_free
    await asyncio.sleep(1.7)  # the decode worker runs with --lease-ms 1500
    assert await pd.settle(pd.decode_info, d_free) == (d_free, 0)
    with pytest.raises(grpc.aio.AioRpcError) as err:
        async for _ in pd.decode.Generate(worker_pb2.DecodeRequest(request_id="lonely", first_token_id=1)):
            pass
    assert err.value.code() == grpc.StatusCode.NOT_FOUND


@pytest.mark.parametrize("backend", BACKENDS)
async def test_killed_prefill_worker_strands_nothing(pd: Stubs) -> None:
    prefill, _decode = pd.procs  # type: ignore[attr-defined]
    d_free = (await pd.free(pd.decode_info))[0]
    # Prompts of their own (no prefix of one cached by another), 951 tokens each.
    prompts = {f"{kind}{i}": [257, 11 + i + 3 * (kind == "k"), *([1, 2, 3, 4, 5] * 190)][:951]
               for kind in "tk" for i in range(3)}
    # How long three such prefills take on this worker, so that the kill falls while they run.
    allocs = {rid: await pd.allocate(rid, prompts[rid]) for rid in ("t0", "t1", "t2")}
    began = time.monotonic()
    await asyncio.gather(*(pd.prefill_call(rid, prompts[rid], a.target) for rid, a in allocs.items()))
    whole = time.monotonic() - began
    for rid in allocs:
        await pd.decode.Release(worker_pb2.ReleaseRequest(request_id=rid))
    allocs = {rid: await pd.allocate(rid, prompts[rid]) for rid in ("k0", "k1", "k2")}
    calls = [pd.prefill_call(rid, prompts[rid], a.target) for rid, a in allocs.items()]
    await asyncio.sleep(0.3 * whole)
    prefill.kill()
    failed = 0
    for call in calls:
        try:
            await call  # one that finished before the kill landed is released like the rest
        except grpc.aio.AioRpcError as err:
            assert err.code() == grpc.StatusCode.UNAVAILABLE
            failed += 1
    assert failed >= 1, whole
    # The router releases what it allocated; nothing is left on the decode worker.
    for i in range(3):
        await pd.decode.Release(worker_pb2.ReleaseRequest(request_id=f"k{i}"))
    assert await pd.settle(pd.decode_info, d_free) == (d_free, 0)
    # And the decode worker still serves.
    again = await pd.allocate("after", prompts["k0"])
    await pd.decode.Release(worker_pb2.ReleaseRequest(request_id="after"))
    assert again.num_blocks > 0


@pytest.mark.parametrize("pd", ["tcp", "tcp+lane"], indirect=True)
@pytest.mark.parametrize("backend", BACKENDS)
async def test_bad_requests_get_clear_statuses(pd: Stubs) -> None:
    async def code_of(coro: object) -> grpc.StatusCode:
        with pytest.raises(grpc.RpcError) as err:  # grpc.aio.AioRpcError, or LaneError over a lane
            await coro  # type: ignore[misc]
        assert err.value.details()
        return err.value.code()

    async def stream_code(msg: worker_pb2.DecodeRequest) -> grpc.StatusCode:
        async def drain() -> None:
            async for _ in pd.decode.Generate(msg):
                pass
        return await code_of(drain())

    d_free = (await pd.free(pd.decode_info))[0]
    assert await stream_code(worker_pb2.DecodeRequest(request_id="ghost", first_token_id=1)) == \
        grpc.StatusCode.NOT_FOUND
    # Over the model's 1024-token context window.
    assert await code_of(pd.allocate("long", [257] * 900, SamplingParams(max_tokens=200))) == \
        grpc.StatusCode.INVALID_ARGUMENT
    assert await code_of(pd.allocate("compat", [257, 1], model_compat_hash="nope")) == \
        grpc.StatusCode.FAILED_PRECONDITION
    assert await code_of(pd.allocate("", [257, 1])) == grpc.StatusCode.INVALID_ARGUMENT
    assert await code_of(pd.allocate("empty", [])) == grpc.StatusCode.INVALID_ARGUMENT
    assert await code_of(pd.allocate("vocab", [257, 99_999])) == grpc.StatusCode.INVALID_ARGUMENT
    assert await code_of(pd.decode.Allocate(worker_pb2.AllocateRequest(
        request_id="nomax", prompt_token_ids=[1], model_compat_hash=pd.compat))) == grpc.StatusCode.INVALID_ARGUMENT
    assert await code_of(pd.prefill.Prefill(worker_pb2.PrefillRequest(
        request_id="notarget", prompt_token_ids=[1], sampling=sampling_to_pb(GREEDY),
        model_compat_hash=pd.compat))) == grpc.StatusCode.INVALID_ARGUMENT
    assert await code_of(pd.prefill.Prefill(worker_pb2.PrefillRequest(
        request_id="compat", prompt_token_ids=[1], sampling=sampling_to_pb(GREEDY),
        model_compat_hash="other"))) == grpc.StatusCode.FAILED_PRECONDITION
    alloc = await pd.allocate("wrongkv", [257, 1, 2])
    bad_target = common_pb2.TransferTarget()
    bad_target.CopyFrom(alloc.target)
    bad_target.compat_hash = "deadbeef"
    assert await code_of(pd.prefill_call("wrongkv", [257, 1, 2], bad_target)) == grpc.StatusCode.FAILED_PRECONDITION
    await pd.decode.Release(worker_pb2.ReleaseRequest(request_id="wrongkv"))

    # A packed prompt that is not whole uint32 ids, or a prompt sent both ways: refused, saying which.
    async def refusal(call: object) -> tuple[grpc.StatusCode, str]:
        with pytest.raises(grpc.RpcError) as err:
            await call  # type: ignore[misc]
        return err.value.code(), err.value.details() or ""

    async def serve(**prompt: object) -> None:
        async for _ in pd.decode.Serve(worker_pb2.ServeRequest(
                request_id="packed", sampling=sampling_to_pb(GREEDY), model_compat_hash=pd.compat, **prompt)):
            pass

    torn, both = b"\x01\x01\x00", {"prompt_token_ids": [257], "prompt_token_bytes": pack_token_ids([257])}
    assert await refusal(serve(prompt_token_bytes=torn)) == (
        grpc.StatusCode.INVALID_ARGUMENT, "packed token ids are 4 bytes each: got 3 bytes")
    code, details = await refusal(serve(**both))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "both as prompt_token_ids and as prompt_token_bytes" in details
    alloc = await pd.allocate("torn", [257, 1, 2])
    code, details = await refusal(pd.prefill.Prefill(worker_pb2.PrefillRequest(
        request_id="torn", prompt_token_bytes=torn, sampling=sampling_to_pb(GREEDY), target=alloc.target,
        model_compat_hash=pd.compat)))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "4 bytes each" in details
    await pd.decode.Release(worker_pb2.ReleaseRequest(request_id="torn"))
    # Still serving, and no block is left held.
    assert len(await pd.generate("ok", PROMPTS[0])) == GREEDY.max_tokens
    assert await pd.settle(pd.decode_info, d_free) == (d_free, 0)


@pytest.mark.parametrize("backend", BACKENDS)
async def test_allocation_larger_than_the_pool_is_resource_exhausted(spawn_worker: SpawnWorker) -> None:
    small = spawn_worker("decode", num_blocks=16)  # 256 tokens in all
    assert small.address
    async with grpc.aio.insecure_channel(small.address) as channel:
        info = await worker_pb2_grpc.WorkerInfoServiceStub(channel).GetInfo(worker_pb2.GetInfoRequest())
    # Without a registry a prefill worker sends KV only to the receivers it is given.
    prefill = spawn_worker("prefill", extra=("--decode-kv-addresses", info.kv_address))
    stubs = await connect(prefill, small)
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await stubs.allocate("big", [257] * 300, SamplingParams(max_tokens=10))
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "16" in (err.value.details() or "")
    assert len(await stubs.generate("fits", PROMPTS[0])) == GREEDY.max_tokens
    for ch in stubs.channels:
        await ch.close()


async def test_restart_fences_old_registration_and_index(spawn_worker: SpawnWorker, redis_url: str) -> None:
    first = spawn_worker("prefill", redis_url=redis_url, extra=("--worker-id", "prefill-x"))
    client = aioredis.Redis.from_url(redis_url)
    registry, index = WorkerRegistry(client, "tiny"), PrefixIndex(client, "tiny")
    old = (await registry.live_workers())[0].record
    # Give the old incarnation some cached blocks via a colocated-style run: Prefill needs a target,
    # so publish through the index directly as the worker would.
    hashes = hash_blocks(list(range(64)), 16)
    await index.add(old.worker_id, old.epoch, hashes)
    first.kill()
    second = spawn_worker("prefill", redis_url=redis_url, extra=("--worker-id", "prefill-x"))
    live = await registry.live_workers()
    assert [(w.record.worker_id, w.record.address) for w in live] == [("prefill-x", second.address)]
    new = live[0].record
    assert new.epoch > old.epoch
    matches = await index.lookup(hashes, [(WorkerId("prefill-x"), Epoch(new.epoch))])
    assert matches[0].blocks == 0  # the old incarnation's entries never match the new epoch
    await client.aclose()
