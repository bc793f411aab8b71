"""``pdrouter.wire.h2_grpc.H2GrpcServer``, the gRPC door's own server, against real ``grpc.aio`` clients
and raw HTTP/2 peers: what grpcio's server does for a client, this one must do too. (The door's
behaviour on both servers: ``tests/router/frontdoor/test_frontdoor_grpc.py``, ``test_input_bounds.py``,
``test_api_keys.py``; the limits: ``tests/wire/test_grpc_limits.py``.)"""

from __future__ import annotations

import asyncio
import contextlib
import random
import ssl
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pdrouter.core.tokenizer import ByteTokenizer
from pdrouter.router.frontdoor.grpc_api import SERVICE_NAME, RouterServicer, add_to_server
from pdrouter.testing.echo import ECHO, EchoDispatcher
from pdrouter.testing.grpc_probe import probe
from pdrouter.testing.pki import TestCa
from pdrouter.wire.grpc_limits import GrpcLimits
from pdrouter.wire.h2_grpc import PREFACE, UNARY_STREAM, H2Context, H2GrpcServer, HeaderDecoder, Method
from pdrouter.wire.v1 import common_pb2, router_pb2, router_pb2_grpc

WAIT_S = 20.0  # hang guard, not a latency bound


@dataclass
class Door:
    server: H2GrpcServer
    fake: EchoDispatcher
    channel: grpc.aio.Channel
    stub: router_pb2_grpc.RouterStub


async def _big(request: router_pb2.GenerateRequest, context: H2Context) -> None:
    """24 MB of answer in 1 MB messages, past any window a client announces."""
    for _ in range(24):
        await context.write(router_pb2.GenerateResponse(text="x" * 1_000_000))


async def _echo_metadata(request: router_pb2.GenerateRequest, context: H2Context) -> None:
    await context.write(router_pb2.GenerateResponse(text=repr(sorted(context.invocation_metadata()))))


def _codec() -> tuple[object, object]:
    return router_pb2.GenerateRequest.FromString, router_pb2.GenerateResponse.SerializeToString


async def _door(limits: GrpcLimits | None = None, tls: object = None) -> tuple[H2GrpcServer, EchoDispatcher]:
    fake = EchoDispatcher([ECHO])
    server = H2GrpcServer(limits=limits, tls=tls)  # type: ignore[arg-type]
    add_to_server(server, RouterServicer(fake, {ECHO.name: ByteTokenizer(ECHO.vocab_size)}))
    server.add_service("test.Extra", {"Big": Method(UNARY_STREAM, _big, *_codec()),  # type: ignore[arg-type]
                                      "Metadata": Method(UNARY_STREAM, _echo_metadata, *_codec())})  # type: ignore[arg-type]
    await server.start()
    return server, fake


@pytest.fixture
async def door() -> AsyncIterator[Door]:
    server, fake = await _door(GrpcLimits.for_door())
    async with grpc.aio.insecure_channel(server.address) as channel:
        yield Door(server, fake, channel, router_pb2_grpc.RouterStub(channel))
    await server.stop(0)


def _request(ids: list[int] | bytes, max_tokens: int = 3) -> router_pb2.GenerateRequest:
    return router_pb2.GenerateRequest(model=ECHO.name, token_ids=router_pb2.TokenIds(ids=list(ids)),
                                      sampling=common_pb2.SamplingParams(max_tokens=max_tokens, ignore_eos=True))


def _extra(channel: grpc.aio.Channel, name: str) -> grpc.aio.UnaryStreamMultiCallable:
    return channel.unary_stream(f"/test.Extra/{name}", request_serializer=router_pb2.GenerateRequest.SerializeToString,
                                response_deserializer=router_pb2.GenerateResponse.FromString)


async def _wait(condition: object) -> None:
    for _ in range(int(WAIT_S / 0.01)):
        if condition():  # type: ignore[operator]
            return
        await asyncio.sleep(0.01)
    raise AssertionError("condition not met in time")


async def test_calls_at_once_each_get_their_own_answer(door: Door) -> None:
    async def one(n: int) -> int:
        return sum([len(r.token_ids) async for r in door.stub.Generate(_request([1 + n % 7] * (n % 5 + 1), n % 4 + 1))])

    assert await asyncio.gather(*(one(n) for n in range(100))) == [n % 4 + 1 for n in range(100)]


async def test_more_than_the_windows_hold_passes_both_ways(door: Door) -> None:
    """A 24 MB answer on one stream, 20 MB of requests on one connection: each side's WINDOW_UPDATEs
    must be sent and honoured (the test fails or hangs if either is not)."""
    ids = [300] * 40_000  # 80 KB on the wire, above HTTP/2's initial 64 KiB window

    async def refused() -> grpc.StatusCode:
        with pytest.raises(grpc.aio.AioRpcError) as info:
            [r async for r in door.stub.Generate(_request(ids, 1), timeout=WAIT_S)]
        return info.value.code()

    for _ in range(16):  # read whole, then refused: the echo model's context is short
        assert set(await asyncio.gather(*(refused() for _ in range(16)))) == {grpc.StatusCode.INVALID_ARGUMENT}
    replies = [r async for r in _extra(door.channel, "Big")(_request([1]), timeout=WAIT_S)]
    assert [len(r.text) for r in replies] == [1_000_000] * 24


async def test_a_cancelled_call_and_a_deadline_cancel_the_request(door: Door) -> None:
    _, closed = door.fake.events("cancel")
    call = door.stub.Generate(_request(b"#stall:cancel", 100))  # two tokens, then waits forever
    await call.read()
    call.cancel()
    await _wait(closed.is_set)
    _, closed = door.fake.events("deadline")
    with pytest.raises(grpc.aio.AioRpcError) as info:
        [r async for r in door.stub.Generate(_request(b"#stall:deadline", 100), timeout=0.5)]
    assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    await _wait(closed.is_set)
    # The server keeps the deadline itself, for a client that does not (a raw HTTP/2 peer).
    _, closed = door.fake.events("raw")
    result = await probe("127.0.0.1", door.server.port, "call", metadata=(("grpc-timeout", "300m"),),
                         message=_request(b"#stall:raw", 100).SerializeToString(), wait_s=WAIT_S)
    assert (result.outcome, result.status) == ("ended", grpc.StatusCode.DEADLINE_EXCEEDED.value[0]), result
    await _wait(closed.is_set)
    assert len(door.fake.cancelled) == 3
    assert len([r async for r in door.stub.Generate(_request([1], 1))]) == 1  # serves on


async def test_metadata_reaches_the_handler_text_and_binary(door: Door) -> None:
    replies = [r async for r in _extra(door.channel, "Metadata")(
        _request([1]), metadata=(("x-plain", "value"), ("x-blob-bin", b"\x00\xffbytes")), timeout=WAIT_S)]
    seen = replies[0].text
    assert "('x-plain', 'value')" in seen and "('x-blob-bin', b'\\x00\\xffbytes')" in seen
    assert "content-type" not in seen and "user-agent" not in seen and ":path" not in seen


async def test_health_is_served_and_watched(door: Door) -> None:
    health = health_pb2_grpc.HealthStub(door.channel)
    for service in ("", SERVICE_NAME):
        reply = await health.Check(health_pb2.HealthCheckRequest(service=service), timeout=WAIT_S)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await health.Check(health_pb2.HealthCheckRequest(service="no.Such"), timeout=WAIT_S)
    assert info.value.code() == grpc.StatusCode.NOT_FOUND
    watch = health.Watch(health_pb2.HealthCheckRequest(service=SERVICE_NAME), timeout=WAIT_S)
    assert (await watch.read()).status == health_pb2.HealthCheckResponse.SERVING
    await door.server.not_serving()
    assert (await watch.read()).status == health_pb2.HealthCheckResponse.NOT_SERVING
    watch.cancel()


async def test_compressed_requests_are_unimplemented(door: Door) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as info:
        [r async for r in door.stub.Generate(_request([1] * 50), compression=grpc.Compression.Gzip, timeout=WAIT_S)]
    assert info.value.code() == grpc.StatusCode.UNIMPLEMENTED


async def test_calls_past_the_cap_in_flight_are_resource_exhausted() -> None:
    server, _ = await _door(GrpcLimits(max_inflight=1))
    try:
        async with grpc.aio.insecure_channel(server.address) as channel:
            stub = router_pb2_grpc.RouterStub(channel)
            stalled = stub.Generate(_request(b"#stall:one", 100))
            await stalled.read()
            with pytest.raises(grpc.aio.AioRpcError) as info:
                [r async for r in stub.Generate(_request([1], 1), timeout=WAIT_S)]
            assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            stalled.cancel()
            await _wait(lambda: server.inflight == 0)
            assert len([r async for r in stub.Generate(_request([1], 1), timeout=WAIT_S)]) == 1
    finally:
        await server.stop(0)


async def test_calls_reset_as_they_are_sent_leave_nothing_counted() -> None:
    """Streams opened and reset in the same write, many times (a "rapid reset"): no call stays counted
    in flight, so a server with a cap of one call serves the next."""
    import h2.config
    import h2.connection

    server, _ = await _door(GrpcLimits(max_inflight=1))
    try:
        conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
        conn.initiate_connection()
        message = _request([1], 1).SerializeToString()
        for _ in range(200):
            stream = conn.get_next_available_stream_id()
            conn.send_headers(stream, [(":method", "POST"), (":scheme", "http"), (":authority", "x"),
                                       (":path", f"/{SERVICE_NAME}/Generate"), ("content-type", "application/grpc")])
            conn.send_data(stream, b"\0" + len(message).to_bytes(4, "big") + message, end_stream=True)
            conn.reset_stream(stream)
        _, writer = await asyncio.open_connection("127.0.0.1", server.port)
        writer.write(conn.data_to_send())
        await writer.drain()
        await _wait(lambda: server.inflight == 0)
        async with grpc.aio.insecure_channel(server.address) as channel:
            stub = router_pb2_grpc.RouterStub(channel)
            for _ in range(3):
                assert len([r async for r in stub.Generate(_request([1], 1), timeout=WAIT_S)]) == 1
        writer.close()
    finally:
        await server.stop(0)


async def test_stop_lets_calls_finish_within_the_grace_then_ends_the_rest() -> None:
    server, fake = await _door()
    async with grpc.aio.insecure_channel(server.address) as channel:
        stub = router_pb2_grpc.RouterStub(channel)
        stalled = stub.Generate(_request(b"#stall:stop", 100))
        await stalled.read()
        await asyncio.wait_for(server.stop(0.3), WAIT_S)
        with pytest.raises(grpc.aio.AioRpcError) as info:
            while await stalled.read() is not grpc.aio.EOF:
                pass
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE
        await _wait(fake.events("stop")[1].is_set)
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            [r async for r in stub.Generate(_request([1], 1), timeout=2)]
        assert refused.value.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
    await asyncio.wait_for(server.wait(), WAIT_S)


@pytest.mark.parametrize("garbage", [
    b"\x00\x00\x04\x08\x00\x00\x00\x00\x00\x00\x00\x00\x00",  # a WINDOW_UPDATE of 0 on the connection
    b"\x00\x00\x05\x04\x00\x00\x00\x00\x00" + b"12345",  # SETTINGS of a size no setting has
    b"\x00\x00\x03\x01\x05\x00\x00\x00\x02" + b"\xff\xff\xff",  # HEADERS on an even stream, a bad block
    b"\x00\x00\x03\x01\x05\x00\x00\x00\x01" + b"\xff\xff\xff",  # HEADERS with a block HPACK cannot decode
    b"\x01\x00\x00\x00\x00\x00\x00\x00\x01",  # a frame past the maximum frame size
    b"\x00\x00\x00\x09\x04\x00\x00\x00\x01",  # CONTINUATION without HEADERS
])
async def test_broken_http2_closes_that_connection_only(door: Door, garbage: bytes) -> None:
    reader, writer = await asyncio.open_connection("127.0.0.1", door.server.port)
    writer.write(PREFACE + b"\x00\x00\x00\x04\x00\x00\x00\x00\x00" + garbage)
    received = b""
    while chunk := await asyncio.wait_for(reader.read(65536), WAIT_S):
        received += chunk
    assert b"\x07\x00\x00\x00\x00\x00" in received  # a GOAWAY on stream 0, then the close
    writer.close()
    assert len([r async for r in door.stub.Generate(_request([1], 1), timeout=WAIT_S)]) == 1


async def test_tls_serves_grpc_over_alpn_h2_and_refuses_plaintext(tmp_path: Path) -> None:
    tls = TestCa(tmp_path).issue("door")
    server, _ = await _door(tls=tls)
    try:
        assert tls.ca is not None
        credentials = grpc.ssl_channel_credentials(root_certificates=Path(tls.ca).read_bytes())
        async with grpc.aio.secure_channel(server.address, credentials) as channel:
            stub = router_pb2_grpc.RouterStub(channel)
            replies = [r async for r in stub.Generate(_request([7, 8], 2), timeout=WAIT_S)]
            assert sum(len(r.token_ids) for r in replies) == 2
        async with grpc.aio.insecure_channel(server.address) as plain:
            with pytest.raises(grpc.aio.AioRpcError) as info:
                [r async for r in router_pb2_grpc.RouterStub(plain).Generate(_request([1], 1), timeout=5)]
            assert info.value.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
        context = ssl.create_default_context(cafile=tls.ca)
        context.set_alpn_protocols(["h2"])
        _, writer = await asyncio.open_connection("127.0.0.1", server.port, ssl=context)
        assert writer.get_extra_info("ssl_object").selected_alpn_protocol() == "h2"
        writer.close()
    finally:
        await server.stop(0)


def test_a_taken_port_is_a_clear_error() -> None:
    async def bind_twice() -> None:
        first = H2GrpcServer()
        try:
            with pytest.raises(OSError, match=f"cannot bind gRPC server to 127.0.0.1:{first.port}"):
                H2GrpcServer(port=first.port)
        finally:
            await first.stop(0)

    asyncio.run(bind_twice())


async def test_random_frames_never_break_the_server(door: Door) -> None:
    """600 connections, each sending a valid call's headers or not and then random frames (every
    type, flag and stream id, payloads of any length): no exception escapes the server's reading,
    and it serves a real call after them."""
    import h2.config
    import h2.connection

    loop = asyncio.get_running_loop()
    escaped: list[object] = []
    loop.set_exception_handler(lambda _, context: escaped.append(context))
    client = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
    client.initiate_connection()
    client.send_headers(1, [(":method", "POST"), (":scheme", "http"), (":authority", "x"),
                            (":path", f"/{SERVICE_NAME}/Generate"), ("content-type", "application/grpc")])
    start = client.data_to_send()  # the preface, settings and one call's headers
    rng = random.Random(7)
    try:
        for n in range(600):
            data = start if n % 2 else start[:len(PREFACE) + 9]  # a call opened, or just the preface
            for _ in range(rng.randrange(1, 6)):
                payload = rng.randbytes(rng.choice([0, 1, 4, 5, 6, 8, 9, rng.randrange(64)]))
                kind, flags = rng.randrange(12), rng.choice([0, 1, 4, 5, 8, 0x20, 0x2D, rng.randrange(256)])
                stream = rng.choice([0, 1, 2, 3, rng.randrange(1 << 31)])
                data += len(payload).to_bytes(3, "big") + bytes((kind, flags)) + stream.to_bytes(4, "big") + payload
            reader, writer = await asyncio.open_connection("127.0.0.1", door.server.port)
            writer.write(data)
            with contextlib.suppress(TimeoutError, ConnectionError):  # until it closes, or 20 ms of quiet
                while await asyncio.wait_for(reader.read(65536), 0.02):
                    pass
            writer.close()
        assert len([r async for r in door.stub.Generate(_request([1], 1), timeout=WAIT_S)]) == 1
        await asyncio.sleep(0.1)
        assert not escaped, escaped[:3]
    finally:
        loop.set_exception_handler(None)


def test_a_remembered_header_block_is_decoded_anew_once_the_table_changed() -> None:
    """The same bytes mean other fields after an insertion shifts the table's indices: a block is
    taken from memory only while the table is as it was when the block was remembered."""
    from hpack import Encoder

    encoder, decoder = Encoder(), HeaderDecoder()
    first = [("x-a", "1")]
    assert decoder.decode(encoder.encode(first)) == first  # inserts x-a: 1 (index 62)
    indexed = encoder.encode(first)  # now one byte naming index 62: leaves the table as it was
    assert decoder.decode(indexed) == first and decoder.decode(indexed) == first  # the second from memory
    assert decoder.decode(encoder.encode([("x-b", "2")])) == [("x-b", "2")]  # inserts: 62 is now x-b
    assert decoder.decode(indexed) == [("x-b", "2")]
