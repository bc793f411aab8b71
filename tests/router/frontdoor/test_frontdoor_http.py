"""The OpenAI HTTP front door, served by a real uvicorn, driven by the official client and httpx."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import openai
import pytest

from pdrouter.core.tokenizer import ByteTokenizer
from pdrouter.router.frontdoor.http_api import HttpFrontdoor
from pdrouter.router.frontdoor.http_server import bind_socket, make_server
from pdrouter.router.metrics import RouterMetrics
from pdrouter.testing.echo import CACHED_TOKENS, EchoDispatcher

WAIT_S = 10.0  # hang guard for events set by the server thread, not a latency bound


@dataclass
class HttpStack:
    """A real uvicorn server (in its own thread and event loop) serving an ``HttpFrontdoor``."""

    fake: EchoDispatcher
    door: HttpFrontdoor
    port: int

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


class _ServerThread:
    def __init__(self, app: Any) -> None:
        self.sock = bind_socket("127.0.0.1", 0)
        self.port = self.sock.getsockname()[1]
        self.server = make_server(app)
        self.thread = threading.Thread(target=self._run, name="uvicorn-test", daemon=True)

    def _run(self) -> None:
        asyncio.run(self.server.serve(sockets=[self.sock]))

    def __enter__(self) -> _ServerThread:
        self.thread.start()
        while not self.server.started and self.thread.is_alive():
            time.sleep(0.005)
        assert self.server.started, "uvicorn did not start"
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(WAIT_S)
        self.sock.close()


@pytest.fixture(scope="module")
def http_stack() -> Iterator[HttpStack]:
    """One server for the module; tests share the fake, so each looks up its own requests."""
    fake = EchoDispatcher()
    door = HttpFrontdoor(fake, {"echo": ByteTokenizer(512), "tiny": ByteTokenizer(512)},
                         metrics=RouterMetrics())
    with _ServerThread(door.app) as server:
        yield HttpStack(fake, door, server.port)


def client(stack: HttpStack) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{stack.base_url}/v1", api_key="x", max_retries=0)


def async_client(stack: HttpStack) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{stack.base_url}/v1", api_key="x", max_retries=0)


def request_for(stack: HttpStack, request_id: str) -> Any:
    return next(r for r in stack.fake.requests if r.request_id == request_id)


def sse_events(raw: str) -> list[str]:
    return [block.removeprefix("data: ") for block in raw.split("\n\n") if block]


def metric(stack: HttpStack, outcome: str) -> float:
    value = stack.door.metrics.registry.get_sample_value(
        "pdrouter_requests_total", {"frontdoor": "http", "outcome": outcome})
    return value or 0.0


# -- successful requests ---------------------------------------------------------------------


def test_completion_echoes_the_prompt_with_usage(http_stack: HttpStack) -> None:
    result = client(http_stack).completions.create(model="echo", prompt="hello", max_tokens=20)
    assert result.object == "text_completion"
    assert result.id.startswith("cmpl-")
    assert result.model == "echo"
    [choice] = result.choices
    assert (choice.text, choice.finish_reason, choice.index) == ("hello", "stop", 0)
    assert result.usage is not None
    # prompt: <bos> + 5 bytes; completion: 5 bytes + <eos>
    assert (result.usage.prompt_tokens, result.usage.completion_tokens, result.usage.total_tokens) == (6, 6, 12)
    assert result.usage.prompt_tokens_details is not None
    assert result.usage.prompt_tokens_details.cached_tokens == CACHED_TOKENS


def test_max_tokens_ends_with_length(http_stack: HttpStack) -> None:
    result = client(http_stack).completions.create(model="echo", prompt="hello", max_tokens=3)
    assert (result.choices[0].text, result.choices[0].finish_reason) == ("hel", "length")
    assert result.usage is not None and result.usage.completion_tokens == 3


@pytest.mark.parametrize("prompt", ["hi", ["hi"], [104, 105], [[104, 105]]])
def test_every_prompt_form(http_stack: HttpStack, prompt: Any) -> None:
    result = client(http_stack).completions.create(model="echo", prompt=prompt, max_tokens=5)
    assert result.choices[0].text == "hi"
    expected = [257, 104, 105] if prompt in ("hi", ["hi"]) else [104, 105]
    assert result.usage is not None and result.usage.prompt_tokens == len(expected)


def test_sampling_fields_reach_the_dispatcher(http_stack: HttpStack) -> None:
    raw = client(http_stack).completions.with_raw_response.create(
        model="echo", prompt="abc", max_tokens=7, temperature=0.5, top_p=0.9, seed=42, user="someone",
        extra_body={"top_k": 5, "stop_token_ids": [1, 2]})
    sampling = request_for(http_stack, raw.headers["x-request-id"]).sampling
    assert (sampling.max_tokens, sampling.temperature, sampling.top_p, sampling.top_k, sampling.seed,
            sampling.stop_token_ids) == (7, 0.5, 0.9, 5, 42, (1, 2))


def test_max_tokens_defaults_to_the_context_left(http_stack: HttpStack) -> None:
    raw = client(http_stack).completions.with_raw_response.create(model="tiny", prompt="0123456789")
    assert request_for(http_stack, raw.headers["x-request-id"]).sampling.max_tokens == 24 - 11


def test_stop_token_ids_and_ignore_eos(http_stack: HttpStack) -> None:
    c = client(http_stack)
    stopped = c.completions.create(model="echo", prompt="hello", extra_body={"stop_token_ids": [ord("l")]})
    assert (stopped.choices[0].text, stopped.choices[0].finish_reason) == ("hel", "stop")
    cycled = c.completions.create(model="echo", prompt="ab", max_tokens=5, extra_body={"ignore_eos": True})
    assert (cycled.choices[0].text, cycled.choices[0].finish_reason) == ("ababa", "length")


def test_stop_string_cuts_the_text_and_cancels_the_rest(http_stack: HttpStack) -> None:
    raw = client(http_stack).completions.with_raw_response.create(
        model="echo", prompt="hello world", stop=["xyz", "o w"], max_tokens=50)
    result = raw.parse()
    assert (result.choices[0].text, result.choices[0].finish_reason) == ("hell", "stop")
    assert result.usage is not None and result.usage.completion_tokens == len("hello w")
    # The reply may reach the client before the server thread has recorded the cancel.
    for _ in range(200):
        if raw.headers["x-request-id"] in http_stack.fake.cancelled:
            break
        time.sleep(0.01)
    assert raw.headers["x-request-id"] in http_stack.fake.cancelled


def test_text_held_back_for_a_stop_string_is_released_at_the_end(http_stack: HttpStack) -> None:
    result = client(http_stack).completions.create(model="echo", prompt="abz", stop="zz")
    assert (result.choices[0].text, result.choices[0].finish_reason) == ("abz", "stop")


def test_chat_completion(http_stack: HttpStack, tokenizer: ByteTokenizer) -> None:
    messages: Any = [
        {"role": "developer", "content": "be brief. "},
        {"role": "user", "content": [{"type": "text", "text": "héllo"}, {"type": "text", "text": "✓"}]},
    ]
    raw = client(http_stack).chat.completions.with_raw_response.create(
        model="echo", messages=messages, max_completion_tokens=40)
    result = raw.parse()
    assert result.object == "chat.completion"
    assert result.id.startswith("chatcmpl-")
    message = result.choices[0].message
    assert (message.role, message.content, result.choices[0].finish_reason) == (
        "assistant", "be brief. héllo\n✓", "stop")
    expected = tokenizer.apply_chat_template([{"role": "system", "content": "be brief. "},
                                              {"role": "user", "content": "héllo\n✓"}])
    assert request_for(http_stack, raw.headers["x-request-id"]).prompt_token_ids == tuple(expected)
    assert result.usage is not None and result.usage.prompt_tokens == len(expected)


def test_streamed_completion(http_stack: HttpStack) -> None:
    chunks = list(client(http_stack).completions.create(
        model="echo", prompt="héllo ✓", max_tokens=30, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == "héllo ✓"
    assert [c.choices[0].finish_reason for c in chunks][-1] == "stop"
    assert all(c.choices[0].finish_reason is None for c in chunks[:-1])
    assert all(c.usage is None for c in chunks)
    assert len({c.id for c in chunks}) == 1


def test_a_token_that_completes_no_character_streams_an_empty_chunk(http_stack: HttpStack) -> None:
    """One chunk per token, as vLLM's server streams: the first byte of "é" is a chunk with empty
    text, so a client's time to first token is the first token's, not the first character's."""
    chunks = list(client(http_stack).completions.create(model="echo", prompt="é✓a", max_tokens=30, stream=True))
    texts = [c.choices[0].text for c in chunks]
    assert texts[:6] == ["", "é", "", "", "✓", "a"]
    assert len(texts) == len("é✓a".encode()) + 1  # every byte, then the finish (<eos>) chunk
    events = sse_events(httpx.post(f"{http_stack.base_url}/v1/chat/completions", json={
        "model": "echo", "messages": [{"role": "user", "content": "é"}], "stream": True}).text)
    first = json.loads(events[0])["choices"][0]["delta"]
    assert first == {"role": "assistant", "content": ""}
    assert json.loads(events[1])["choices"][0]["delta"]["content"] == "é"


def test_streamed_chat_with_usage(http_stack: HttpStack) -> None:
    stream = client(http_stack).chat.completions.create(
        model="echo", messages=[{"role": "user", "content": "hey"}], stream=True,
        stream_options={"include_usage": True})
    chunks = list(stream)
    *content, last, usage_chunk = chunks
    assert content[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in content) == "hey"
    assert last.choices[0].finish_reason == "stop"
    assert usage_chunk.choices == []
    assert usage_chunk.usage is not None
    assert (usage_chunk.usage.completion_tokens, usage_chunk.usage.total_tokens) == (
        4, usage_chunk.usage.prompt_tokens + 4)


def test_streamed_chat_of_a_single_token(http_stack: HttpStack) -> None:
    [only] = list(client(http_stack).chat.completions.create(
        model="echo", messages=[{"role": "user", "content": "hey"}], stream=True, max_tokens=1))
    delta = only.choices[0].delta
    assert (delta.role, delta.content, only.choices[0].finish_reason) == ("assistant", "h", "length")


async def test_async_client_streams_and_cuts_at_stop(http_stack: HttpStack) -> None:
    async with async_client(http_stack) as c:
        stream = await c.chat.completions.create(
            model="echo", messages=[{"role": "user", "content": "one, two, three"}], stream=True,
            stop=[", th"])
        texts = [chunk.choices[0].delta.content or "" async for chunk in stream if chunk.choices]
        assert "".join(texts) == "one, two"
        unary = await c.completions.create(model="echo", prompt="xyz", max_tokens=2)
        assert unary.choices[0].text == "xy"


def test_models_health_and_metrics(http_stack: HttpStack) -> None:
    models = client(http_stack).models.list()
    assert [(m.id, m.object, m.owned_by) for m in models.data] == [
        ("echo", "model", "pd-router"), ("tiny", "model", "pd-router")]
    assert models.data[0].created == 1_700_000_000
    for path in ("/health", "/healthz"):
        assert httpx.get(http_stack.base_url + path).json() == {"status": "ok"}
    client(http_stack).completions.create(model="echo", prompt="m", max_tokens=2)
    response = httpx.get(http_stack.base_url + "/metrics")
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/plain")
    text = response.text
    for name in ("pdrouter_time_to_first_token_seconds_bucket", "pdrouter_inter_token_latency_seconds_count",
                 "pdrouter_request_duration_seconds_count", "pdrouter_requests_in_flight",
                 'pdrouter_requests_total{frontdoor="http",outcome="ok"}', "pdrouter_generation_tokens_total"):
        assert name in text


@pytest.mark.parametrize(("method", "path", "status"), [
    ("GET", "/v2/nothing", 404), ("POST", "/v1/embeddings", 404), ("GET", "/v1/completions", 405)])
def test_unknown_routes_answer_json(http_stack: HttpStack, method: str, path: str, status: int) -> None:
    response = httpx.request(method, http_stack.base_url + path)
    assert response.status_code == status
    assert response.json()["error"]["type"] == "invalid_request_error"


# -- invalid requests ------------------------------------------------------------------------

_BAD_BODIES: list[tuple[str, bytes | dict[str, Any], str | None]] = [
    ("malformed json", b'{"model": "echo", "prompt": ', None),
    ("not utf-8", b'{"model": "echo", "prompt": "\xff\xfe"}', None),
    ("empty body", b"", None),
    ("not an object", b'["echo"]', None),
    ("nan", b'{"model": "echo", "prompt": "hi", "temperature": NaN}', None),
    ("missing model", {"prompt": "hi"}, "model"),
    ("model not a string", {"model": 3, "prompt": "hi"}, "model"),
    ("missing prompt", {"model": "echo"}, "prompt"),
    ("empty prompt list", {"model": "echo", "prompt": []}, "prompt"),
    ("batched prompts", {"model": "echo", "prompt": ["a", "b"]}, "prompt"),
    ("prompt of floats", {"model": "echo", "prompt": [1.5]}, "prompt"),
    ("prompt object", {"model": "echo", "prompt": {"text": "hi"}}, "prompt"),
    ("negative token id", {"model": "echo", "prompt": [-1]}, None),
    ("token id beyond vocab", {"model": "echo", "prompt": [104, 600]}, None),
    ("negative max_tokens", {"model": "echo", "prompt": "hi", "max_tokens": -1}, "max_tokens"),
    ("zero max_tokens", {"model": "echo", "prompt": "hi", "max_tokens": 0}, "max_tokens"),
    ("string max_tokens", {"model": "echo", "prompt": "hi", "max_tokens": "5"}, "max_tokens"),
    ("float max_tokens", {"model": "echo", "prompt": "hi", "max_tokens": 2.5}, "max_tokens"),
    ("boolean max_tokens", {"model": "echo", "prompt": "hi", "max_tokens": True}, "max_tokens"),
    ("negative temperature", {"model": "echo", "prompt": "hi", "temperature": -0.5}, "temperature"),
    ("huge temperature", {"model": "echo", "prompt": "hi", "temperature": 500}, "temperature"),
    ("string temperature", {"model": "echo", "prompt": "hi", "temperature": "hot"}, "temperature"),
    ("zero top_p", {"model": "echo", "prompt": "hi", "top_p": 0}, "top_p"),
    ("top_p above one", {"model": "echo", "prompt": "hi", "top_p": 1.5}, "top_p"),
    ("negative seed", {"model": "echo", "prompt": "hi", "seed": -1}, "seed"),
    ("string seed", {"model": "echo", "prompt": "hi", "seed": "42"}, "seed"),
    ("n above one", {"model": "echo", "prompt": "hi", "n": 2}, "n"),
    ("logprobs", {"model": "echo", "prompt": "hi", "logprobs": 5}, "logprobs"),
    ("echo", {"model": "echo", "prompt": "hi", "echo": True}, "echo"),
    ("stop not a string", {"model": "echo", "prompt": "hi", "stop": 5}, "stop"),
    ("stop list of numbers", {"model": "echo", "prompt": "hi", "stop": [1, 2]}, "stop"),
    ("too many stops", {"model": "echo", "prompt": "hi", "stop": [str(i) for i in range(17)]}, "stop"),
    ("stop_token_ids not a list", {"model": "echo", "prompt": "hi", "stop_token_ids": "x"}, "stop_token_ids"),
    ("negative stop token", {"model": "echo", "prompt": "hi", "stop_token_ids": [-1]}, None),
    ("stop token beyond vocab", {"model": "echo", "prompt": "hi", "stop_token_ids": [99999]}, None),
    ("stream not a boolean", {"model": "echo", "prompt": "hi", "stream": "yes"}, "stream"),
    ("stream_options not an object", {"model": "echo", "prompt": "hi", "stream": True,
                                      "stream_options": "usage"}, "stream_options"),
    ("include_usage not a boolean", {"model": "echo", "prompt": "hi", "stream": True,
                                     "stream_options": {"include_usage": 1}}, "include_usage"),
]
_BAD_CHATS: list[tuple[str, dict[str, Any], str | None]] = [
    ("missing messages", {"model": "echo"}, "messages"),
    ("empty messages", {"model": "echo", "messages": []}, "messages"),
    ("messages not a list", {"model": "echo", "messages": "hi"}, "messages"),
    ("message not an object", {"model": "echo", "messages": ["hi"]}, "messages[0]"),
    ("unknown role", {"model": "echo", "messages": [{"role": "bot", "content": "x"}]}, "messages[0].role"),
    ("missing content", {"model": "echo", "messages": [{"role": "user"}]}, "messages[0].content"),
    ("numeric content", {"model": "echo", "messages": [{"role": "user", "content": 5}]},
     "messages[0].content"),
    ("image part", {"model": "echo", "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "http://x"}}]}]}, "messages[0].content[0]"),
    ("tool call without a function", {"model": "echo", "messages": [{"role": "assistant", "content": None,
                                                                     "tool_calls": [{"id": "1"}]}]},
     "messages[0].tool_calls[0].function"),
    ("bad max_completion_tokens", {"model": "echo", "messages": [{"role": "user", "content": "x"}],
                                   "max_completion_tokens": -3}, "max_tokens"),
]


def _post(stack: HttpStack, path: str, body: bytes | dict[str, Any]) -> httpx.Response:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    return httpx.post(stack.base_url + path, content=content, headers={"content-type": "application/json"})


def _assert_invalid(response: httpx.Response, param: str | None) -> dict[str, Any]:
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "invalid_request_error"
    assert isinstance(error["message"], str) and error["message"]
    if param is not None:
        assert error["param"] == param
    return dict(error)


@pytest.mark.parametrize(("case", "body", "param"), _BAD_BODIES, ids=[c[0] for c in _BAD_BODIES])
def test_invalid_completion_is_400_and_the_server_keeps_serving(
        http_stack: HttpStack, case: str, body: bytes | dict[str, Any], param: str | None) -> None:
    _assert_invalid(_post(http_stack, "/v1/completions", body), param)
    ok = _post(http_stack, "/v1/completions", {"model": "echo", "prompt": "ok", "max_tokens": 2})
    assert ok.json()["choices"][0]["text"] == "ok"


@pytest.mark.parametrize(("case", "body", "param"), _BAD_CHATS, ids=[c[0] for c in _BAD_CHATS])
def test_invalid_chat_is_400(http_stack: HttpStack, case: str, body: dict[str, Any], param: str | None) -> None:
    _assert_invalid(_post(http_stack, "/v1/chat/completions", body), param)


def test_prompt_over_the_context_window_names_the_numbers(http_stack: HttpStack) -> None:
    too_long = _assert_invalid(_post(http_stack, "/v1/completions",
                                     {"model": "echo", "prompt": "x" * 200}), None)
    assert too_long["code"] == "context_length_exceeded"
    assert "201" in too_long["message"] and "128" in too_long["message"]
    with_max = _assert_invalid(_post(http_stack, "/v1/completions",
                                     {"model": "echo", "prompt": "x" * 99, "max_tokens": 29}), None)
    assert all(n in with_max["message"] for n in ("100", "29", "129", "128", "28"))
    fits = _post(http_stack, "/v1/completions", {"model": "echo", "prompt": "x" * 99, "max_tokens": 28})
    assert fits.status_code == 200
    with pytest.raises(openai.BadRequestError) as raised:
        client(http_stack).chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x" * 30}])
    assert raised.value.code == "context_length_exceeded"


def test_unknown_model_is_400_model_not_found(http_stack: HttpStack) -> None:
    with pytest.raises(openai.BadRequestError) as raised:
        client(http_stack).completions.create(model="gpt-9", prompt="hi")
    assert "gpt-9" in raised.value.message and "echo" in raised.value.message
    assert (raised.value.type, raised.value.code) == ("invalid_request_error", "model_not_found")


# -- dispatcher errors -----------------------------------------------------------------------


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize(("directive", "status", "error_type", "headers"), [
    ("#capacity", 429, "rate_limit_error", {"retry-after": "1"}),
    ("#toolarge", 429, "rate_limit_error", {"x-should-retry": "false"}),
    ("#unavailable", 503, "server_error", {"retry-after": "1"}),
    ("#deadline", 504, "timeout_error", {"x-should-retry": "false"}),
    ("#notfound", 404, "not_found_error", {}),
    ("#crash", 500, "server_error", {}),
])
def test_errors_before_the_first_token_are_http_errors(
        http_stack: HttpStack, stream: bool, directive: str, status: int, error_type: str,
        headers: dict[str, str]) -> None:
    response = _post(http_stack, "/v1/completions", {"model": "echo", "prompt": directive, "stream": stream})
    assert response.status_code == status
    assert response.headers["content-type"] == "application/json"
    for name, value in headers.items():
        assert response.headers[name] == value
    error = response.json()["error"]
    assert error["type"] == error_type
    if directive == "#crash":
        assert "a bug" not in error["message"]


def test_openai_client_sees_typed_errors(http_stack: HttpStack) -> None:
    c = client(http_stack)
    with pytest.raises(openai.RateLimitError):
        c.completions.create(model="echo", prompt="#capacity")
    with pytest.raises(openai.InternalServerError):
        c.chat.completions.create(model="echo", messages=[{"role": "user", "content": "#unavailable"}],
                                  stream=True)


def test_error_after_the_stream_started_is_an_sse_error_event(http_stack: HttpStack) -> None:
    body = {"model": "echo", "prompt": "#fail-after", "stream": True}
    response = _post(http_stack, "/v1/completions", body)
    assert response.status_code == 200
    events = sse_events(response.text)
    assert [json.loads(e)["choices"][0]["text"] for e in events[:2]] == ["#", "f"]
    assert json.loads(events[-1])["error"]["type"] == "server_error"
    assert "[DONE]" not in events
    with pytest.raises(openai.APIError, match="went away"):
        list(client(http_stack).completions.create(model="echo", prompt="#fail-after", stream=True))
    unary = _post(http_stack, "/v1/completions", {**body, "stream": False})
    assert unary.status_code == 503


def test_stream_without_a_finish_reason_is_an_error(http_stack: HttpStack) -> None:
    response = _post(http_stack, "/v1/completions", {"model": "echo", "prompt": "#noend"})
    assert response.status_code == 503
    assert "without a finish reason" in response.json()["error"]["message"]


# -- client disconnects ------------------------------------------------------------------------


def test_disconnect_mid_stream_closes_the_dispatcher_stream(http_stack: HttpStack) -> None:
    tag = uuid.uuid4().hex
    cancelled_before = metric(http_stack, "cancelled")
    _, closed = http_stack.fake.events(tag)
    body = {"model": "echo", "prompt": f"#stall:{tag}", "stream": True, "max_tokens": 50}
    with httpx.Client() as http, http.stream("POST", http_stack.base_url + "/v1/completions", json=body) as r:
        assert r.status_code == 200
        first = next(r.iter_lines())
        assert json.loads(first.removeprefix("data: "))["choices"][0]["text"] == "#"
    assert closed.wait(WAIT_S)
    assert request_for(http_stack, r.headers["x-request-id"]).request_id in http_stack.fake.cancelled
    assert _await_metric(http_stack, "cancelled", cancelled_before + 1)


def _raw_request(stack: HttpStack, body: dict[str, Any]) -> socket.socket:
    payload = json.dumps(body).encode()
    sock = socket.create_connection(("127.0.0.1", stack.port))
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                 b"content-length: %d\r\n\r\n%s" % (len(payload), payload))
    return sock


@pytest.mark.parametrize(("stall", "stream"), [("stall0", True), ("stall0", False), ("stall", False)])
def test_disconnect_before_the_response_closes_the_dispatcher_stream(
        http_stack: HttpStack, stall: str, stream: bool) -> None:
    tag = uuid.uuid4().hex
    started, closed = http_stack.fake.events(tag)
    sock = _raw_request(http_stack, {"model": "echo", "prompt": f"#{stall}:{tag}", "stream": stream})
    assert started.wait(WAIT_S)
    assert not closed.is_set()
    sock.close()
    assert closed.wait(WAIT_S)
    ok = _post(http_stack, "/v1/completions", {"model": "echo", "prompt": "still here", "max_tokens": 5})
    assert ok.json()["choices"][0]["text"] == "still"


def _await_metric(stack: HttpStack, outcome: str, at_least: float) -> bool:
    # The server thread accounts the request right after closing the stream; poll for it.
    for _ in range(int(WAIT_S / 0.01)):
        if metric(stack, outcome) >= at_least:
            return True
        time.sleep(0.01)
    return False
