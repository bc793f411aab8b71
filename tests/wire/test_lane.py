"""The worker lane over real sockets: calls, statuses, cancellation, deadlines, lost peers, bad input."""

from __future__ import annotations

import asyncio
import socket
import struct
from collections.abc import AsyncIterator

import grpc
import pytest

from pdrouter.core.errors import NotFoundError
from pdrouter.wire.grpc_util import from_rpc_error, grpc_errors
from pdrouter.wire.lane import ColocatedLane, DecodeLane, LaneChannel, LaneError, LaneServer, serve_servicer
from pdrouter.wire.lane.frames import (
    ALLOCATE,
    CALL,
    END,
    HEADER,
    HELLO,
    MAX_BODY,
    MAX_META_BYTES,
    META,
    encode_metadata,
)
from pdrouter.wire.v1 import common_pb2, worker_pb2, worker_pb2_grpc


class FakeDecode(worker_pb2_grpc.DecodeWorkerServicer):
    """Answers from the request alone; records what it started and what it closed."""

    def __init__(self) -> None:
        self.started: list[str] = []
        self.closed: list[str] = []
        self.metadata: dict[str, tuple[tuple[str, str], ...]] = {}
        self.contexts: dict[str, object] = {}

    @grpc_errors
    async def Allocate(self, request: worker_pb2.AllocateRequest, context: object) -> worker_pb2.AllocateResponse:
        self.metadata[request.request_id] = tuple(context.invocation_metadata())  # type: ignore[attr-defined]
        if request.request_id == "missing":
            raise NotFoundError("no such request")
        if request.request_id == "crash":
            raise RuntimeError("a bug")
        if request.request_id == "slow":
            await asyncio.sleep(30)
        return worker_pb2.AllocateResponse(num_blocks=len(request.prompt_token_ids))

    @grpc_errors
    async def Generate(self, request: worker_pb2.DecodeRequest,
                       context: object) -> AsyncIterator[common_pb2.TokenChunk]:
        self.started.append(request.request_id)
        self.contexts[request.request_id] = context
        push = request.request_id.startswith("push")
        try:
            for i in range(request.sampling.max_tokens):
                if request.request_id.startswith("stall") and i == 2:
                    await asyncio.sleep(30)
                chunk = common_pb2.TokenChunk(request_id=request.request_id, token_ids=[i])
                # "push": even tokens sent from outside the iteration (as a worker's engine sends them)
                if not (push and i % 2 == 0 and context.send_nowait(chunk)):  # type: ignore[attr-defined]
                    yield chunk
                await asyncio.sleep(0)
            yield common_pb2.TokenChunk(request_id=request.request_id, finish_reason=common_pb2.FINISH_REASON_LENGTH)
        finally:
            self.closed.append(request.request_id)

    async def Release(self, request: worker_pb2.ReleaseRequest, context: object) -> worker_pb2.ReleaseResponse:
        return worker_pb2.ReleaseResponse(released=True)


async def eventually(predicate: object, timeout: float = 5.0) -> None:
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout
    while not predicate():  # type: ignore[operator]
        assert loop.time() < end, "condition not met in time"
        await asyncio.sleep(0.01)


@pytest.fixture
async def served() -> AsyncIterator[tuple[LaneServer, FakeDecode, DecodeLane, LaneChannel]]:
    server = LaneServer()
    servicer = FakeDecode()
    serve_servicer(server, servicer)
    await server.start()
    channel = LaneChannel(server.address)
    yield server, servicer, DecodeLane(channel), channel
    await channel.close()
    await server.stop(grace=0.1)


def generate(rid: str, n: int) -> worker_pb2.DecodeRequest:
    return worker_pb2.DecodeRequest(request_id=rid, sampling=common_pb2.SamplingParams(max_tokens=n))


async def test_unary_and_streaming_calls_share_one_connection(served: tuple) -> None:
    server, servicer, stub, _channel = served
    resp = await stub.Allocate(worker_pb2.AllocateRequest(request_id="a", prompt_token_ids=[1, 2, 3]), timeout=5)
    assert resp.num_blocks == 3

    async def stream(i: int) -> list[int]:
        return [t for c in [c async for c in stub.Generate(generate(f"r{i}", i % 7))] for t in c.token_ids]

    results = await asyncio.gather(*(stream(i) for i in range(200)))
    assert results == [list(range(i % 7)) for i in range(200)]
    assert len(server._connections) == 1
    assert sorted(servicer.closed) == sorted(f"r{i}" for i in range(200))
    assert server.active_calls == 0
    assert (await stub.Release(worker_pb2.ReleaseRequest(request_id="a"))).released


async def test_messages_sent_from_outside_the_stream_keep_their_order(served: tuple) -> None:
    """``LaneContext.send_nowait``: a message sent while the handler waits goes out in its place, framed
    as the handler's own; once writes are paused, or the call is over, it is refused (False)."""
    server, servicer, stub, _ = served
    chunks = [c async for c in stub.Generate(generate("push-1", 9))]
    assert [t for c in chunks for t in c.token_ids] == list(range(9))
    assert chunks[-1].finish_reason == common_pb2.FINISH_REASON_LENGTH
    over = servicer.contexts["push-1"]
    assert over.send_nowait(common_pb2.TokenChunk(token_ids=[99])) is False  # the call ended
    (conn,) = server._connections
    conn._writable.clear()  # the connection's writes paused: every token is yielded, still in order
    paused = asyncio.ensure_future(stub.Generate(generate("push-2", 5)).__aiter__().__anext__())
    await eventually(lambda: "push-2" in servicer.contexts)
    assert servicer.contexts["push-2"].send_nowait(common_pb2.TokenChunk(token_ids=[99])) is False
    conn._writable.set()
    assert list((await paused).token_ids) == [0]
    await eventually(lambda: server.active_calls == 0)


async def test_errors_keep_their_grpc_status(served: tuple) -> None:
    server, _, stub, _ = served
    with pytest.raises(LaneError) as info:
        await stub.Allocate(worker_pb2.AllocateRequest(request_id="missing"))
    assert info.value.code() is grpc.StatusCode.NOT_FOUND and info.value.details() == "no such request"
    assert isinstance(from_rpc_error(info.value), NotFoundError)
    with pytest.raises(LaneError) as info:
        await stub.Allocate(worker_pb2.AllocateRequest(request_id="crash"))
    assert info.value.code() is grpc.StatusCode.UNKNOWN and "RuntimeError: a bug" in info.value.details()
    # A method the worker does not serve.
    with pytest.raises(LaneError) as info:
        await ColocatedLane(LaneChannel(server.address)).Generate(
            worker_pb2.WorkerGenerateRequest(request_id="x")).__aiter__().__anext__()
    assert info.value.code() is grpc.StatusCode.UNIMPLEMENTED
    # The server is still fine.
    assert (await stub.Allocate(worker_pb2.AllocateRequest(request_id="ok", prompt_token_ids=[1]))).num_blocks == 1


async def test_cancel_mid_stream_closes_the_handler(served: tuple) -> None:
    server, servicer, stub, _ = served
    call = stub.Generate(generate("stall-1", 5))
    got = []
    with pytest.raises(asyncio.CancelledError):  # as with a grpc.aio call cancelled by its caller
        async for chunk in call:
            got.extend(chunk.token_ids)
            if len(got) == 2:
                assert call.cancel()
    assert got == [0, 1]
    await eventually(lambda: "stall-1" in servicer.closed and server.active_calls == 0)
    assert not call.cancel()  # already over


async def test_a_stream_is_its_own_iterator_and_stays_ended(served: tuple) -> None:
    server, servicer, stub, _ = served
    call = stub.Generate(generate("r", 2))
    assert call.__aiter__() is call  # no async generator left for the garbage collector to finalize
    assert [c.token_ids[:] async for c in call] == [[0], [1], []]
    assert [c async for c in call] == []  # iterating an ended call ends at once
    assert call.done() and not call.cancel()
    # A consumer that leaves early ends the call with cancel(), as with grpc.aio.
    early = stub.Generate(generate("stall-2", 5))
    async for _chunk in early:
        break
    assert early.cancel()
    await eventually(lambda: "stall-2" in servicer.closed and server.active_calls == 0)
    # A call cancelled before it was ever iterated raises CancelledError, and never reaches the worker.
    never = stub.Generate(generate("never", 1))
    assert never.cancel()
    with pytest.raises(asyncio.CancelledError):
        async for _ in never:
            pass
    assert "never" not in servicer.started


async def test_a_cancelled_awaiting_task_cancels_the_call(served: tuple) -> None:
    server, _, stub, _ = served
    task = asyncio.ensure_future(stub.Allocate(worker_pb2.AllocateRequest(request_id="slow")))
    await eventually(lambda: server.active_calls == 1)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await eventually(lambda: server.active_calls == 0)


async def test_deadline_ends_the_call_on_both_sides(served: tuple) -> None:
    server, servicer, stub, _ = served
    with pytest.raises(LaneError) as info:
        async for _ in stub.Generate(generate("stall-2", 5), timeout=0.2):
            pass
    assert info.value.code() is grpc.StatusCode.DEADLINE_EXCEEDED
    await eventually(lambda: "stall-2" in servicer.closed and server.active_calls == 0)
    with pytest.raises(LaneError) as info:
        await stub.Allocate(worker_pb2.AllocateRequest(request_id="x"), timeout=0)
    assert info.value.code() is grpc.StatusCode.DEADLINE_EXCEEDED


async def test_a_lost_worker_fails_open_calls_and_the_channel_reconnects() -> None:
    server = LaneServer()
    servicer = FakeDecode()
    serve_servicer(server, servicer)
    await server.start()
    port = server.port
    channel = LaneChannel(server.address)
    stub = DecodeLane(channel)
    call = stub.Generate(generate("stall-3", 5))
    it = call.__aiter__()
    assert list((await it.__anext__()).token_ids) == [0]
    await server.stop(grace=0)  # the worker goes away mid-stream
    with pytest.raises(LaneError) as info:
        while True:
            await it.__anext__()
    assert info.value.code() is grpc.StatusCode.UNAVAILABLE
    with pytest.raises(LaneError) as info:
        await stub.Allocate(worker_pb2.AllocateRequest(request_id="a"))
    assert info.value.code() is grpc.StatusCode.UNAVAILABLE and str(port) in info.value.details()
    # Back on the same port: the next call reconnects by itself.
    server = LaneServer(port=port)
    serve_servicer(server, servicer)
    await server.start()
    assert (await stub.Allocate(worker_pb2.AllocateRequest(request_id="a", prompt_token_ids=[1, 2]))).num_blocks == 2
    await channel.close()
    await server.stop()


async def test_a_lost_router_cancels_its_calls(served: tuple) -> None:
    server, servicer, stub, channel = served
    call = stub.Generate(generate("stall-4", 5))
    it = call.__aiter__()
    await it.__anext__()
    await channel.close()
    await eventually(lambda: "stall-4" in servicer.closed and server.active_calls == 0)


async def test_refused_connection_is_unavailable() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(LaneError) as info:
        await DecodeLane(LaneChannel(f"127.0.0.1:{port}")).Allocate(worker_pb2.AllocateRequest(request_id="a"))
    assert info.value.code() is grpc.StatusCode.UNAVAILABLE


async def test_a_peer_that_does_not_speak_the_lane() -> None:
    async def wrong(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.read(8)
        writer.write(b"HTTP/1.1 400 Bad Request\r\n\r\n")
        await writer.drain()
        writer.close()

    other = await asyncio.start_server(wrong, "127.0.0.1", 0)
    port = other.sockets[0].getsockname()[1]
    with pytest.raises(LaneError) as info:
        await DecodeLane(LaneChannel(f"127.0.0.1:{port}")).Allocate(worker_pb2.AllocateRequest(request_id="a"))
    assert info.value.code() is grpc.StatusCode.FAILED_PRECONDITION
    other.close()
    await other.wait_closed()


async def raw(server: LaneServer, payload: bytes) -> bytes:
    reader, writer = await asyncio.open_connection(server.host, server.port)
    writer.write(payload)
    try:
        return await asyncio.wait_for(reader.read(), 5)
    finally:
        writer.close()


async def test_bad_frames_get_a_status_or_a_closed_connection(served: tuple) -> None:
    server, _, stub, _ = served
    # Wrong version: the server answers with what it speaks and hangs up.
    assert await raw(server, b"PDRL\x09\x00\x00\x00") == HELLO
    # A malformed request body: INVALID_ARGUMENT on that call.
    body = b"\xff\xff\xff"
    reply = await asyncio.wait_for(_one_reply(server, HEADER.pack(len(body), 7, CALL, ALLOCATE.id, 0, 0)
                                              + body), 5)
    _, stream, kind, code, _, _ = HEADER.unpack_from(reply)
    assert (stream, kind, code) == (7, END, grpc.StatusCode.INVALID_ARGUMENT.value[0])
    # A frame over the size limit: the connection is closed.
    huge = HEADER.pack(MAX_BODY + 1, 1, CALL, 1, 0, 0)
    assert await raw(server, HELLO + huge) == HELLO
    # Everyone else is unaffected.
    assert (await stub.Allocate(worker_pb2.AllocateRequest(request_id="ok", prompt_token_ids=[1]))).num_blocks == 1


async def _one_reply(server: LaneServer, frame: bytes) -> bytes:
    reader, writer = await asyncio.open_connection(server.host, server.port)
    writer.write(HELLO + frame)
    assert await reader.readexactly(len(HELLO)) == HELLO
    head = await reader.readexactly(HEADER.size)
    (length,) = struct.unpack_from("!I", head)
    reply = head + await reader.readexactly(length)
    writer.close()
    return reply


async def test_stop_lets_calls_finish_and_refuses_new_ones(served: tuple) -> None:
    server, _servicer, stub, _ = served
    it = stub.Generate(generate("r-drain", 50)).__aiter__()
    chunks = [await it.__anext__()]
    stopping = asyncio.ensure_future(server.stop(grace=5))
    chunks += [c async for c in it]
    assert [t for c in chunks for t in c.token_ids] == list(range(50))
    await stopping
    with pytest.raises(LaneError) as info:
        await stub.Allocate(worker_pb2.AllocateRequest(request_id="late"))
    assert info.value.code() is grpc.StatusCode.UNAVAILABLE


async def test_a_peer_that_never_answers_the_handshake_is_dropped() -> None:
    closed = asyncio.Event()

    async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.read()  # never answers; returns when the client hangs up
        closed.set()
        writer.close()

    other = await asyncio.start_server(silent, "127.0.0.1", 0)
    port = other.sockets[0].getsockname()[1]
    with pytest.raises(LaneError) as info:
        await DecodeLane(LaneChannel(f"127.0.0.1:{port}", connect_timeout_s=0.2)).Allocate(
            worker_pb2.AllocateRequest(request_id="a"))
    assert info.value.code() is grpc.StatusCode.UNAVAILABLE and "timed out" in info.value.details()
    await asyncio.wait_for(closed.wait(), 5)  # the half-open connection was not kept
    other.close()
    await other.wait_closed()


TRACEPARENT = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"


async def test_a_calls_metadata_reaches_its_handler_and_no_other(served: tuple) -> None:
    _, servicer, stub, _ = served
    context = [("traceparent", TRACEPARENT), ("tracestate", "vendor=a,other=b")]
    await stub.Allocate(worker_pb2.AllocateRequest(request_id="traced", prompt_token_ids=[1]), metadata=context)
    await stub.Allocate(worker_pb2.AllocateRequest(request_id="plain", prompt_token_ids=[1]))
    assert servicer.metadata == {"traced": tuple(context), "plain": ()}
    # A META frame applies to the CALL that follows it on its own stream only; one over the size limit
    # is ignored (the call is still served).
    body = worker_pb2.AllocateRequest(request_id="other-stream", prompt_token_ids=[1]).SerializeToString()
    meta = encode_metadata(context)
    await _one_reply(served[0], HEADER.pack(len(meta), 5, META, 0, 0, 0) + meta
                     + HEADER.pack(len(body), 7, CALL, ALLOCATE.id, 0, 0) + body)
    big = b"traceparent:" + b"x" * MAX_META_BYTES
    body = worker_pb2.AllocateRequest(request_id="too-big", prompt_token_ids=[1]).SerializeToString()
    await _one_reply(served[0], HEADER.pack(len(big), 7, META, 0, 0, 0) + big
                     + HEADER.pack(len(body), 7, CALL, ALLOCATE.id, 0, 0) + body)
    assert servicer.metadata["other-stream"] == () and servicer.metadata["too-big"] == ()
    with pytest.raises(ValueError, match="printable ASCII"):
        encode_metadata([("traceparent", "a\nb")])
    with pytest.raises(ValueError, match="lower-case"):
        encode_metadata([("TraceParent", TRACEPARENT)])
