"""``benchmarks/_h2_grpc.py``, the purpose-built gRPC server ``frontdoor_bench.py`` measures a door on:
a real ``grpc.aio`` client gets the answers, statuses and flow control a gRPC server owes it, so that
the CPU figures measured on it are those of a server that does its job."""

from __future__ import annotations

import asyncio
import importlib
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from types import ModuleType

import grpc
import pytest

from pdrouter.core.tokenizer import ByteTokenizer
from pdrouter.router.frontdoor.grpc_api import SERVICE_NAME, RouterServicer
from pdrouter.testing.echo import ECHO, EchoDispatcher
from pdrouter.wire.v1 import common_pb2, router_pb2, router_pb2_grpc

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "_h2_grpc.py"
GENERATE = f"/{SERVICE_NAME}/Generate"


@pytest.fixture(scope="module")
def h2() -> ModuleType:
    sys.path.insert(0, str(BENCH.parent))
    return importlib.import_module(BENCH.stem)


@pytest.fixture
async def door(h2: ModuleType) -> AsyncIterator[tuple[router_pb2_grpc.RouterStub, EchoDispatcher]]:
    """The router's gRPC servicer over the echo model, on the purpose-built server, and a client."""
    dispatcher = EchoDispatcher([ECHO])
    servicer = RouterServicer(dispatcher, {ECHO.name: ByteTokenizer(ECHO.vocab_size)})

    async def big(request: router_pb2.GenerateRequest, context: object) -> None:  # a large answer: 24 MB
        for _ in range(24):
            await context.write(router_pb2.GenerateResponse(text="x" * 1_000_000))  # type: ignore[attr-defined]

    server = await h2.start({GENERATE: (h2.UNARY_STREAM, router_pb2.GenerateRequest, servicer.Generate),
                             f"/{SERVICE_NAME}/Big": (h2.UNARY_STREAM, router_pb2.GenerateRequest, big)},
                            "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = router_pb2_grpc.RouterStub(channel)
        stub.channel = channel  # type: ignore[attr-defined]
        yield stub, dispatcher
    server.close()


def _request(ids: list[int], max_tokens: int = 3, model: str = ECHO.name) -> router_pb2.GenerateRequest:
    return router_pb2.GenerateRequest(model=model, token_ids=router_pb2.TokenIds(ids=ids),
                                      sampling=common_pb2.SamplingParams(max_tokens=max_tokens, ignore_eos=True))


async def test_the_doors_servicer_streams_its_answer(door: tuple[router_pb2_grpc.RouterStub, EchoDispatcher]) -> None:
    stub, _ = door
    replies = [r async for r in stub.Generate(_request([5, 6, 7, 8], 3), timeout=10)]
    assert sum(len(r.token_ids) for r in replies) == 3
    assert replies[-1].finish_reason == common_pb2.FINISH_REASON_LENGTH
    assert replies[-1].usage.prompt_tokens == 4


async def test_many_calls_at_once_each_get_their_own_answer(
        door: tuple[router_pb2_grpc.RouterStub, EchoDispatcher]) -> None:
    stub, _ = door

    async def one(n: int) -> int:
        return sum([len(r.token_ids) async for r in stub.Generate(_request([1 + n % 7] * (n % 5 + 1), n % 4 + 1))])

    assert await asyncio.gather(*(one(n) for n in range(64))) == [n % 4 + 1 for n in range(64)]


async def test_a_bad_request_ends_with_the_servicers_status_and_message(
        door: tuple[router_pb2_grpc.RouterStub, EchoDispatcher]) -> None:
    stub, _ = door
    with pytest.raises(grpc.aio.AioRpcError) as info:
        [r async for r in stub.Generate(_request([1, 2], model="no-such-model"))]
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "'no-such-model' does not exist" in (info.value.details() or "")
    replies = [r async for r in stub.Generate(_request([1, 2], 1))]  # the connection serves on
    assert len(replies) == 1


async def test_an_unknown_method_is_unimplemented(door: tuple[router_pb2_grpc.RouterStub, EchoDispatcher]) -> None:
    stub, _ = door
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await stub.ListModels(router_pb2.ListModelsRequest())
    assert info.value.code() == grpc.StatusCode.UNIMPLEMENTED


async def test_more_than_the_windows_hold_passes_both_ways(
        door: tuple[router_pb2_grpc.RouterStub, EchoDispatcher]) -> None:
    """24 MB of answer on one stream and 21 MB of requests on one connection: past every window either
    side announces, so each side's WINDOW_UPDATEs must be sent and honoured."""
    stub, _ = door
    ids = [300] * 40_000  # 80 KB on the wire (two bytes an id), above HTTP/2's initial 64 KiB window

    async def refused() -> grpc.StatusCode:
        with pytest.raises(grpc.aio.AioRpcError) as info:
            [r async for r in stub.Generate(_request(ids, 1), timeout=20)]
        return info.value.code()

    for _ in range(16):  # 256 requests, each read whole and refused: the echo model's context is short
        assert set(await asyncio.gather(*(refused() for _ in range(16)))) == {grpc.StatusCode.INVALID_ARGUMENT}
    channel = stub.channel  # type: ignore[attr-defined]
    big = channel.unary_stream(f"/{SERVICE_NAME}/Big", request_serializer=router_pb2.GenerateRequest.SerializeToString,
                               response_deserializer=router_pb2.GenerateResponse.FromString)
    replies = [r async for r in big(_request([1], 1), timeout=20)]
    assert [len(r.text) for r in replies] == [1_000_000] * 24


async def test_a_cancelled_call_cancels_its_request(door: tuple[router_pb2_grpc.RouterStub, EchoDispatcher]) -> None:
    stub, dispatcher = door
    started, closed = dispatcher.events("h2")
    call = stub.Generate(_request(list(b"#stall:h2"), 100))  # two tokens, then waits forever
    await call.read()
    assert started.is_set()
    call.cancel()
    for _ in range(500):
        if closed.is_set():
            break
        await asyncio.sleep(0.01)
    assert closed.is_set() and len(dispatcher.cancelled) == 1
