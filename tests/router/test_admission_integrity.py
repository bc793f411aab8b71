"""Admission integrity: router-assigned booking ids, TTLs kept alive by renewals, a pool that waits,
and a documented choice when Redis is gone.

Against a real Redis, real worker processes (simulated GPUs) and a router running in the test's
event loop (its gRPC and HTTP doors on free ports); the ledger is read straight from Redis.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import httpx
import pytest
import redis.asyncio as aioredis
from redis.exceptions import ConnectionError as RedisConnectionError

from pdrouter.cli.local_cluster import ManagedProcess, worker_args
from pdrouter.cli.main import build_parser
from pdrouter.cli.router_cmd import build_config
from pdrouter.core.capacity import blocks_for_tokens
from pdrouter.core.errors import ConfigError
from pdrouter.core.ids import Epoch, RequestId, WorkerId
from pdrouter.core.sampling import SamplingParams
from pdrouter.core.workers import WorkerRole
from pdrouter.engine.model_io import make_model
from pdrouter.router.admission import Admission, AdmissionConfig
from pdrouter.router.config import RouterConfig
from pdrouter.router.request import RouterRequest
from pdrouter.router.server import RouterProcess
from pdrouter.state.client import redis_client
from pdrouter.state.embedded_redis import EmbeddedRedis
from pdrouter.state.reservations import DecodeCapacity, KvReservations, key_ttl_ms
from pdrouter.wire.v1 import common_pb2, router_pb2, router_pb2_grpc

Spawn = Callable[..., ManagedProcess]
ERRORS = "pdrouter_admission_redis_errors_total"


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_model("tiny", 0, tmp_path_factory.mktemp("models") / "tiny")


@pytest.fixture
def spawn(tiny_model: Path) -> Iterator[Spawn]:
    """Start simulated workers (``time_scale`` × the modeled time; 0: no sleeping); all stop at the end."""
    procs: list[ManagedProcess] = []

    def start(role: str, redis_url: str, *, num_blocks: int = 512, time_scale: float = 0.0) -> ManagedProcess:
        name = f"{role}-{len(procs)}"
        args = worker_args(role, tiny_model, redis_url=redis_url, num_blocks=num_blocks,
                           sim=["--gpu", "h100", "--time-scale", f"{time_scale:g}"], extra=("--worker-id", name))
        proc = ManagedProcess(name, args)
        procs.append(proc)
        proc.wait_ready()
        return proc

    yield start
    for proc in procs:
        proc.stop()


@pytest.fixture
async def routers(tiny_model: Path) -> AsyncIterator[Callable[..., Awaitable[RouterProcess]]]:
    """Start routers in this event loop, each once it sees ``decode`` decode (and ``prefill``) workers."""
    started: list[RouterProcess] = []

    async def start(redis_url: str, *, decode: int = 1, prefill: int = 0, **kw: Any) -> RouterProcess:
        config = RouterConfig(model_dir=tiny_model, redis_url=redis_url, http_port=0, grpc_port=0,
                              refresh_interval_s=0.2, **kw)
        router = RouterProcess(config)
        await router.start()
        started.append(router)
        assert router.pool is not None
        for _ in range(200):
            if len(router.pool.available(WorkerRole.DECODE)) == decode and \
                    len(router.pool.available(WorkerRole.PREFILL)) == prefill:
                break
            await asyncio.sleep(0.05)
        else:
            raise AssertionError("the router never saw its workers")
        return router

    yield start
    for router in started:
        await router.stop(grace=1.0)


async def until(predicate: Callable[[], Awaitable[bool]], what: str, tries: int = 500) -> None:
    """Poll ``predicate`` every 10 ms, ``tries`` times at most (a hang guard, not a latency bound)."""
    for _ in range(tries):
        if await predicate():
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"never happened: {what}")


def errors(router: RouterProcess, outcome: str) -> float:
    """``pdrouter_admission_redis_errors_total{outcome}`` as the router exports it."""
    value = router.metrics.registry.get_sample_value(ERRORS, {"outcome": outcome})
    assert value is not None, f"{ERRORS} is not exported"
    return value


def generate_request(request_id: str, text: str, max_tokens: int) -> router_pb2.GenerateRequest:
    return router_pb2.GenerateRequest(request_id=request_id, model="tiny", text=text,
                                      sampling=common_pb2.SamplingParams(max_tokens=max_tokens, ignore_eos=True))


# -- booking ids ----------------------------------------------------------------------------
@pytest.mark.parametrize("credit", [0.0, 0.05])
async def test_a_duplicate_request_id_is_only_a_label(
        credit: float, redis_url: str, spawn: Spawn, routers: Callable[..., Awaitable[RouterProcess]]) -> None:
    """Two gRPC calls with one ``request_id`` at once (a client naming another's request): the
    router keys each by an id of its own, so both are served on bookings of their own, both echo
    the client's id, and once both ended nothing is booked."""
    spawn("decode", redis_url, time_scale=30.0)  # ~50 ms a token: the first call is still decoding
    router = await routers(redis_url, admission_config=AdmissionConfig(credit_fraction=credit, credit_idle_s=0.2))
    adm, pool = router.admission, router.pool
    assert adm is not None and pool is not None
    worker = pool.available(WorkerRole.DECODE)[0]
    client = aioredis.Redis.from_url(redis_url)
    ledger = KvReservations(client, "tiny")

    async def booked() -> dict[str, int]:
        return await ledger.bookings(worker.worker_id, worker.record.epoch)

    text, max_tokens = "the same id, twice", 60
    blocks = blocks_for_tokens(len(router.tokenizer.encode(text)) + max_tokens, 16)
    async with grpc.aio.insecure_channel(router.grpc_address) as channel:
        stub = router_pb2_grpc.RouterStub(channel)
        if credit:  # credit held before the two calls: both are admitted from it, in memory
            async for _ in stub.Generate(generate_request("warm-up", text, 1)):
                pass

            async def credit_held() -> bool:
                return adm.credit_blocks > 0

            await until(credit_held, "credit booked")
        calls = [stub.Generate(generate_request("dup", text, max_tokens)) for _ in range(2)]
        heads = [await call.read() for call in calls]  # both decoding now (~3 s each)
        assert all(head.request_id == "dup" and head.token_ids for head in heads)
        assert adm.active == 2
        if not credit:
            assert sorted((await booked()).values()) == [blocks, blocks]  # a booking each
        for call, head in zip(calls, heads, strict=True):
            rest = []
            while (msg := await call.read()) is not grpc.aio.EOF:
                rest.append(msg)
            assert {m.request_id for m in (head, *rest)} == {"dup"}  # the client's id is what responses echo
            assert sum(len(m.token_ids) for m in (head, *rest)) == max_tokens

    async def nothing_booked() -> bool:
        return adm.active == 0 and adm.credit_blocks == 0 and await booked() == {} and \
            await ledger.used(worker.worker_id, worker.record.epoch) == 0

    await until(nothing_booked, "every booking released (credit given back when idle)")
    assert adm.stats.admitted == (3 if credit else 2)
    await client.aclose()


# -- TTLs -----------------------------------------------------------------------------------
async def test_renewals_refresh_the_ttl_of_every_key_of_a_booking(redis_url: str) -> None:
    """Two long requests on one worker whose keys are about to expire (nothing else was booked there
    for a while): the lease renewal extends every key, so their bookings stay."""
    client = aioredis.Redis.from_url(redis_url)
    res = KvReservations(client, "ttl")
    adm = Admission(res, AdmissionConfig(lease_ms=300, credit_fraction=0))  # renewed every 100 ms
    worker = [DecodeCapacity(WorkerId("d0"), Epoch(1), 100)]
    a = await adm.admit(RequestId("long-1"), 10, worker)
    b = await adm.admit(RequestId("long-1"), 5, worker)  # the same client id: two bookings all the same
    assert a.booking_id != b.booking_id
    keys = [res.keys.kv_bookings("d0", 1), res.keys.kv_leases("d0", 1), res.keys.kv_used("d0", 1)]
    full = key_ttl_ms(300)

    async def ttls() -> list[int]:
        return [int(await client.pttl(k)) for k in keys]

    assert all(full - 5_000 < t <= full for t in await ttls())
    for key in keys:  # time passes: the keys have 0.4 s left
        await client.pexpire(key, 400)
    assert all(0 < t <= 400 for t in await ttls())
    lease_before = await client.zscore(keys[1], a.booking_id)
    assert lease_before is not None
    adm.start()

    async def refreshed() -> bool:
        return all(t > full - 5_000 for t in await ttls())

    await until(refreshed, "the renewal extended every key's TTL")
    lease_after = await client.zscore(keys[1], a.booking_id)
    assert lease_after is not None and lease_after > lease_before
    await asyncio.sleep(0.5)  # past the moment the keys would have expired
    assert await res.bookings("d0", 1) == {a.booking_id: 10, b.booking_id: 5}
    assert await res.used("d0", 1) == 15
    # A renewal extends, never shortens: keys given more time elsewhere keep it.
    for key in keys:
        await client.pexpire(key, 600_000)
    assert await res.renew(a)
    assert all(t > 590_000 for t in await ttls())
    await adm.release(a)
    await adm.release(b)
    await adm.stop()
    assert await res.used("d0", 1) == 0
    await client.aclose()


# -- the connection pool --------------------------------------------------------------------
async def test_the_routers_pool_makes_callers_wait_where_the_default_one_raises(redis_url: str) -> None:
    """Eight calls that each hold a connection for 0.2 s, on four connections."""
    plain = aioredis.Redis(connection_pool=aioredis.ConnectionPool.from_url(redis_url, max_connections=4))
    bounded = redis_client(redis_url, max_connections=4, pool_timeout_s=5.0)
    outcomes = await asyncio.gather(*(plain.blpop(["nothing"], 0.2) for _ in range(8)), return_exceptions=True)
    assert sum(isinstance(o, RedisConnectionError) for o in outcomes) == 4  # "Too many connections"
    assert await asyncio.gather(*(bounded.blpop(["nothing"], 0.2) for _ in range(8))) == [None] * 8
    await plain.aclose()
    await bounded.aclose()


async def test_500_concurrent_admissions_never_bypass_shared_admission(
        redis_url: str, spawn: Spawn, routers: Callable[..., Awaitable[RouterProcess]]) -> None:
    """500 requests at once through one router whose Redis pool has 4 connections (each request also
    looks its prompt up in the prefix index): every one is admitted through the ledger, none by load
    alone, and the ledger is empty once they are done."""
    spawn("prefill", redis_url)
    spawn("decode", redis_url, num_blocks=128)  # 32 requests at a time: the rest wait for room
    # The queue waits as long as it takes: the test is about the ledger, not about this machine's speed.
    router = await routers(redis_url, prefill=1, redis_max_connections=4,
                           admission_config=AdmissionConfig(queue_timeout_s=300.0))
    adm, orch = router.admission, router.dispatcher
    assert adm is not None and orch is not None and router.redis is not None
    pool = router.redis.connection_pool
    assert isinstance(pool, aioredis.BlockingConnectionPool) and pool.max_connections == 4
    sampling = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)

    async def one(i: int) -> int:
        prompt = (257, *f"request {i:03d}: the same forty-odd tokens of prompt".encode())
        request = RouterRequest(RequestId(f"burst-{i}"), "tiny", prompt, sampling)
        return sum(len(delta.token_ids) for delta in [d async for d in orch.generate(request)])

    tokens = await asyncio.gather(*(one(i) for i in range(500)))
    assert tokens == [2] * 500
    assert adm.stats.admitted == 500 and orch.admission_ok
    assert errors(router, "local") == 0 and errors(router, "refused") == 0
    assert orch.stats.index_errors == 0  # the lookups waited for connections too
    assert orch.stats.lookups == 500
    client = aioredis.Redis.from_url(redis_url)
    ledger = KvReservations(client, "tiny")
    decode = router.pool.available(WorkerRole.DECODE)[0] if router.pool is not None else None
    assert decode is not None

    async def drained() -> bool:
        return adm.active == 0 and adm.credit_blocks == 0 and \
            await ledger.used(decode.worker_id, decode.record.epoch) == 0

    await until(drained, "every booking released and the credit given back", tries=1000)
    await client.aclose()


# -- Redis unreachable ----------------------------------------------------------------------
def test_the_router_flags(tiny_model: Path) -> None:
    def config(*extra: str) -> RouterConfig:
        return build_config(build_parser().parse_args(["router", "--model", str(tiny_model), "--redis",
                                                       "redis://127.0.0.1:1/0", *extra]))

    default = config()
    assert (default.admission_config.on_redis_error, default.redis_max_connections) == ("fail", 64)
    chosen = config("--admission-on-redis-error", "local", "--redis-max-connections", "16")
    assert (chosen.admission_config.on_redis_error, chosen.redis_max_connections) == ("local", 16)
    with pytest.raises(ConfigError, match=r"--redis-max-connections\) needs at least 4"):
        config("--redis-max-connections", "2")


async def test_with_redis_down_fail_refuses_and_local_serves_and_both_count(
        spawn: Spawn, routers: Callable[..., Awaitable[RouterProcess]]) -> None:
    with EmbeddedRedis() as redis_server:
        spawn("decode", redis_server.url)
        failing = await routers(redis_server.url, admission_config=AdmissionConfig(credit_fraction=0))
        local = await routers(redis_server.url,
                              admission_config=AdmissionConfig(credit_fraction=0, on_redis_error="local"))
        for router in (failing, local):
            assert errors(router, "refused") == 0 and errors(router, "local") == 0
        redis_server.stop()
        body = {"model": "tiny", "prompt": "is anyone there?", "max_tokens": 3, "temperature": 0, "ignore_eos": True}
        async with httpx.AsyncClient(timeout=30) as http:
            resp = await http.post(f"http://127.0.0.1:{failing.http_port}/v1/completions", json=body)
            assert resp.status_code == 503
            assert "Redis" in resp.json()["error"]["message"]
            resp = await http.post(f"http://127.0.0.1:{local.http_port}/v1/completions", json=body)
            assert resp.status_code == 200 and resp.json()["choices"][0]["text"] is not None
        async with grpc.aio.insecure_channel(failing.grpc_address) as channel:
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                async for _ in router_pb2_grpc.RouterStub(channel).Generate(generate_request("down", "hello", 3)):
                    pass
            assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
            assert "Redis" in (refused.value.details() or "")
        async with grpc.aio.insecure_channel(local.grpc_address) as channel:
            served = [m async for m in router_pb2_grpc.RouterStub(channel).Generate(generate_request("down", "hi", 3))]
            assert sum(len(m.token_ids) for m in served) == 3
        assert (errors(failing, "refused"), errors(failing, "local")) == (2, 0)
        assert (errors(local, "refused"), errors(local, "local")) == (0, 2)
        assert failing.admission is not None and failing.admission.stats.admitted == 0
