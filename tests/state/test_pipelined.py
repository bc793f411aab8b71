"""The pipelined Redis connection (``pdrouter.state.pipelined``) against a real Redis: replies in order
under concurrency, credentials, error replies, a lost script, a lost server, a stalled one, callers
that give up; and the prefix index, the bookings and the tenants' limits answering over it exactly
as over the client."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest
import redis
import redis.asyncio as aioredis
from redis.exceptions import AuthenticationError, ConnectionError, ResponseError, TimeoutError

from pdrouter.core.hashing import hash_blocks
from pdrouter.core.ids import Epoch, WorkerId
from pdrouter.core.tenants import TenantLimits
from pdrouter.state.acl import ROUTER_USER, component_users
from pdrouter.state.client import redis_client
from pdrouter.state.embedded_redis import EmbeddedRedis, find_redis_server, redis_version
from pdrouter.state.pipelined import Framed, PipelinedRedis, encode
from pdrouter.state.prefix_index import PrefixIndex
from pdrouter.state.reservations import BookingId, DecodeCapacity, KvReservations
from pdrouter.state.tenant_limits import LimitGrant, LimitRefusal, TenantLimiter

PROMPT = list(range(7000, 7000 + 16 * 40))
HASHES = hash_blocks(PROMPT, 16)
W0, W1 = WorkerId("p0"), WorkerId("p1")


@pytest.fixture
async def client(redis_url: str) -> AsyncIterator[aioredis.Redis]:
    c = redis_client(redis_url, max_connections=8, pool_timeout_s=1.0)
    yield c
    await c.aclose()


@pytest.fixture
async def pipe(client: aioredis.Redis) -> AsyncIterator[PipelinedRedis]:
    made = PipelinedRedis.of(client)
    assert made is not None
    yield made
    await made.aclose()


def test_commands_are_encoded_as_resp_bulk_strings() -> None:
    assert encode(("SET", b"k\r\n", 12, 1.5)) == b"*4\r\n$3\r\nSET\r\n$3\r\nk\r\n\r\n$2\r\n12\r\n$3\r\n1.5\r\n"
    with pytest.raises(TypeError, match="bytes, str, int or float"):
        encode(("SET", True))


@pytest.mark.parametrize("at", [0, 2, 4])
@pytest.mark.parametrize("value", [b"", b"\r\n", bytes(range(256)) * 9])
def test_a_framed_command_is_the_command_encoded_whole(at: int, value: bytes) -> None:
    args: list[object] = ["EVALSHA", "ab" * 20, 1, "k", b"x", 16]
    whole = [*args[:at], value, *args[at + 1:]]
    assert Framed(args, at).with_arg(value) == encode(whole)


async def test_a_framed_command_is_answered_as_its_call(pipe: PipelinedRedis) -> None:
    assert await pipe.send(Framed(["SET", "framed", b""], 2).with_arg(b"v\r\n1")) == b"OK"
    assert await pipe.call("GET", "framed") == b"v\r\n1"


async def test_concurrent_calls_get_their_own_replies_in_one_connection(pipe: PipelinedRedis,
                                                                        client: aioredis.Redis) -> None:
    await asyncio.gather(*(pipe.call("SET", f"k{i}", i) for i in range(200)))
    got = await asyncio.gather(*(pipe.call("GET", f"k{i}") for i in range(200)))
    assert got == [str(i).encode() for i in range(200)]
    clients = [line for line in (await client.client_list()) if line.get("cmd") in ("get", "set")]
    assert len(clients) == 1  # every call went over the one connection


async def test_an_error_reply_fails_its_call_only(pipe: PipelinedRedis) -> None:
    await pipe.call("SET", "s", "text")
    bad, good = pipe.call("INCR", "s"), pipe.call("GET", "s")
    with pytest.raises(ResponseError, match="not an integer"):
        await bad
    assert await good == b"text"


async def test_a_caller_that_gives_up_leaves_the_next_reply_to_the_next_call(pipe: PipelinedRedis) -> None:
    await pipe.call("SET", "a", 1)
    await pipe.call("SET", "b", 2)
    first = pipe.call("GET", "a")
    first.cancel()
    assert await pipe.call("GET", "b") == b"2"


async def test_a_script_redis_lost_is_loaded_again(pipe: PipelinedRedis, client: aioredis.Redis) -> None:
    script = client.register_script("return ARGV[1] .. KEYS[1]")
    assert await pipe.evalsha(script, ["k"], ["v"]) == b"vk"  # never loaded: NOSCRIPT, loaded, run
    await client.script_flush()
    assert await pipe.evalsha(script, ["k2"], ["w"]) == b"wk2"


async def test_credentials_are_presented_and_a_wrong_password_is_refused() -> None:
    users = component_users("r" * 32, "w" * 32, read_only_patterns=redis_version(find_redis_server()) >= (7, 0))
    with EmbeddedRedis(password="a" * 32, users=users) as server:
        right = redis_client(server.url_for(ROUTER_USER, "r" * 32), max_connections=4, pool_timeout_s=1.0)
        wrong = redis_client(server.url_for(ROUTER_USER, "x" * 32), max_connections=4, pool_timeout_s=1.0)
        ok, refused = PipelinedRedis.of(right), PipelinedRedis.of(wrong)
        assert ok is not None and refused is not None
        try:
            assert await ok.call("PING") == b"PONG"
            with pytest.raises(AuthenticationError):
                await refused.call("PING")
        finally:
            for made in (ok, refused):
                await made.aclose()
            for c in (right, wrong):
                await c.aclose()


async def test_a_lost_server_fails_the_waiting_calls_and_the_next_call_connects_again() -> None:
    with EmbeddedRedis() as server:
        c = redis_client(server.url, max_connections=4, pool_timeout_s=1.0)
        pipe = PipelinedRedis.of(c)
        assert pipe is not None
        try:
            assert await pipe.call("PING") == b"PONG"
            server.stop()
            with pytest.raises(ConnectionError):
                await pipe.call("PING")
            server.start()
            assert await pipe.call("PING") == b"PONG"
        finally:
            await pipe.aclose()
            await c.aclose()


async def test_a_stalled_server_times_the_call_out_and_the_connection_is_made_again(redis_url: str) -> None:
    c = redis_client(redis_url, max_connections=4, pool_timeout_s=1.0)
    pipe = PipelinedRedis.of(c)
    assert pipe is not None
    pipe.timeout_s = 0.3
    admin = redis.Redis.from_url(redis_url)
    try:
        assert await pipe.call("PING") == b"PONG"
        admin.execute_command("CLIENT", "PAUSE", 1000, "ALL")
        with pytest.raises(TimeoutError):
            await pipe.call("GET", "x")
        admin.execute_command("CLIENT", "UNPAUSE")
        assert await pipe.call("PING") == b"PONG"
    finally:
        admin.execute_command("CLIENT", "UNPAUSE")
        admin.close()
        await pipe.aclose()
        await c.aclose()


async def test_no_pipelined_connection_stands_in_for_a_cluster_or_tls_client(redis_url: str) -> None:
    tls = redis_client("rediss://127.0.0.1:1/0", max_connections=4, pool_timeout_s=1.0)
    assert PipelinedRedis.of(tls) is None
    await tls.aclose()


async def test_a_closed_connection_refuses_calls(pipe: PipelinedRedis) -> None:
    await pipe.aclose()
    with pytest.raises(ConnectionError):
        await pipe.call("PING")


async def test_the_prefix_index_answers_alike_over_both_paths(client: aioredis.Redis, pipe: PipelinedRedis) -> None:
    writer = PrefixIndex(client, "tiny")
    await writer.add(W0, 1, HASHES[:10])
    await writer.add(W1, 1, HASHES[:30])
    plain, piped = PrefixIndex(client, "tiny"), PrefixIndex(client, "tiny", pipelined=pipe)
    workers = [(W0, Epoch(1)), (W1, Epoch(1))]
    expected = {W0: 10, W1: 30}
    assert await plain.matched_blocks(HASHES, workers) == expected
    assert await piped.matched_blocks(HASHES, workers) == expected
    assert await piped.lookup_soon(HASHES).matched_blocks(workers) == expected
    assert await plain.lookup_soon(HASHES).matched_blocks(workers) == expected
    # A slot given after the router read the table: read again, over either path.
    await writer.add(WorkerId("p2"), 1, HASHES[:5])
    workers.append((WorkerId("p2"), Epoch(1)))
    assert await piped.lookup_soon(HASHES).matched_blocks(workers) == {**expected, "p2": 5}
    await client.script_flush()  # a Redis that lost its scripts: the lookup loads it again
    assert await piped.lookup_soon(HASHES).matched_blocks(workers) == {**expected, "p2": 5}
    assert await piped.lookup_soon([]).matched_blocks(workers) == {}


async def test_an_early_lookup_nobody_reads_is_dropped_quietly(pipe: PipelinedRedis, client: aioredis.Redis,
                                                               caplog: pytest.LogCaptureFixture) -> None:
    piped = PrefixIndex(client, "tiny", pipelined=pipe)
    piped.lookup_soon(HASHES)
    await pipe.aclose()  # it fails unread
    await asyncio.sleep(0.05)
    assert "never retrieved" not in caplog.text


async def test_bookings_over_the_pipelined_connection(client: aioredis.Redis, pipe: PipelinedRedis) -> None:
    piped = KvReservations(client, "tiny", pipelined=pipe)
    plain = KvReservations(client, "tiny")
    caps = [DecodeCapacity(WorkerId("d0"), Epoch(1), 100)]
    first = await piped.reserve(BookingId("b1"), 60, caps, 10_000)
    assert (first.worker_id, first.blocks) == ("d0", 60)
    assert await plain.bookings(WorkerId("d0"), 1) == {"b1": 60}
    with pytest.raises(Exception, match="no decode worker has 50 free KV blocks"):
        await piped.reserve(BookingId("b2"), 50, caps, 10_000)
    await client.script_flush()
    assert await piped.release(first, urgent=True) == 60
    assert await plain.used(WorkerId("d0"), 1) == 0


async def test_tenant_limits_over_the_pipelined_connection(client: aioredis.Redis, pipe: PipelinedRedis) -> None:
    piped, plain = TenantLimiter(client, pipelined=pipe), TenantLimiter(client)
    limits = TenantLimits(requests_per_minute=10, prompt_tokens_per_minute=50, max_concurrent=1)
    grant = await piped.acquire("t", limits, "a", 30, 1)
    assert isinstance(grant, LimitGrant)
    refused = await plain.acquire("t", limits, "b", 10, 1)
    assert isinstance(refused, LimitRefusal) and refused.limit == "max_concurrent"
    await piped.settle(grant, 1)
    assert isinstance(await plain.acquire("t", limits, "c", 10, 1), LimitGrant)
    # Routers on either path share one exact count.
    rpm = TenantLimits(requests_per_minute=25)
    results = await asyncio.gather(*((piped if i % 2 else plain).acquire("r", rpm, f"r-{i}", 1, 1)
                                     for i in range(80)))
    assert sum(isinstance(r, LimitGrant) for r in results) == 25
