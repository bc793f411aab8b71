"""``DecodeWorker.Serve``: the whole disaggregated request in one call, driven by the decode worker.

Real prefill and decode processes, real Redis, the real KV transport. The decode worker reserves,
calls the prefill workers it is given (over their lanes or gRPC), and decodes; the tests check its
outputs against the colocated engine, the report on the first chunk, local prefill, the retry on
another prefill worker, cancellation at several points (nothing held afterwards on either side)
and the statuses of bad requests.

The worker processes are the module's (``workers``), shared by its tests: each test gets them
idle, in a pool holding only them (``fleet``), with fresh ones in place of any a test killed.
"""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
import redis
import redis.asyncio as aioredis

from pdrouter.cli.local_cluster import ManagedProcess
from pdrouter.core.ids import WorkerId
from pdrouter.core.sampling import SamplingParams
from pdrouter.core.workers import WorkerRecord, WorkerRole
from pdrouter.engine.config import EngineConfig
from pdrouter.engine.torch_engine import TorchEngine
from pdrouter.state.embedded_redis import EmbeddedRedis
from pdrouter.state.registry import WorkerRegistry
from pdrouter.wire.convert import sampling_to_pb
from pdrouter.wire.lane import DecodeLane, LaneChannel
from pdrouter.wire.v1 import common_pb2, worker_pb2, worker_pb2_grpc

from .conftest import SpawnWorker, load_of, settle

GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
SHARED = [257, *(b"the quick brown fox jumps over the lazy dog " * 4)]
PROMPTS = [[257, *b"hello world"], SHARED, [257, 65, 66], [*SHARED, *b"again"]]


def long_prompt(variant: int = 0) -> list[int]:
    """801 tokens; prompts of different ``variant`` share no KV block."""
    return [257, *([7 + variant, 8, 9, 10] * 200)]


@dataclass
class Fleet:
    prefills: list[common_pb2.WorkerInfo]
    decode: common_pb2.WorkerInfo
    stub: worker_pb2_grpc.DecodeWorkerStub | DecodeLane
    infos: dict[str, worker_pb2_grpc.WorkerInfoServiceStub]
    procs: dict[str, ManagedProcess]
    use_lane: bool
    redis_url: str

    def route(self, info: common_pb2.WorkerInfo) -> worker_pb2.PrefillRoute:
        return worker_pb2.PrefillRoute(worker_id=info.worker_id, address=info.address,
                                       lane_address=info.lane_address if self.use_lane else "")

    def serve(self, rid: str, prompt: list[int], params: SamplingParams = GREEDY,
              routes: list[worker_pb2.PrefillRoute] | None = None, local_prefill_tokens: int = 0,
              **kw: object) -> object:
        msg = worker_pb2.ServeRequest(
            request_id=rid, prompt_token_ids=prompt, sampling=sampling_to_pb(params),
            model_compat_hash=self.decode.model_compat_hash, local_prefill_tokens=local_prefill_tokens,
            prefill=[self.route(p) for p in self.prefills] if routes is None else routes)
        for key, value in kw.items():
            setattr(msg, key, value)
        return self.stub.Serve(msg)

    async def run(self, rid: str, prompt: list[int], **kw: object) -> tuple[list[int], list[common_pb2.TokenChunk]]:
        chunks = [chunk async for chunk in self.serve(rid, prompt, **kw)]  # type: ignore[attr-defined]
        return [t for c in chunks for t in c.token_ids], chunks

    async def load(self, worker_id: str) -> tuple[int, int]:
        return await load_of(self.infos[worker_id])

    async def settle(self, worker_id: str, free: int) -> tuple[int, int]:
        return await settle(self.infos[worker_id], free)

    async def dead_route(self, worker_id: str = "prefill-gone") -> worker_pb2.PrefillRoute:
        """A route to a registered prefill worker that no longer listens (it died since the router
        ranked it)."""
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            address = f"127.0.0.1:{s.getsockname()[1]}"
        await self.register(worker_id, address)
        return worker_pb2.PrefillRoute(worker_id=worker_id, address=address, lane_address=address)

    async def register(self, worker_id: str, address: str) -> None:
        """Register a prefill worker at ``address`` (gRPC and lane) in the fleet's pool."""
        client = aioredis.Redis.from_url(self.redis_url)
        registry = WorkerRegistry(client, "tiny")
        record = WorkerRecord(worker_id=WorkerId(worker_id), role=WorkerRole.PREFILL, address=address,
                              epoch=await registry.new_epoch(), model="tiny", model_compat_hash="",
                              kv_compat_hash="", block_size=16, capacity_blocks=1, lane_address=address)
        await registry.register(record)
        await client.aclose()


ROLES = {"prefill-a": "prefill", "prefill-b": "prefill", "decode": "decode"}
"""The module's shared workers, by name: their roles."""


@dataclass
class Workers:
    """The worker processes the module's tests share (by name in ``ROLES``) and the Redis they register in."""

    procs: dict[str, ManagedProcess]
    spawn: SpawnWorker
    redis_url: str

    def replace(self, name: str) -> None:
        """Stop worker ``name`` (if it still runs) and start a fresh one in its place."""
        self.procs[name].stop()
        self.procs[name] = self.spawn(ROLES[name], redis_url=self.redis_url)


@pytest.fixture(scope="module")
def workers(spawn_module_worker: SpawnWorker, redis_server: EmbeddedRedis) -> Workers:
    """Two prefill workers and one decode worker for the whole module, in a Redis emptied before they
    start (each test gets them through ``fleet``)."""
    if not redis_server.running:
        redis_server.start()
    client = redis.Redis.from_url(redis_server.url)
    client.flushall()
    client.close()
    procs = {name: spawn_module_worker(role, redis_url=redis_server.url) for name, role in ROLES.items()}
    return Workers(procs, spawn_module_worker, redis_server.url)


async def idle(proc: ManagedProcess) -> bool:
    """Whether ``proc`` runs and answers, within a few seconds, with every block free and nothing running."""
    if not proc.alive:
        return False
    async with grpc.aio.insecure_channel(proc.address or "") as channel:
        info = worker_pb2_grpc.WorkerInfoServiceStub(channel)
        try:
            total = (await info.GetLoad(worker_pb2.GetLoadRequest(), timeout=5.0)).total_blocks
            return await settle(info, total) == (total, 0)
        except grpc.RpcError:
            return False


async def keep_only(redis_url: str, worker_ids: set[str]) -> None:
    """Deregister every worker of the pool but ``worker_ids`` (what a test registered, or one it
    killed), then wait until exactly those are live."""
    client = aioredis.Redis.from_url(redis_url)
    registry = WorkerRegistry(client, "tiny")
    try:
        for record in await registry.records():
            if record.worker_id not in worker_ids:
                await registry.deregister(record.worker_id, record.epoch)
        live: set[str] = set()
        for _ in range(100):
            live = {w.record.worker_id for w in await registry.live_workers()}
            if live == worker_ids:
                break
            await asyncio.sleep(0.05)
        assert live == worker_ids, f"pool {sorted(live)}, expected {sorted(worker_ids)}"
    finally:
        await client.aclose()


@pytest.fixture
async def fleet(workers: Workers, request: pytest.FixtureRequest) -> AsyncIterator[Fleet]:
    """The module's two prefill workers and decode worker, idle and the only ones in the pool;
    ``"lane"`` routes prefill calls (and ours) over lanes.

    A worker that died (a test killed it) or does not settle idle is replaced by a fresh one, and
    workers a test registered leave the pool, so each test starts as if the workers were new.
    """
    use_lane = getattr(request, "param", "grpc") == "lane"
    for name, proc in workers.procs.items():
        if not await idle(proc):
            workers.replace(name)
    procs = dict(workers.procs)
    channels = {name: grpc.aio.insecure_channel(p.address or "") for name, p in procs.items()}
    info_stubs = {name: worker_pb2_grpc.WorkerInfoServiceStub(ch) for name, ch in channels.items()}
    infos = {name: await stub.GetInfo(worker_pb2.GetInfoRequest()) for name, stub in info_stubs.items()}
    await keep_only(workers.redis_url, {info.worker_id for info in infos.values()})
    lane = LaneChannel(infos["decode"].lane_address) if use_lane else None
    stub = DecodeLane(lane) if lane is not None else worker_pb2_grpc.DecodeWorkerStub(channels["decode"])
    yield Fleet([infos["prefill-a"], infos["prefill-b"]], infos["decode"], stub,
                {infos[name].worker_id: s for name, s in info_stubs.items()},
                {infos[name].worker_id: p for name, p in procs.items()}, use_lane, workers.redis_url)
    if lane is not None:
        await lane.close()
    for ch in channels.values():
        await ch.close()


@pytest.mark.parametrize("fleet", ["grpc", "lane"], indirect=True)
async def test_outputs_equal_colocated_and_report_says_how(fleet: Fleet, tiny_model: Path) -> None:
    expected = TorchEngine(EngineConfig(model_dir=tiny_model, num_blocks=256)).generate(PROMPTS, GREEDY)
    results = await asyncio.gather(*(fleet.run(f"r{i}", p) for i, p in enumerate(PROMPTS)))
    assert [tokens for tokens, _ in results] == expected
    for prompt, (_, chunks) in zip(PROMPTS, results, strict=True):
        first = chunks[0]
        assert first.HasField("prefill") and len(first.token_ids) == 1
        report = first.prefill
        assert not report.local and report.worker_id == fleet.prefills[0].worker_id
        assert report.prompt_tokens == len(prompt) and not report.failures
        assert all(not c.HasField("prefill") for c in chunks[1:])
        last = chunks[-1]
        assert last.finish_reason == common_pb2.FINISH_REASON_LENGTH
        assert (last.usage.prompt_tokens, last.usage.completion_tokens) == (len(prompt), GREEDY.max_tokens)
    # The shared prefix is in the prefill worker's cache and the decode worker's now: only the
    # uncached tail is computed and sent.
    _, chunks = await fleet.run("again-2", [*SHARED, *b"once more"])
    report = chunks[0].prefill
    assert report.decode_cached_tokens == len(SHARED) // 16 * 16
    assert report.bytes_sent > 0 and chunks[-1].usage.cached_tokens >= report.decode_cached_tokens


async def test_local_prefill_when_little_is_uncached_or_no_route(fleet: Fleet, tiny_model: Path) -> None:
    expected = TorchEngine(EngineConfig(model_dir=tiny_model, num_blocks=256)).generate(PROMPTS[:2], GREEDY)
    tokens, chunks = await fleet.run("small", PROMPTS[0], local_prefill_tokens=32)
    assert tokens == expected[0]
    assert chunks[0].prefill.local and chunks[0].prefill.worker_id == ""
    tokens, chunks = await fleet.run("noroute", PROMPTS[1], routes=[])
    assert tokens == expected[1] and chunks[0].prefill.local


@pytest.mark.parametrize("fleet", ["grpc", "lane"], indirect=True)
async def test_failed_prefill_worker_is_retried_on_the_next(fleet: Fleet, tiny_model: Path) -> None:
    d_free = (await fleet.load(fleet.decode.worker_id))[0]
    expected = TorchEngine(EngineConfig(model_dir=tiny_model, num_blocks=256)).generate([PROMPTS[1]], GREEDY)[0]
    routes = [await fleet.dead_route(), fleet.route(fleet.prefills[1])]
    tokens, chunks = await fleet.run("retry", PROMPTS[1], routes=routes)
    assert tokens == expected
    report = chunks[0].prefill
    assert report.worker_id == fleet.prefills[1].worker_id
    assert [(f.worker_id, f.code) for f in report.failures] == [("prefill-gone", "UNAVAILABLE")]
    # Every route failing: a chunk with the report, then UNAVAILABLE; nothing stays held.
    chunks = []
    hopeless = [await fleet.dead_route("x"), await fleet.dead_route("y")]
    with pytest.raises(grpc.RpcError) as err:
        async for chunk in fleet.serve("hopeless", PROMPTS[1], routes=hopeless):  # type: ignore[attr-defined]
            chunks.append(chunk)
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE  # type: ignore[attr-defined]
    assert "prefill on y failed" in err.value.details()  # type: ignore[attr-defined]
    assert [f.worker_id for f in chunks[0].prefill.failures] == ["x", "y"] and not chunks[0].token_ids
    assert await fleet.settle(fleet.decode.worker_id, d_free) == (d_free, 0)


@pytest.mark.parametrize("fleet", ["grpc", "lane"], indirect=True)
async def test_routes_not_registered_in_the_pool_are_never_called(fleet: Fleet, tiny_model: Path) -> None:
    """A caller cannot point the decode worker at an address of its choosing: the route must be a
    prefill worker registered in the pool, at the addresses it registered."""
    connections = 0

    async def count(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal connections
        connections += 1
        writer.close()

    server = await asyncio.start_server(count, "127.0.0.1", 0)
    elsewhere = f"127.0.0.1:{server.sockets[0].getsockname()[1]}"
    d_free = (await fleet.load(fleet.decode.worker_id))[0]
    expected = TorchEngine(EngineConfig(model_dir=tiny_model, num_blocks=256)).generate([PROMPTS[1]], GREEDY)[0]
    unregistered = worker_pb2.PrefillRoute(worker_id="intruder", address=elsewhere, lane_address=elsewhere)
    moved = worker_pb2.PrefillRoute(worker_id=fleet.prefills[0].worker_id, address=elsewhere, lane_address=elsewhere)
    tokens, chunks = await fleet.run("refused", PROMPTS[1], routes=[unregistered, moved,
                                                                    fleet.route(fleet.prefills[1])])
    assert tokens == expected
    report = chunks[0].prefill
    assert report.worker_id == fleet.prefills[1].worker_id
    assert [(f.worker_id, f.code) for f in report.failures] == [
        ("intruder", "PERMISSION_DENIED"), (fleet.prefills[0].worker_id, "PERMISSION_DENIED")]
    assert "not a prefill worker registered in pool 'tiny'" in report.failures[0].message
    assert "registered address" in report.failures[1].message
    # Every route refused: UNAVAILABLE (the caller's view of the pool is stale), nothing held.
    with pytest.raises(grpc.RpcError) as err:
        await fleet.run("all-refused", PROMPTS[1], routes=[unregistered])
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE  # type: ignore[attr-defined]
    assert "refused" in err.value.details()  # type: ignore[attr-defined]
    assert connections == 0
    assert await fleet.settle(fleet.decode.worker_id, d_free) == (d_free, 0)
    # Once that address is registered as a prefill worker, the decode worker calls it at once.
    await fleet.register("intruder", elsewhere)
    tokens, chunks = await fleet.run("registered", PROMPTS[1], routes=[unregistered, fleet.route(fleet.prefills[1])])
    assert tokens == expected and chunks[0].prefill.failures[0].code == "UNAVAILABLE"
    assert connections >= 1
    server.close()
    await server.wait_closed()


@pytest.mark.parametrize("fleet", ["grpc", "lane"], indirect=True)
async def test_cancel_at_every_stage_frees_everything(fleet: Fleet) -> None:
    decode, prefill = fleet.decode.worker_id, fleet.prefills[0].worker_id
    d_free, p_free = (await fleet.load(decode))[0], (await fleet.load(prefill))[0]
    # A prompt the shared workers have not cached (each variant its own): the calls are cancelled
    # at the stages they reach on fresh workers, not with the KV already on the decode worker.
    long = long_prompt(1 if fleet.use_lane else 0)
    for i, delay in enumerate((0.0, 0.002, 0.01, 0.03, 0.08)):
        call = fleet.serve(f"c{i}", long, SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True))

        async def drain(call: object = call) -> None:
            async for _ in call:  # type: ignore[attr-defined]
                pass

        task = asyncio.ensure_future(drain())
        await asyncio.sleep(delay)
        call.cancel()  # type: ignore[attr-defined]
        with pytest.raises(asyncio.CancelledError):
            await task
    # Mid-decode: stop reading after the first decoded tokens.
    call = fleet.serve("m", long, SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True))
    seen = 0
    async for chunk in call:  # type: ignore[attr-defined]
        seen += len(chunk.token_ids)
        if seen >= 3:
            break
    call.cancel()  # type: ignore[attr-defined]
    assert await fleet.settle(decode, d_free) == (d_free, 0)
    assert await fleet.settle(prefill, p_free) == (p_free, 0)
    tokens, _ = await fleet.run("after", PROMPTS[0])  # still serving
    assert len(tokens) == GREEDY.max_tokens


async def test_killed_prefill_worker_mid_request_goes_to_the_next(fleet: Fleet) -> None:
    first, second = fleet.prefills
    d_free = (await fleet.load(fleet.decode.worker_id))[0]
    prompt = [257, *([1, 2, 3, 4, 5] * 190)]
    calls = [asyncio.ensure_future(fleet.run(f"k{i}", prompt)) for i in range(3)]
    await asyncio.sleep(0.05)
    fleet.procs[first.worker_id].kill()
    for call in calls:
        tokens, chunks = await call
        assert len(tokens) == GREEDY.max_tokens
        # Some may have finished on the first worker before it died; the rest moved on.
        report = chunks[0].prefill
        assert report.worker_id in (first.worker_id, second.worker_id)
        if report.worker_id == second.worker_id:
            assert [f.worker_id for f in report.failures] == [first.worker_id]
    assert await fleet.settle(fleet.decode.worker_id, d_free) == (d_free, 0)


@pytest.mark.parametrize("fleet", ["grpc", "lane"], indirect=True)
async def test_bad_requests_get_clear_statuses(fleet: Fleet) -> None:
    async def code_of(call: object) -> grpc.StatusCode:
        with pytest.raises(grpc.RpcError) as err:
            async for _ in call:  # type: ignore[attr-defined]
                pass
        assert err.value.details()  # type: ignore[attr-defined]
        return err.value.code()  # type: ignore[attr-defined,no-any-return]

    d_free = (await fleet.load(fleet.decode.worker_id))[0]
    assert await code_of(fleet.serve("compat", [257, 1], model_compat_hash="nope")) == \
        grpc.StatusCode.FAILED_PRECONDITION
    assert await code_of(fleet.serve("kv", [257, 1], backend="carrier-pigeon")) == grpc.StatusCode.FAILED_PRECONDITION
    assert await code_of(fleet.serve("", [257, 1])) == grpc.StatusCode.INVALID_ARGUMENT
    assert await code_of(fleet.serve("empty", [])) == grpc.StatusCode.INVALID_ARGUMENT
    assert await code_of(fleet.serve("vocab", [257, 99_999])) == grpc.StatusCode.INVALID_ARGUMENT
    assert await code_of(fleet.serve("long", [257] * 900, SamplingParams(max_tokens=200))) == \
        grpc.StatusCode.INVALID_ARGUMENT
    assert await code_of(fleet.serve("noaddr", [257, 1], routes=[worker_pb2.PrefillRoute(worker_id="p")])) == \
        grpc.StatusCode.INVALID_ARGUMENT
    nosampling = worker_pb2.ServeRequest(request_id="nos", prompt_token_ids=[257, 1],
                                         model_compat_hash=fleet.decode.model_compat_hash)
    assert await code_of(fleet.stub.Serve(nosampling)) == grpc.StatusCode.INVALID_ARGUMENT
    assert await fleet.settle(fleet.decode.worker_id, d_free) == (d_free, 0)
    tokens, _ = await fleet.run("ok", PROMPTS[0])
    assert len(tokens) == GREEDY.max_tokens
