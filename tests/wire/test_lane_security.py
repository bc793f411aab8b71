"""Who may use the worker lane, and what one connection may take of it, over real sockets to a
``LaneServer`` on a free port: the token's challenge-response (a missing or wrong token is
UNAUTHENTICATED and no handler runs; the worker proves the token first, as its own address, so a
client sends nothing to a server that cannot, nor to a relay), mutual TLS from a test PKI
(``pdrouter.testing.pki``), and the ``LaneLimits`` (handshake deadline, per-frame deadline that
trickling cannot move, buffered bytes, connections, and the budget of connections not yet proved).

Deadlines are small so that the tests run fast; the assertions are on outcomes (statuses, what a
raw peer read, what the server still holds), never on how long something took.
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
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
    PROOF_SIZE,
    client_proof,
    server_proof,
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


def challenge(nonce: bytes) -> bytes:
    """A client's greeting and challenge."""
    return HELLO + HEADER.pack(NONCE_SIZE, 0, AUTH, 0, 0, 0) + nonce


async def prove(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, token: bytes, identity: str,
                after: bytes = b"") -> None:
    """The client's side of the handshake, raw: check the server's proof, send this side's (and ``after``)."""
    nonce = secrets.token_bytes(NONCE_SIZE)
    writer.write(challenge(nonce))
    assert await reader.readexactly(len(HELLO)) == HELLO_AUTH
    stream, kind, _, body = await read_frame(reader)
    assert (stream, kind) == (0, AUTH) and body[NONCE_SIZE + PROOF_SIZE:] == identity.encode()
    server_nonce = body[:NONCE_SIZE]
    assert body[NONCE_SIZE:NONCE_SIZE + PROOF_SIZE] == server_proof(token, nonce, server_nonce, identity)
    writer.write(HEADER.pack(PROOF_SIZE, 0, AUTH, 0, 0, 0) + client_proof(token, nonce, server_nonce, identity)
                 + after)


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
        # With another token, the worker's own proof fails first: the client sends no proof of its own.
        assert wrong.code() is grpc.StatusCode.UNAUTHENTICATED and "did not prove" in wrong.details()
        await eventually(lambda: not server._connections)
        assert servicer.allocated == []
        # A client with the token sends nothing to a lane that does not ask for it (nor proves it).
        async with serving() as (open_server, open_servicer):
            error = await refused(LaneChannel(open_server.address, token=TOKEN))
            assert error.code() is grpc.StatusCode.UNAUTHENTICATED and "does not ask" in error.details()
            assert open_servicer.allocated == []
            assert await allocate(LaneChannel(open_server.address)) == 2  # a client without one is served


async def test_a_raw_peer_is_served_nothing_before_its_proof() -> None:
    async with serving(token=TOKEN) as (server, servicer):
        body = worker_pb2.AllocateRequest(request_id="sneaky").SerializeToString()
        call = HEADER.pack(len(body), 1, CALL, ALLOCATE.id, 0, 0) + body
        # A call instead of the challenge: refused before the server proves anything.
        reader, writer = await asyncio.open_connection(server.host, server.port)
        writer.write(HELLO + call)
        assert await reader.readexactly(len(HELLO)) == HELLO
        stream, kind, code, reason = await read_frame(reader)
        assert (stream, kind, code) == (0, END, grpc.StatusCode.UNAUTHENTICATED.value[0])
        assert b"before proving it" in reason and await until_closed(reader) == b""
        writer.close()
        # A call instead of the proof.
        reader, writer = await asyncio.open_connection(server.host, server.port)
        writer.write(challenge(secrets.token_bytes(NONCE_SIZE)) + call)
        assert await reader.readexactly(len(HELLO)) == HELLO_AUTH
        stream, kind, _, answer = await read_frame(reader)
        assert (stream, kind, answer[NONCE_SIZE + PROOF_SIZE:]) == (0, AUTH, server.identity.encode())
        stream, kind, code, reason = await read_frame(reader)
        assert (stream, kind, code) == (0, END, grpc.StatusCode.UNAUTHENTICATED.value[0])
        assert b"before proving it" in reason and await until_closed(reader) == b""
        writer.close()
        # A proof for another connection's challenge (a replay), with a call behind it.
        nonce = secrets.token_bytes(NONCE_SIZE)
        reader, writer = await asyncio.open_connection(server.host, server.port)
        writer.write(challenge(nonce))
        await reader.readexactly(len(HELLO))
        _, _, _, answer = await read_frame(reader)
        replayed = client_proof(TOKEN, nonce, answer[:NONCE_SIZE], server.identity)
        reader, writer = await asyncio.open_connection(server.host, server.port)
        writer.write(challenge(nonce))
        await reader.readexactly(len(HELLO))
        await read_frame(reader)
        writer.write(HEADER.pack(PROOF_SIZE, 0, AUTH, 0, 0, 0) + replayed + call)
        stream, kind, code, reason = await read_frame(reader)
        assert (stream, kind, code) == (0, END, grpc.StatusCode.UNAUTHENTICATED.value[0])
        assert b"wrong internal token" in reason
        writer.close()
        # The right proof: accepted, then the call is served.
        reader, writer = await asyncio.open_connection(server.host, server.port)
        await prove(reader, writer, TOKEN, server.identity, after=call)
        assert await read_frame(reader) == (0, AUTH, 0, b"")
        stream, kind, code, _ = await read_frame(reader)
        assert (stream, kind, code) == (1, END, grpc.StatusCode.OK.value[0])
        writer.close()
        assert servicer.allocated == ["sneaky"]


class Impostor:
    """A raw TCP server at an address a registry record could name: ``relay_to`` another server
    (every byte both ways), else greeting as a lane that asks for the token and proving it with
    garbage. Records every byte clients sent it."""

    def __init__(self, relay_to: tuple[str, int] | None = None) -> None:
        self.relay_to = relay_to
        self.received = bytearray()
        self._server: asyncio.Server | None = None
        self.address = ""

    async def __aenter__(self) -> Impostor:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.address = f"127.0.0.1:{self._server.sockets[0].getsockname()[1]}"
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._server is not None
        self._server.close()

    async def _pump(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, record: bool) -> None:
        with contextlib.suppress(ConnectionError):
            while chunk := await reader.read(65536):
                if record:
                    self.received += chunk
                writer.write(chunk)
        writer.close()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self.relay_to is not None:
            upstream_reader, upstream_writer = await asyncio.open_connection(*self.relay_to)
            await asyncio.gather(self._pump(reader, upstream_writer, True), self._pump(upstream_reader, writer, False))
            return
        writer.write(HELLO_AUTH + HEADER.pack(NONCE_SIZE + PROOF_SIZE + len(self.address), 0, AUTH, 0, 0, 0)
                     + secrets.token_bytes(NONCE_SIZE + PROOF_SIZE) + self.address.encode())
        with contextlib.suppress(ConnectionError):
            while chunk := await reader.read(65536):
                self.received += chunk
        writer.close()


async def test_nothing_is_sent_to_a_server_that_cannot_prove_the_token() -> None:
    """A foreign server behind a forged registry record gets the client's challenge and nothing
    more: no proof it could replay, no call."""
    async with Impostor() as impostor:
        channel = LaneChannel(impostor.address, token=TOKEN)
        error = await refused(channel)
        assert error.code() is grpc.StatusCode.UNAUTHENTICATED and "did not prove" in error.details()
        await eventually(lambda: len(impostor.received) >= len(HELLO) + HEADER.size + NONCE_SIZE)
        assert len(impostor.received) == len(HELLO) + HEADER.size + NONCE_SIZE


async def test_a_relay_to_a_real_worker_is_refused() -> None:
    """A record naming a relay in front of a real worker: the worker proves itself as its own
    address, which is not the relay's, so the client stops there; the worker serves nothing."""
    async with serving(token=TOKEN) as (server, servicer), Impostor((server.host, server.port)) as relay:
        error = await refused(LaneChannel(relay.address, token=TOKEN))
        assert error.code() is grpc.StatusCode.UNAUTHENTICATED
        assert f"answers as {server.identity}" in error.details()
        assert len(relay.received) == len(HELLO) + HEADER.size + NONCE_SIZE  # the challenge, no proof
        assert servicer.allocated == []
    # A worker that advertises another host than the one dialled is refused the same way.
    async with serving(token=TOKEN, advertise_host="10.255.0.1") as (server, servicer):
        error = await refused(LaneChannel(server.address, token=TOKEN))
        assert error.code() is grpc.StatusCode.UNAUTHENTICATED and "answers as 10.255.0.1:" in error.details()
        assert servicer.allocated == []


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
        # Greeted without a challenge, or challenged and never proving: told why.
        reader, writer = await asyncio.open_connection(server.host, server.port)
        writer.write(HELLO)
        assert await reader.readexactly(len(HELLO)) == HELLO
        stream, kind, code, reason = await read_frame(reader)
        assert (stream, kind, code) == (0, END, grpc.StatusCode.UNAUTHENTICATED.value[0])
        assert b"--lane-handshake-timeout" in reason
        writer.close()
        reader, writer = await asyncio.open_connection(server.host, server.port)
        writer.write(challenge(secrets.token_bytes(NONCE_SIZE)))
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
        if token is not None:
            await prove(reader, writer, token, server.identity)
            assert await read_frame(reader) == (0, AUTH, 0, b"")
        else:
            writer.write(challenge(secrets.token_bytes(NONCE_SIZE)))
            assert await reader.readexactly(len(HELLO)) == HELLO
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


async def test_connections_without_the_token_cannot_lock_the_router_out() -> None:
    """The cap's worth of silent connections: the oldest not yet proved is closed to let a client
    with the token in; a connection that proved it is never closed for room."""
    limits = LaneLimits(max_connections=8, handshake_timeout_s=60)
    async with serving(token=TOKEN, limits=limits) as (server, servicer):
        kept = LaneChannel(server.address, token=TOKEN)
        assert await allocate(kept, "kept") == 2
        silent = [await asyncio.open_connection(server.host, server.port) for _ in range(12)]
        await eventually(lambda: len(server._unproven) == limits.unauthenticated_budget)
        newcomer = LaneChannel(server.address, token=TOKEN)
        assert await allocate(newcomer, "newcomer") == 2
        assert await allocate(kept, "kept again") == 2  # the same connection all along
        assert servicer.allocated == ["kept", "newcomer", "kept again"]
        for reader, _ in silent[:-1]:  # all but the last were closed for room, the newcomer's included
            assert await until_closed(reader) == b""
        for _, writer in silent:
            writer.close()
        for channel in (kept, newcomer):
            await channel.close()


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
    assert LaneLimits(max_connections=8).unauthenticated_budget == 2
    assert lane_limits_from_args(parser.parse_args(["--lane-max-unauthenticated-connections", "5"])) \
        == LaneLimits(max_unauthenticated_connections=5)
    for argv in (["--lane-frame-timeout", "0"], ["--lane-max-connections", "0"],
                 ["--lane-max-connections", "8", "--lane-max-unauthenticated-connections", "9"],
                 ["--lane-max-buffered-bytes", str(1 << 30)], ["--lane-max-preauth-bytes", "8"],
                 ["--lane-max-buffered-bytes", "2048", "--lane-max-preauth-bytes", "4096"]):
        with pytest.raises(ConfigError) as info:
            lane_limits_from_args(parser.parse_args(argv))
        assert "--lane-" in info.value.message and "\n" not in info.value.message
