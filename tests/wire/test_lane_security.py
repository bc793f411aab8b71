"""Who may use the worker lane, and what one connection may take of it, over real sockets to a
``LaneServer`` on a free port: the token's challenge-response (a missing or wrong token is
UNAUTHENTICATED and no handler runs), mutual TLS from a test PKI (``pdrouter.testing.pki``), and the
``LaneLimits`` (handshake deadline, per-frame deadline that trickling cannot move, buffered bytes,
connections).

Deadlines are small so that the tests run fast; the assertions are on outcomes (statuses, what a
raw peer read, what the server still holds), never on how long something took.
"""

from __future__ import annotations

import asyncio
import contextlib
import ssl
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest
import uvloop

from pdrouter.core.tls import TlsFiles
from pdrouter.testing.pki import TestCa
from pdrouter.wire.lane import DecodeLane, LaneChannel, LaneError, LaneLimits, LaneServer, serve_servicer
from pdrouter.wire.lane.frames import (
    ALLOCATE,
    AUTH,
    CALL,
    END,
    HEADER,
    HELLO,
    HELLO_AUTH,
    NONCE_SIZE,
    lane_proof,
)
from pdrouter.wire.v1 import worker_pb2

from .test_lane import FakeDecode

TOKEN = b"lane-test-token-0123456789abcdef"
WAIT_S = 20.0  # hang guard, not a latency bound


class Recording(FakeDecode):
    """Records every ``Allocate`` that reached its handler."""

    def __init__(self) -> None:
        super().__init__()
        self.allocated: list[str] = []

    async def Allocate(self, request: worker_pb2.AllocateRequest, context: object) -> worker_pb2.AllocateResponse:
        self.allocated.append(request.request_id)
        return await super().Allocate(request, context)


@contextlib.asynccontextmanager
async def serving(**kwargs: object) -> AsyncIterator[tuple[LaneServer, Recording]]:
    server = LaneServer(**kwargs)  # type: ignore[arg-type]
    servicer = Recording()
    serve_servicer(server, servicer)
    await server.start()
    try:
        async with asyncio.timeout(WAIT_S):
            yield server, servicer
    finally:
        await server.stop(grace=0.1)


async def allocate(channel: LaneChannel, rid: str = "a", tokens: int = 2) -> int:
    request = worker_pb2.AllocateRequest(request_id=rid, prompt_token_ids=list(range(tokens)))
    return (await DecodeLane(channel).Allocate(request, timeout=5)).num_blocks


async def refused(channel: LaneChannel, rid: str = "x") -> LaneError:
    with pytest.raises(LaneError) as info:
        await allocate(channel, rid)
    await channel.close()
    return info.value


async def eventually(predicate: object, timeout: float = WAIT_S) -> None:
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout
    while not predicate():  # type: ignore[operator]
        assert loop.time() < end, "condition not met in time"
        await asyncio.sleep(0.01)


async def read_frame(reader: asyncio.StreamReader) -> tuple[int, int, int, bytes]:
    length, stream, kind, arg, _, _ = HEADER.unpack(await reader.readexactly(HEADER.size))
    return stream, kind, arg, await reader.readexactly(length)


async def until_closed(reader: asyncio.StreamReader) -> bytes:
    got = b""
    with contextlib.suppress(ConnectionError):
        while chunk := await reader.read(65536):
            got += chunk
    return got


async def trickling(writer: asyncio.StreamWriter, byte: bytes, every_s: float) -> None:
    """Send ``byte`` every ``every_s`` until the connection is gone."""
    with contextlib.suppress(ConnectionError):
        while not writer.is_closing():
            writer.write(byte)
            await writer.drain()
            await asyncio.sleep(every_s)


# -- the token ----------------------------------------------------------------------------------


async def test_the_right_token_is_served() -> None:
    async with serving(token=TOKEN) as (server, servicer):
        channel = LaneChannel(server.address, token=TOKEN)
        assert await allocate(channel, "a", 3) == 3
        assert await allocate(channel, "b", 1) == 1  # the same connection
        assert len(server._connections) == 1 and servicer.allocated == ["a", "b"]
        await channel.close()


async def test_a_missing_or_wrong_token_is_unauthenticated_and_no_handler_runs() -> None:
    async with serving(token=TOKEN) as (server, servicer):
        missing = await refused(LaneChannel(server.address))
        assert missing.code() is grpc.StatusCode.UNAUTHENTICATED
        assert "requires the internal token" in missing.details()
        wrong = await refused(LaneChannel(server.address, token=b"another-token-0123456789abcdef"))
        assert wrong.code() is grpc.StatusCode.UNAUTHENTICATED and "wrong internal token" in wrong.details()
        await eventually(lambda: not server._connections)
        assert servicer.allocated == []
        # A token where none is asked for is harmless.
        async with serving() as (open_server, _):
            assert await allocate(LaneChannel(open_server.address, token=TOKEN)) == 2


async def test_a_raw_peer_is_served_nothing_before_its_proof() -> None:
    async with serving(token=TOKEN) as (server, servicer):
        body = worker_pb2.AllocateRequest(request_id="sneaky").SerializeToString()
        call = HEADER.pack(len(body), 1, CALL, ALLOCATE.id, 0, 0) + body
        # A call instead of the proof.
        reader, writer = await asyncio.open_connection(server.host, server.port)
        writer.write(HELLO + call)
        assert await reader.readexactly(len(HELLO)) == HELLO_AUTH
        stream, kind, _, nonce = await read_frame(reader)
        assert (stream, kind, len(nonce)) == (0, AUTH, NONCE_SIZE)
        stream, kind, code, reason = await read_frame(reader)
        assert (stream, kind, code) == (0, END, grpc.StatusCode.UNAUTHENTICATED.value[0])
        assert b"before proving it" in reason and await until_closed(reader) == b""
        writer.close()
        # A proof for another connection's challenge (a replay), with a call behind it.
        reader, writer = await asyncio.open_connection(server.host, server.port)
        writer.write(HELLO)
        await reader.readexactly(len(HELLO))
        await read_frame(reader)
        writer.write(HEADER.pack(32, 0, AUTH, 0, 0, 0) + lane_proof(TOKEN, nonce) + call)
        stream, kind, code, reason = await read_frame(reader)
        assert (stream, kind, code) == (0, END, grpc.StatusCode.UNAUTHENTICATED.value[0])
        assert b"wrong internal token" in reason
        writer.close()
        # The right proof: accepted, then the call is served.
        reader, writer = await asyncio.open_connection(server.host, server.port)
        writer.write(HELLO)
        await reader.readexactly(len(HELLO))
        _, _, _, nonce = await read_frame(reader)
        writer.write(HEADER.pack(32, 0, AUTH, 0, 0, 0) + lane_proof(TOKEN, nonce) + call)
        assert await read_frame(reader) == (0, AUTH, 0, b"")
        stream, kind, code, _ = await read_frame(reader)
        assert (stream, kind, code) == (1, END, grpc.StatusCode.OK.value[0])
        writer.close()
        assert servicer.allocated == ["sneaky"]


# -- limits -------------------------------------------------------------------------------------


async def test_the_handshake_deadline() -> None:
    async with serving(token=TOKEN, limits=LaneLimits(handshake_timeout_s=0.3)) as (server, _):
        # Silent, and greeting one byte at a time: closed without a word (it never spoke the lane).
        silent = await asyncio.open_connection(server.host, server.port)
        slow = await asyncio.open_connection(server.host, server.port)
        dribble = asyncio.ensure_future(trickling(slow[1], b"P", 0.05))
        assert await until_closed(silent[0]) == b""
        assert await until_closed(slow[0]) == b""
        await dribble
        # Greeted, never proving: told why.
        reader, writer = await asyncio.open_connection(server.host, server.port)
        writer.write(HELLO)
        assert await reader.readexactly(len(HELLO)) == HELLO_AUTH
        await read_frame(reader)
        stream, kind, code, reason = await read_frame(reader)
        assert (stream, kind, code) == (0, END, grpc.StatusCode.UNAUTHENTICATED.value[0])
        assert b"--lane-handshake-timeout" in reason
        for _, w in (silent, slow, (reader, writer)):
            w.close()
        await eventually(lambda: not server._connections)
        # A real client's handshake is well within it.
        assert await allocate(LaneChannel(server.address, token=TOKEN)) == 2


@pytest.mark.parametrize("token", [None, TOKEN])
async def test_a_trickled_frame_is_dropped_at_its_deadline_though_bytes_keep_coming(token: bytes | None) -> None:
    limits = LaneLimits(frame_timeout_s=0.5, frame_min_rate_bps=1 << 20)
    async with serving(token=token, limits=limits) as (server, servicer):
        reader, writer = await asyncio.open_connection(server.host, server.port)
        writer.write(HELLO)
        await reader.readexactly(len(HELLO))
        if token is not None:
            _, _, _, nonce = await read_frame(reader)
            writer.write(HEADER.pack(32, 0, AUTH, 0, 0, 0) + lane_proof(token, nonce))
            assert await read_frame(reader) == (0, AUTH, 0, b"")
        # Complete frames first (a cancel of nothing), then one that never completes.
        writer.write(HEADER.pack(0, 9, 4, 0, 0, 0) * 3 + HEADER.pack(100_000, 1, CALL, ALLOCATE.id, 0, 0) + b"x")
        dribble = asyncio.ensure_future(trickling(writer, b"x", 0.02))
        stream, kind, code, reason = await read_frame(reader)
        assert (stream, kind, code) == (0, END, grpc.StatusCode.UNAVAILABLE.value[0])
        assert b"did not complete" in reason and b"of 100016 bytes" in reason
        assert await until_closed(reader) == b""
        writer.close()
        await dribble
        await eventually(lambda: not server._connections)
        assert servicer.allocated == []
        # A large frame that arrives at a fair rate is served.
        assert await allocate(LaneChannel(server.address, token=token), "big", 300_000) == 300_000


async def test_buffered_bytes_are_capped_before_and_after_the_proof() -> None:
    limits = LaneLimits(max_buffered_bytes=64 * 1024)
    async with serving(token=TOKEN, limits=limits) as (server, servicer):
        # Before the proof: a frame over the few KiB allowed closes the connection before it is held.
        reader, writer = await asyncio.open_connection(server.host, server.port)
        writer.write(HELLO + HEADER.pack(8 * 1024, 0, AUTH, 0, 0, 0) + b"y" * 1024)
        assert await reader.readexactly(len(HELLO)) == HELLO_AUTH
        await read_frame(reader)
        assert await until_closed(reader) == b""
        writer.close()
        # After it: a call over the connection's cap loses the connection (UNAVAILABLE); the next reconnects.
        channel = LaneChannel(server.address, token=TOKEN)
        assert await allocate(channel, "small", 10) == 10
        with pytest.raises(LaneError) as info:
            await allocate(channel, "huge", 40_000)
        assert info.value.code() is grpc.StatusCode.UNAVAILABLE
        assert await allocate(channel, "after", 5) == 5
        await channel.close()
        assert servicer.allocated == ["small", "after"]


async def test_connections_past_the_cap_are_refused_with_a_reason() -> None:
    async with serving(token=TOKEN, limits=LaneLimits(max_connections=2)) as (server, servicer):
        first = [LaneChannel(server.address, token=TOKEN) for _ in range(2)]
        for channel in first:
            assert await allocate(channel) == 2
        for _ in range(3):
            error = await refused(LaneChannel(server.address, token=TOKEN))
            assert error.code() is grpc.StatusCode.UNAVAILABLE and "limit of 2 connections" in error.details()
        assert len(server._connections) == 2
        await first.pop().close()
        await eventually(lambda: len(server._connections) == 1)
        late = LaneChannel(server.address, token=TOKEN)
        assert await allocate(late, "late") == 2
        for channel in (*first, late):
            await channel.close()
        assert servicer.allocated.count("late") == 1


# -- TLS ----------------------------------------------------------------------------------------


@pytest.fixture
def certs(tmp_path: Path) -> dict[str, TlsFiles]:
    ca, other = TestCa(tmp_path, "cluster"), TestCa(tmp_path, "other")
    return {"worker": ca.issue("worker"),
            "router": ca.issue("router", "router.internal"),
            "stranger": other.issue("stranger", "router.internal", trust=ca),
            "impostor": other.issue("impostor")}


async def test_the_lane_over_mutual_tls(certs: dict[str, TlsFiles]) -> None:
    worker, router = certs["worker"], certs["router"]
    async with serving(token=TOKEN, ssl=worker.server_context()) as (server, servicer):
        channel = LaneChannel(server.address, token=TOKEN, ssl=router.client_context())
        assert await allocate(channel, "tls", 4) == 4
        conn = await channel.connection()
        assert conn.transport is not None and conn.transport.get_extra_info("ssl_object") is not None
        await channel.close()
        # TLS alone (no token) authenticates too.
        async with serving(ssl=worker.server_context()) as (tls_only, _):
            assert await allocate(LaneChannel(tls_only.address, ssl=router.client_context())) == 2
        assert servicer.allocated == ["tls"]


async def test_tls_refuses_strangers_and_plaintext(certs: dict[str, TlsFiles]) -> None:
    worker, router = certs["worker"], certs["router"]
    limits = LaneLimits(handshake_timeout_s=1.0)
    async with serving(ssl=worker.server_context(), limits=limits) as (server, servicer):
        # A client certificate from another CA.
        error = await refused(LaneChannel(server.address, ssl=certs["stranger"].client_context()))
        assert error.code() is grpc.StatusCode.UNAVAILABLE
        # No client certificate at all.
        bare = TlsFiles(ca=worker.ca).client_context()
        assert (await refused(LaneChannel(server.address, ssl=bare))).code() is grpc.StatusCode.UNAVAILABLE
        # Plaintext on the TLS port.
        assert (await refused(LaneChannel(server.address, connect_timeout_s=2.0))).code() \
            is grpc.StatusCode.UNAVAILABLE
        reader, writer = await asyncio.open_connection(server.host, server.port)
        writer.write(HELLO)
        assert HELLO not in await until_closed(reader)  # never greeted: the lane is not spoken in clear
        writer.close()
        assert servicer.allocated == []
        assert not server._connections
    # And the router side refuses a worker whose certificate is not from the CA.
    async with serving(ssl=certs["impostor"].server_context(require_client_cert=False)) as (impostor, served):
        error = await refused(LaneChannel(impostor.address, ssl=router.client_context()))
        assert error.code() is grpc.StatusCode.UNAVAILABLE and "certificate" in error.details().lower()
        assert served.allocated == []


def test_security_and_limits_on_uvloop(tmp_path: Path) -> None:
    """Workers run on uvloop (``pdrouter.cli.serve``): its transports and TLS behave alike."""
    async def main() -> str:
        await test_a_missing_or_wrong_token_is_unauthenticated_and_no_handler_runs()
        await test_a_trickled_frame_is_dropped_at_its_deadline_though_bytes_keep_coming(TOKEN)
        await test_connections_past_the_cap_are_refused_with_a_reason()
        ca = TestCa(tmp_path, "uvloop")
        worker, router = ca.issue("w", "127.0.0.1"), ca.issue("r", "router.internal")
        async with serving(token=TOKEN, ssl=worker.server_context()) as (server, _):
            assert await allocate(LaneChannel(server.address, token=TOKEN, ssl=router.client_context())) == 2
            error = await refused(LaneChannel(server.address, token=TOKEN))
            assert error.code() is grpc.StatusCode.UNAVAILABLE
        return type(asyncio.get_running_loop()).__module__

    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        assert runner.run(main()) == "uvloop"


def test_limits_are_checked() -> None:
    from pdrouter.core.errors import ConfigError

    for bad in ({"handshake_timeout_s": 0}, {"max_connections": 0}, {"max_preauth_bytes": 16},
                {"max_buffered_bytes": 1 << 40}, {"max_preauth_bytes": 8192, "max_buffered_bytes": 4096}):
        with pytest.raises(ConfigError):
            LaneLimits(**bad)
    with pytest.raises(ValueError):
        LaneServer(token=b"")
    assert isinstance(TlsFiles().client_context(), ssl.SSLContext)


def test_worker_flags_build_the_lane_limits() -> None:
    import argparse

    from pdrouter.cli.limits_flags import add_lane_limit_flags, lane_limits_from_args
    from pdrouter.core.errors import ConfigError

    parser = argparse.ArgumentParser()
    add_lane_limit_flags(parser)
    assert lane_limits_from_args(parser.parse_args([])) == LaneLimits()
    args = parser.parse_args(["--lane-handshake-timeout", "1.5", "--lane-frame-timeout", "3", "--lane-frame-min-rate",
                              "4096", "--lane-max-connections", "8", "--lane-max-buffered-bytes", "65536",
                              "--lane-max-preauth-bytes", "1024"])
    assert lane_limits_from_args(args) == LaneLimits(handshake_timeout_s=1.5, frame_timeout_s=3,
                                                     frame_min_rate_bps=4096, max_connections=8,
                                                     max_buffered_bytes=65536, max_preauth_bytes=1024)
    for argv in (["--lane-frame-timeout", "0"], ["--lane-max-connections", "0"],
                 ["--lane-max-buffered-bytes", str(1 << 30)], ["--lane-max-preauth-bytes", "8"],
                 ["--lane-max-buffered-bytes", "2048", "--lane-max-preauth-bytes", "4096"]):
        with pytest.raises(ConfigError) as info:
            lane_limits_from_args(parser.parse_args(argv))
        assert "--lane-" in info.value.message and "\n" not in info.value.message
