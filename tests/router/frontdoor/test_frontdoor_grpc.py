"""The gRPC front door on a real grpc.aio server (port 0), called through the generated stub."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass

import grpc
import pytest

from pdrouter.core.tokenizer import ByteTokenizer
from pdrouter.router.frontdoor.grpc_api import SERVICE_NAME, RouterServicer, add_to_server
from pdrouter.router.metrics import RouterMetrics
from pdrouter.testing.echo import CACHED_TOKENS, EOS, EchoDispatcher
from pdrouter.wire.grpc_util import GrpcServer, check_health
from pdrouter.wire.h2_grpc import H2GrpcServer
from pdrouter.wire.v1 import common_pb2, router_pb2, router_pb2_grpc

WAIT_S = 10.0  # hang guard, not a latency bound


@dataclass
class GrpcStack:
    fake: EchoDispatcher
    servicer: RouterServicer
    server: GrpcServer | H2GrpcServer
    stub: router_pb2_grpc.RouterStub

    def outcome(self, outcome: str) -> float:
        value = self.servicer.metrics.registry.get_sample_value(
            "pdrouter_requests_total", {"frontdoor": "grpc", "outcome": outcome})
        return value or 0.0


@pytest.fixture(params=["builtin", "grpcio"])
async def grpc_stack(request: pytest.FixtureRequest) -> AsyncIterator[GrpcStack]:
    """The door on each of its servers (``RouterConfig.grpc_server``)."""
    fake = EchoDispatcher(tokens_per_delta=2)
    servicer = RouterServicer(fake, {"echo": ByteTokenizer(512), "tiny": ByteTokenizer(512)},
                              metrics=RouterMetrics())
    server = H2GrpcServer() if request.param == "builtin" else GrpcServer()
    add_to_server(server, servicer)
    await server.start()
    async with grpc.aio.insecure_channel(server.address) as channel:
        yield GrpcStack(fake, servicer, server, router_pb2_grpc.RouterStub(channel))
    await server.stop(0)


def generate_request(prompt: str | list[int] = "hello", model: str = "echo", **sampling: object
                     ) -> router_pb2.GenerateRequest:
    params = common_pb2.SamplingParams(**sampling)  # type: ignore[arg-type]
    if isinstance(prompt, str):
        return router_pb2.GenerateRequest(model=model, text=prompt, sampling=params)
    return router_pb2.GenerateRequest(model=model, token_ids=router_pb2.TokenIds(ids=prompt), sampling=params)


async def collect(stack: GrpcStack, request: router_pb2.GenerateRequest,
                  timeout: float | None = None) -> list[router_pb2.GenerateResponse]:
    return [msg async for msg in stack.stub.Generate(request, timeout=timeout)]


async def test_generate_streams_tokens_text_and_usage(grpc_stack: GrpcStack) -> None:
    messages = await collect(grpc_stack, generate_request("héllo", max_tokens=20))
    ids = [t for m in messages for t in m.token_ids]
    assert ids == [*"héllo".encode(), EOS]
    assert [len(m.token_ids) for m in messages] == [2, 2, 2, 1]  # the fake sends two per delta
    # the first message ends inside "é": its text waits for the character's second byte
    assert [m.text for m in messages] == ["h", "él", "lo", ""]
    *head, last = messages
    assert all(m.finish_reason == common_pb2.FINISH_REASON_UNSPECIFIED for m in head)
    assert not any(m.HasField("usage") for m in head)
    assert last.finish_reason == common_pb2.FINISH_REASON_STOP
    assert (last.usage.prompt_tokens, last.usage.completion_tokens, last.usage.cached_tokens) == (
        7, 7, CACHED_TOKENS)
    assert len({m.request_id for m in messages}) == 1
    assert messages[0].request_id.startswith("req-")
    assert grpc_stack.outcome("ok") == 1


async def test_token_ids_prompt_request_id_and_sampling(grpc_stack: GrpcStack) -> None:
    request = generate_request([104, 105, 106], max_tokens=2, temperature=0.7, top_k=3, seed=9,
                               stop_token_ids=[7])
    request.request_id = "client-chosen-id"
    messages = await collect(grpc_stack, request, timeout=60)
    assert [t for m in messages for t in m.token_ids] == [104, 105]
    assert messages[-1].finish_reason == common_pb2.FINISH_REASON_LENGTH
    assert {m.request_id for m in messages} == {"client-chosen-id"}
    [seen] = grpc_stack.fake.requests
    # The client's id is a label: the request is keyed by a fresh id of the router's.
    assert seen.label == "client-chosen-id" and seen.request_id.startswith("req-")
    assert seen.prompt_token_ids == (104, 105, 106)
    assert (seen.sampling.temperature, seen.sampling.top_p, seen.sampling.top_k, seen.sampling.seed,
            seen.sampling.stop_token_ids) == (0.7, 1.0, 3, 9, (7,))
    assert seen.deadline is not None and seen.deadline > time.monotonic()


async def test_unset_max_tokens_takes_the_context_left(grpc_stack: GrpcStack) -> None:
    await collect(grpc_stack, generate_request("0123456789", model="tiny", ignore_eos=True))
    [seen] = grpc_stack.fake.requests
    assert seen.sampling.max_tokens == 24 - 11
    assert seen.sampling.seed is None and seen.deadline is None


@pytest.mark.parametrize(("request_", "code", "words"), [
    (router_pb2.GenerateRequest(model="echo"), grpc.StatusCode.INVALID_ARGUMENT, "prompt"),
    (router_pb2.GenerateRequest(text="hi"), grpc.StatusCode.INVALID_ARGUMENT, "model"),
    (generate_request([104, 999]), grpc.StatusCode.INVALID_ARGUMENT, "999"),
    (generate_request("hi", temperature=200), grpc.StatusCode.INVALID_ARGUMENT, "temperature"),
    (generate_request("hi", stop_token_ids=[5000]), grpc.StatusCode.INVALID_ARGUMENT, "stop_token_ids"),
    (generate_request("x" * 30, model="tiny"), grpc.StatusCode.INVALID_ARGUMENT, "context window"),
    (generate_request("x" * 10, model="tiny", max_tokens=20), grpc.StatusCode.INVALID_ARGUMENT, "31"),
    (router_pb2.GenerateRequest(model="echo", text="hi", request_id="r" * 200),
     grpc.StatusCode.INVALID_ARGUMENT, "request_id"),
    (generate_request("hi", model="gpt-9"), grpc.StatusCode.INVALID_ARGUMENT, "gpt-9"),
    (generate_request("#capacity"), grpc.StatusCode.RESOURCE_EXHAUSTED, "KV room"),
    (generate_request("#unavailable"), grpc.StatusCode.UNAVAILABLE, "reachable"),
    (generate_request("#deadline"), grpc.StatusCode.DEADLINE_EXCEEDED, "deadline"),
    (generate_request("#crash"), grpc.StatusCode.INTERNAL, "RuntimeError"),
])
async def test_errors_map_to_status_codes(grpc_stack: GrpcStack, request_: router_pb2.GenerateRequest,
                                          code: grpc.StatusCode, words: str) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as raised:
        await collect(grpc_stack, request_)
    assert raised.value.code() == code
    assert words in (raised.value.details() or "")
    ok = await collect(grpc_stack, generate_request("ok"))
    assert "".join(m.text for m in ok) == "ok"


async def test_error_mid_stream_ends_the_call_with_its_status(grpc_stack: GrpcStack) -> None:
    call = grpc_stack.stub.Generate(generate_request("#fail-after"))
    first = await call.read()
    assert isinstance(first, router_pb2.GenerateResponse) and first.text == "#f"
    with pytest.raises(grpc.aio.AioRpcError) as raised:
        await call.read()
    assert raised.value.code() == grpc.StatusCode.UNAVAILABLE
    assert grpc_stack.outcome("unavailable") == 1


@pytest.mark.parametrize("stall", ["stall", "stall0"])
async def test_cancelling_the_call_closes_the_dispatcher_stream(grpc_stack: GrpcStack, stall: str) -> None:
    tag = uuid.uuid4().hex
    started, closed = grpc_stack.fake.events(tag)
    call = grpc_stack.stub.Generate(generate_request(f"#{stall}:{tag}", max_tokens=50))
    if stall == "stall":
        first = await call.read()
        assert isinstance(first, router_pb2.GenerateResponse) and first.token_ids
    assert await asyncio.to_thread(started.wait, WAIT_S)
    assert not closed.is_set()
    call.cancel()
    assert await asyncio.to_thread(closed.wait, WAIT_S)
    assert [r.request_id for r in grpc_stack.fake.requests] == grpc_stack.fake.cancelled
    for _ in range(int(WAIT_S / 0.01)):
        if grpc_stack.outcome("cancelled") == 1:
            break
        await asyncio.sleep(0.01)
    assert grpc_stack.outcome("cancelled") == 1
    assert grpc_stack.servicer.metrics.registry.get_sample_value(
        "pdrouter_requests_in_flight", {"frontdoor": "grpc"}) == 0


async def test_list_models_and_health(grpc_stack: GrpcStack) -> None:
    response = await grpc_stack.stub.ListModels(router_pb2.ListModelsRequest())
    cards = {card.id: card for card in response.models}
    assert sorted(cards) == ["echo", "tiny"]
    assert (cards["echo"].geometry.max_context, cards["echo"].geometry.vocab_size, cards["echo"].block_size
            ) == (128, 512, 16)
    assert await check_health(grpc_stack.server.address, SERVICE_NAME)
