"""The limits of every gRPC server (``pdrouter.wire.grpc_limits.GrpcLimits``), over real sockets to
a ``GrpcServer`` on a free port, with raw HTTP/2 peers (``pdrouter.testing.grpc_probe``): silent
and trickled handshakes closed at their deadline, idle and old connections closed, connections past
the cap closed on arrival, the stream cap announced, oversized messages and headers refused, and
calls without credentials refused before a byte of their message is read, however large or slow.

Deadlines are small so that the tests run fast; the assertions are on outcomes (what the peer
read, the status it got), never on how long something took.
"""

from __future__ import annotations

import argparse
import asyncio
from collections.abc import AsyncIterator

import grpc
import pytest

from pdrouter.cli.limits_flags import add_grpc_limit_flags, grpc_limits_from_args
from pdrouter.core.errors import ConfigError
from pdrouter.core.tokenizer import ByteTokenizer
from pdrouter.router.frontdoor.auth import ApiKeys
from pdrouter.router.frontdoor.grpc_api import DOOR_SERVERS, RouterServicer, add_to_server, door_server
from pdrouter.testing.echo import EchoDispatcher
from pdrouter.testing.grpc_probe import probe
from pdrouter.wire.grpc_limits import GrpcLimits
from pdrouter.wire.grpc_util import GrpcServer
from pdrouter.wire.h2_grpc import H2GrpcServer
from pdrouter.wire.security import TokenInterceptor
from pdrouter.wire.v1 import common_pb2, router_pb2, router_pb2_grpc

KEY = "grpc-limits-key-0123456789"
WAIT_S = 20.0  # hang guard, not a latency bound
UNAUTHENTICATED = grpc.StatusCode.UNAUTHENTICATED.value[0]
SETTINGS_MAX_CONCURRENT_STREAMS = 0x3


async def door(limits: GrpcLimits, kind: str = "grpcio", keys: ApiKeys | None = None,
               interceptors: tuple[grpc.aio.ServerInterceptor, ...] = ()) -> GrpcServer | H2GrpcServer:
    """The door on server ``kind`` (``interceptors``: a grpcio server's, e.g. a worker port's)."""
    server = GrpcServer(limits=limits, interceptors=interceptors) if interceptors else door_server(
        kind, limits=limits, keys=keys)
    add_to_server(server, RouterServicer(EchoDispatcher(), {"echo": ByteTokenizer()}))
    await server.start()
    return server


@pytest.fixture(params=DOOR_SERVERS)
def kind(request: pytest.FixtureRequest) -> str:
    """Each of the door's servers."""
    return str(request.param)


@pytest.fixture
async def keyed(kind: str) -> AsyncIterator[GrpcServer | H2GrpcServer]:
    server = await door(GrpcLimits.for_door(), kind, ApiKeys([KEY]))
    yield server
    await server.stop(0)


def generate(text: str = "hi") -> router_pb2.GenerateRequest:
    return router_pb2.GenerateRequest(model="echo", text=text, sampling=common_pb2.SamplingParams(max_tokens=2))


@pytest.mark.parametrize("how", ["huge", "slow"])
async def test_calls_without_a_key_are_refused_before_their_message_is_read(keyed: GrpcServer | H2GrpcServer,
                                                                            how: str) -> None:
    """A call announcing 60 MiB, pushed as fast as it may or a byte every half second: refused
    UNAUTHENTICATED while most of its message has not been sent (so it was not waited for)."""
    for metadata in ((), (("authorization", "Bearer wrong-key-0123456789"),)):
        result = await probe("127.0.0.1", keyed.port, how, metadata=metadata, wait_s=WAIT_S)
        assert (result.outcome, result.status) == ("ended", UNAUTHENTICATED), result
        assert result.sent < 4 << 20


async def test_the_internal_secret_is_checked_before_the_message_too() -> None:
    """A worker port (the internal secret's interceptor) refuses the same calls the same way."""
    interceptor = TokenInterceptor("internal-secret-0123456789")
    server = await door(GrpcLimits(), interceptors=(interceptor,))
    try:
        result = await probe("127.0.0.1", server.port, "slow", wait_s=WAIT_S)
        assert (result.outcome, result.status) == ("ended", UNAUTHENTICATED) and result.sent < 16
        assert "proof of the internal secret" in result.message
    finally:
        await server.stop(0)


async def test_handshakes_have_a_deadline_however_they_trickle(kind: str) -> None:
    server = await door(GrpcLimits(handshake_timeout_s=0.5, idle_timeout_s=60), kind)
    try:
        silent, trickled = await asyncio.gather(
            probe("127.0.0.1", server.port, "silent", wait_s=WAIT_S),
            probe("127.0.0.1", server.port, "slow-preface", trickle_s=0.1, wait_s=WAIT_S))
        assert silent.outcome == "closed" and trickled.outcome == "closed"
    finally:
        await server.stop(0)


async def test_idle_and_old_connections_are_closed(kind: str) -> None:
    server = await door(GrpcLimits(idle_timeout_s=0.5), kind)
    try:
        idle = await probe("127.0.0.1", server.port, "idle", wait_s=WAIT_S)
        assert idle.outcome == "closed"
    finally:
        await server.stop(0)
    # A connection kept busy is not idle, and still goes at its age (after the grace for its calls).
    server = await door(GrpcLimits(max_connection_age_s=0.5, max_connection_age_grace_s=0.5), kind)
    try:
        async with grpc.aio.insecure_channel(server.address) as channel:
            stub = router_pb2_grpc.RouterStub(channel)
            seen: set[str] = set()
            loop = asyncio.get_running_loop()
            end = loop.time() + WAIT_S
            while len(seen) < 2 and loop.time() < end:  # two connections: the first was aged out
                [message async for message in stub.Generate(generate())]
                seen.add(str(channel.get_state()))
                await asyncio.sleep(0.05)
                if channel.get_state() is not grpc.ChannelConnectivity.READY:
                    seen.add("reconnected")
            assert "reconnected" in seen
    finally:
        await server.stop(0)


async def test_connections_past_the_cap_are_closed_on_arrival(kind: str) -> None:
    server = await door(GrpcLimits(max_connections=3, idle_timeout_s=60), kind)
    try:
        results = await asyncio.gather(*(probe("127.0.0.1", server.port, "idle", wait_s=2.0) for _ in range(5)))
        outcomes = sorted(r.outcome for r in results)
        assert outcomes == ["closed", "closed", "open", "open", "open"]
    finally:
        await server.stop(0)


async def test_streams_per_connection_are_announced(keyed: GrpcServer | H2GrpcServer) -> None:
    result = await probe("127.0.0.1", keyed.port, "idle", wait_s=1.0)
    assert result.settings.get(SETTINGS_MAX_CONCURRENT_STREAMS) == GrpcLimits.for_door().max_streams


async def test_oversized_messages_and_headers_are_refused(keyed: GrpcServer | H2GrpcServer) -> None:
    auth = (("authorization", f"Bearer {KEY}"),)
    async with grpc.aio.insecure_channel(keyed.address, options=[("grpc.max_send_message_length", -1)]) as channel:
        stub = router_pb2_grpc.RouterStub(channel)
        with pytest.raises(grpc.aio.AioRpcError) as too_big:
            [m async for m in stub.Generate(generate("x" * (17 << 20)), metadata=auth)]
        assert too_big.value.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
        with pytest.raises(grpc.aio.AioRpcError) as headers:
            [m async for m in stub.Generate(generate(), metadata=(*auth, ("x-padding", "p" * 20_000)))]
        assert headers.value.code() is not grpc.StatusCode.OK
        assert [m async for m in stub.Generate(generate(), metadata=auth)][-1].finish_reason  # still serving


def test_limits_are_checked_and_flags_build_them() -> None:
    for bad in ({"handshake_timeout_s": 0}, {"max_connections": 0}, {"max_streams": 1 << 31},
                {"max_inflight": 0}, {"max_metadata_bytes": 100}):
        with pytest.raises(ConfigError):
            GrpcLimits(**bad)  # type: ignore[arg-type]
    parser = argparse.ArgumentParser()
    add_grpc_limit_flags(parser, GrpcLimits.for_door(), "a door")
    assert grpc_limits_from_args(parser.parse_args([])) == GrpcLimits.for_door()
    args = parser.parse_args(["--grpc-handshake-timeout", "2", "--grpc-idle-timeout", "9", "--grpc-max-connections",
                              "10", "--grpc-max-streams", "4", "--grpc-max-inflight", "0",
                              "--grpc-max-message-bytes", "4096"])
    assert grpc_limits_from_args(args) == GrpcLimits(handshake_timeout_s=2, idle_timeout_s=9, max_connections=10,
                                                     max_streams=4, max_inflight=None, max_message_bytes=4096)
    for argv in (["--grpc-idle-timeout", "0"], ["--grpc-max-connections", "0"], ["--grpc-max-inflight", "-1"]):
        with pytest.raises(ConfigError) as info:
            grpc_limits_from_args(parser.parse_args(argv))
        assert "--grpc-" in info.value.message
