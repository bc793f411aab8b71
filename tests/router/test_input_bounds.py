"""Every numeric field of a request is bounded at both front doors: a value out of range is a 400
naming the field (gRPC: INVALID_ARGUMENT), and whatever is accepted fits the wire to the workers.

The doors serve the echo dispatcher (``pdrouter.testing.echo``) on real servers and sockets.
"""

from __future__ import annotations

import json
import math
from collections.abc import AsyncIterator
from typing import Any

import grpc
import httpx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pdrouter.core.errors import InvalidRequestError
from pdrouter.core.sampling import MAX_STOP_TOKEN_IDS, MAX_TOP_K, SamplingParams
from pdrouter.core.tokenizer import ByteTokenizer
from pdrouter.router.frontdoor.grpc_api import DOOR_SERVERS, SERVICE_NAME, RouterServicer, add_to_server, door_server
from pdrouter.router.frontdoor.http_api import HttpFrontdoor
from pdrouter.router.frontdoor.openai_schema import MAX_STOP_CHARS
from pdrouter.router.metrics import RouterMetrics
from pdrouter.testing.echo import EchoDispatcher
from pdrouter.testing.http import serving
from pdrouter.wire.convert import sampling_from_pb, sampling_to_pb
from pdrouter.wire.v1 import common_pb2, router_pb2, router_pb2_grpc

TOKENIZERS = {"echo": ByteTokenizer(512), "tiny": ByteTokenizer(512)}
PROMPT = {"model": "echo", "prompt": "hi"}
CHAT = {"model": "echo", "messages": [{"role": "user", "content": "hi"}]}


class Http:
    def __init__(self, fake: EchoDispatcher, client: httpx.AsyncClient) -> None:
        self.fake = fake
        self.client = client

    async def post(self, body: dict[str, Any], chat: bool = False) -> httpx.Response:
        path = "/v1/chat/completions" if chat else "/v1/completions"
        return await self.client.post(path, content=json.dumps(body).encode(),
                                      headers={"content-type": "application/json"})


@pytest.fixture
async def http() -> AsyncIterator[Http]:
    fake = EchoDispatcher()
    door = HttpFrontdoor(fake, TOKENIZERS, metrics=RouterMetrics())
    async with serving(door.app) as (_, port), httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as client:
        yield Http(fake, client)


def assert_refused(response: httpx.Response, field: str) -> None:
    """A 400 in OpenAI's error shape whose ``param`` or message names ``field``."""
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error"
    assert error["param"] == field or field in error["message"], error


# -- HTTP ------------------------------------------------------------------------------------

REFUSED: list[tuple[dict[str, Any], str]] = [
    ({"top_k": 2**33}, "top_k"),
    ({"top_k": MAX_TOP_K + 1}, "top_k"),
    ({"top_k": -2}, "top_k"),
    ({"top_k": 2**64}, "top_k"),
    ({"top_k": 1.5}, "top_k"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_tokens": -1}, "max_tokens"),
    ({"max_tokens": 2**64}, "max_tokens"),
    ({"max_tokens": 10**30}, "max_tokens"),
    ({"max_tokens": 126}, "max_tokens"),  # <bos>hi: 3 tokens, and the echo model's context is 128
    ({"n": 2}, "n"),
    ({"n": 0}, "n"),
    ({"n": -1}, "n"),
    ({"n": 2**40}, "n"),
    ({"best_of": 3}, "best_of"),
    ({"temperature": -0.01}, "temperature"),
    ({"temperature": 100.5}, "temperature"),
    ({"temperature": 2**1100}, "temperature"),  # too large for a float
    ({"top_p": 0}, "top_p"),
    ({"top_p": -0.5}, "top_p"),
    ({"top_p": 1.0000001}, "top_p"),
    ({"seed": -1}, "seed"),
    ({"seed": 2**63}, "seed"),
    ({"seed": 2**64}, "seed"),
    ({"seed": 1.5}, "seed"),
    ({"presence_penalty": 1.5}, "presence_penalty"),
    ({"presence_penalty": -3}, "presence_penalty"),
    ({"frequency_penalty": 2.5}, "frequency_penalty"),
    ({"logprobs": 5}, "logprobs"),
    ({"logprobs": True}, "logprobs"),
    ({"top_logprobs": 3}, "top_logprobs"),
    ({"logit_bias": {"104": 100}}, "logit_bias"),
    ({"stop": [str(i) for i in range(17)]}, "stop"),
    ({"stop": "x" * (MAX_STOP_CHARS + 1)}, "stop"),
    ({"stop": ["a", "x" * (MAX_STOP_CHARS + 1)]}, "stop"),
    ({"stop_token_ids": [1] * (MAX_STOP_TOKEN_IDS + 1)}, "stop_token_ids"),
    ({"stop_token_ids": [2**40]}, "stop_token_ids"),
    ({"model": "m" * 257}, "model"),
]


@pytest.mark.parametrize(("fields", "field"), REFUSED, ids=[f"{f}={str(v)[:24]}" for v, f in
                                                            ((v[f], f) for v, f in REFUSED)])
async def test_completions_refuse_values_out_of_range(http: Http, fields: dict[str, Any], field: str) -> None:
    assert_refused(await http.post({**PROMPT, **fields}), field)
    assert http.fake.requests == []  # refused before the dispatcher saw it


@pytest.mark.parametrize(("fields", "field"), [
    ({"top_k": 2**33}, "top_k"),
    ({"max_completion_tokens": 2**70}, "max_tokens"),
    ({"max_completion_tokens": 0}, "max_tokens"),
    ({"max_tokens": -5}, "max_tokens"),
    ({"n": 3}, "n"),
    ({"temperature": 1000}, "temperature"),
    ({"top_p": 7}, "top_p"),
    ({"seed": -(2**70)}, "seed"),
    ({"presence_penalty": 0.5}, "presence_penalty"),
    ({"top_logprobs": 20}, "top_logprobs"),
    ({"logprobs": True}, "logprobs"),
    ({"stop": ["x"] * 17}, "stop"),
])
async def test_chat_refuses_values_out_of_range(http: Http, fields: dict[str, Any], field: str) -> None:
    assert_refused(await http.post({**CHAT, **fields}, chat=True), field)


async def test_values_at_the_bounds_are_served(http: Http) -> None:
    cases: list[tuple[dict[str, Any], dict[str, Any]]] = [
        ({"top_k": -1}, {"top_k": 0}),  # vLLM's "no top-k filter"
        ({"top_k": MAX_TOP_K}, {"top_k": MAX_TOP_K}),
        ({"seed": 2**63 - 1}, {"seed": 2**63 - 1}),
        ({"temperature": 0}, {"temperature": 0.0}),
        ({"temperature": 100}, {"temperature": 100.0}),
        ({"top_p": 1e-9}, {"top_p": 1e-9}),
        ({"max_tokens": 1}, {"max_tokens": 1}),
        ({"max_tokens": 125}, {"max_tokens": 125}),  # <bos> and 2 prompt tokens + 125 = the whole context
        ({"stop_token_ids": [7] * MAX_STOP_TOKEN_IDS}, {}),
        ({"stop": ["a", "x" * MAX_STOP_CHARS], "n": 1, "presence_penalty": 0, "logprobs": None}, {}),
    ]
    for fields, expected in cases:
        response = await http.post({**PROMPT, **fields})
        assert response.status_code == 200, (fields, response.text)
        seen = http.fake.requests[-1].sampling
        assert {k: getattr(seen, k) for k in expected} == expected


# -- gRPC ------------------------------------------------------------------------------------


@pytest.fixture(params=DOOR_SERVERS)
async def channel(request: pytest.FixtureRequest) -> AsyncIterator[grpc.aio.Channel]:
    servicer = RouterServicer(EchoDispatcher(), TOKENIZERS, metrics=RouterMetrics())
    server = door_server(request.param)
    add_to_server(server, servicer)
    await server.start()
    async with grpc.aio.insecure_channel(server.address) as channel:
        yield channel
    await server.stop(0)


@pytest.fixture
def stub(channel: grpc.aio.Channel) -> router_pb2_grpc.RouterStub:
    return router_pb2_grpc.RouterStub(channel)


def generate(prompt: str = "hi", model: str = "echo", request_id: str = "", **sampling: Any
             ) -> router_pb2.GenerateRequest:
    return router_pb2.GenerateRequest(model=model, text=prompt, request_id=request_id,
                                      sampling=common_pb2.SamplingParams(**sampling))


async def call(stub: router_pb2_grpc.RouterStub, request: router_pb2.GenerateRequest
               ) -> list[router_pb2.GenerateResponse]:
    return [m async for m in stub.Generate(request, timeout=10)]


@pytest.mark.parametrize(("request_", "field"), [
    (generate(top_k=2**32 - 1), "top_k"),
    (generate(top_k=MAX_TOP_K + 1), "top_k"),
    (generate(seed=2**64 - 1), "seed"),
    (generate(seed=2**63), "seed"),
    (generate(temperature=math.nan), "temperature"),
    (generate(temperature=math.inf), "temperature"),
    (generate(temperature=-1.0), "temperature"),
    (generate(temperature=101.0), "temperature"),
    (generate(top_p=math.nan), "top_p"),
    (generate(top_p=-0.5), "top_p"),
    (generate(top_p=1.5), "top_p"),
    (generate(top_p=math.inf), "top_p"),
    (generate(max_tokens=2**32 - 1), "max_tokens"),
    (generate(max_tokens=126), "max_tokens"),  # <bos>hi: 3 tokens, and the echo model's context is 128
    (generate(stop_token_ids=[1] * (MAX_STOP_TOKEN_IDS + 1)), "stop_token_ids"),
    (generate(stop_token_ids=[2**32 - 1]), "stop_token_ids"),
    (generate(request_id="line\nbreak"), "request_id"),
    (generate(request_id="r" * 129), "request_id"),
    (generate(model="m" * 257), "model"),
])
async def test_grpc_refuses_values_out_of_range(stub: router_pb2_grpc.RouterStub,
                                                request_: router_pb2.GenerateRequest, field: str) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as raised:
        await call(stub, request_)
    assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert field in (raised.value.details() or "")


async def test_grpc_serves_values_at_the_bounds(stub: router_pb2_grpc.RouterStub) -> None:
    for request in (generate(top_k=MAX_TOP_K), generate(seed=2**63 - 1), generate(temperature=100.0),
                    generate(max_tokens=125), generate(stop_token_ids=[7] * MAX_STOP_TOKEN_IDS),
                    generate(request_id="client-7")):
        messages = await call(stub, request)
        assert messages[-1].finish_reason != common_pb2.FINISH_REASON_UNSPECIFIED


async def test_grpc_bytes_that_are_no_message_are_invalid_arguments(channel: grpc.aio.Channel) -> None:
    good = generate().SerializeToString()
    for method in router_pb2.DESCRIPTOR.services_by_name["Router"].methods:  # every method is served
        call = channel.unary_stream if method.server_streaming else channel.unary_unary
        bad_utf8 = [good.replace(b"hi", b"h\xff")] if method.name == "Generate" else []  # a string field's
        for payload in (*bad_utf8, b"\xff\xff\xff"):
            with pytest.raises(grpc.aio.AioRpcError) as raised:
                outcome = call(f"/{SERVICE_NAME}/{method.name}")(payload, timeout=10)
                if method.server_streaming:
                    [m async for m in outcome]
                else:
                    await outcome
            assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT, (method.name, raised.value)
            assert "is not a valid" in (raised.value.details() or "")


async def test_a_lone_surrogate_is_refused(http: Http) -> None:
    for path, body in [("/v1/completions", b'{"model": "echo", "prompt": "a\\ud800b"}'),
                       ("/v1/chat/completions",
                        b'{"model": "echo", "messages": [{"role": "user", "content": "\\udfff"}]}'),
                       ("/v1/completions", b'{"model": "echo", "prompt": "hi", "\\udabc": 1}')]:
        response = await http.client.post(path, content=body)
        assert response.status_code == 400 and "surrogate" in response.json()["error"]["message"]
    paired = await http.client.post("/v1/completions", content=b'{"model": "echo", "prompt": "\\ud83d\\ude00"}')
    assert paired.status_code == 200 and paired.json()["choices"][0]["text"] == "\U0001f600"


# -- accepted means it fits the wire -----------------------------------------------------------


@settings(max_examples=300, derandomize=True, deadline=None)
@given(max_tokens=st.integers(-2, 2**65), temperature=st.floats(allow_nan=True, allow_infinity=True),
       top_p=st.floats(allow_nan=True, allow_infinity=True), top_k=st.integers(-2, 2**65),
       seed=st.one_of(st.none(), st.integers(-2, 2**65)),
       stop=st.lists(st.integers(-2, 2**65), max_size=4))
def test_accepted_sampling_params_fit_the_wire(max_tokens: int, temperature: float, top_p: float, top_k: int,
                                               seed: int | None, stop: list[int]) -> None:
    """What the doors accept, the router sends to a worker: it must become a protobuf message (a
    value past a uint32 there was once a 500) and come back the same on the worker's side."""
    try:
        params = SamplingParams(max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=top_k,
                                seed=seed, stop_token_ids=tuple(stop))
    except InvalidRequestError as exc:
        assert exc.message.split(" ", 1)[0] in {"max_tokens", "temperature", "top_p", "top_k", "seed",
                                                "stop_token_ids"}
        return
    back = sampling_from_pb(sampling_to_pb(params))
    assert (back.max_tokens, back.top_k, back.seed, back.stop_token_ids) == (
        params.max_tokens, params.top_k, params.seed, params.stop_token_ids)
