"""OpenAI request parsing, context-window sizing and the error → HTTP mapping, without a server."""

from __future__ import annotations

import json
from typing import Any

import pytest

from pdrouter.core.errors import (
    CancelledError,
    CapacityError,
    ConfigError,
    DeadlineExceededError,
    InvalidRequestError,
    ModelNotFoundError,
    NotFoundError,
    PdRouterError,
    PromptTooLongError,
    RequestTooLargeError,
    TransferError,
)
from pdrouter.core.tokenizer import ByteTokenizer
from pdrouter.router.frontdoor.openai_responses import SseWriter, error_reply
from pdrouter.router.frontdoor.openai_schema import FieldError, OpenAIRequest, parse_openai_request, to_router_request
from pdrouter.router.frontdoor.served_models import FrontdoorConfig, ModelRegistry, ServedModel
from pdrouter.router.request import FinishReason, ModelInfo, Usage
from pdrouter.testing.echo import ECHO, EchoDispatcher

CONFIG = FrontdoorConfig()


def parse(body: dict[str, Any], chat: bool = False) -> OpenAIRequest:
    return parse_openai_request(json.dumps(body).encode(), chat, CONFIG)


def test_completion_defaults() -> None:
    req = parse({"model": "echo", "prompt": "hi"})
    assert (req.chat, req.model, req.prompt, req.max_tokens, req.temperature, req.top_p, req.top_k, req.seed,
            req.stop, req.stop_token_ids, req.ignore_eos, req.stream, req.include_usage) == (
        False, "echo", "hi", None, 1.0, 1.0, 0, None, (), (), False, False, False)


def test_neutral_values_of_unsupported_features_are_accepted() -> None:
    req = parse({"model": "echo", "prompt": [[1, 2]], "n": 1, "echo": False, "logprobs": None,
                 "presence_penalty": 0, "frequency_penalty": 0.0, "logit_bias": {}, "best_of": 1,
                 "some_future_field": {"x": 1}, "user": "u-1", "stop": "##", "stream": True,
                 "stream_options": {"include_usage": True}})
    assert (req.prompt, req.stop, req.stream, req.include_usage) == ((1, 2), ("##",), True, True)


def test_chat_roles_parts_and_max_completion_tokens() -> None:
    req = parse({"model": "echo", "max_tokens": 5, "max_completion_tokens": 9, "messages": [
        {"role": "developer", "content": "rules"},
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
        {"role": "assistant", "content": None},
        {"role": "user", "content": "c", "name": "bob"}]}, chat=True)
    assert [(m.role, m.content) for m in req.messages] == [
        ("system", "rules"), ("user", "a\nb"), ("assistant", ""), ("user", "c")]
    assert req.messages[3].name == "bob"
    assert req.max_tokens == 9


def test_completions_honour_max_completion_tokens() -> None:
    assert parse({"model": "echo", "prompt": "hi", "max_completion_tokens": 7}).max_tokens == 7
    assert parse({"model": "echo", "prompt": "hi", "max_tokens": 5, "max_completion_tokens": 3}).max_tokens == 3


def test_field_errors_name_the_parameter() -> None:
    with pytest.raises(FieldError) as raised:
        parse({"model": "echo", "prompt": "hi", "top_k": "3"})
    assert raised.value.param == "top_k"
    assert "top_k must be an integer, got a string" in raised.value.message


def test_sampling_errors_name_their_parameter(tokenizer: ByteTokenizer) -> None:
    served = ServedModel(ECHO, tokenizer)
    with pytest.raises(FieldError) as raised:
        to_router_request(parse({"model": "echo", "prompt": "hi", "top_p": 2}), served, CONFIG)
    assert raised.value.param == "top_p"


def test_max_tokens_default_is_capped(tokenizer: ByteTokenizer) -> None:
    big = ServedModel(ModelInfo("big", max_context=8192, vocab_size=512, block_size=16), tokenizer)
    request = to_router_request(parse({"model": "big", "prompt": "hi"}), big, CONFIG)
    assert request.sampling.max_tokens == CONFIG.default_max_tokens == 256
    small_cap = to_router_request(parse({"model": "big", "prompt": "hi"}), big, FrontdoorConfig(default_max_tokens=8))
    assert small_cap.sampling.max_tokens == 8
    assert big.max_tokens_for(8000, None, 256) == 192
    with pytest.raises(PromptTooLongError, match="8192"):
        big.max_tokens_for(8192, None, 256)
    assert big.max_tokens_for(8000, 192, 256) == 192
    with pytest.raises(PromptTooLongError, match="8193"):
        big.max_tokens_for(8000, 193, 256)


def test_request_ids_are_fresh(tokenizer: ByteTokenizer) -> None:
    served = ServedModel(ECHO, tokenizer)
    req = parse({"model": "echo", "prompt": "hi"})
    first, second = (to_router_request(req, served, CONFIG) for _ in range(2))
    assert first.request_id != second.request_id
    assert first.prompt_token_ids == (257, 104, 105)


def test_only_an_unstreamed_request_without_stop_strings_is_taken_whole(tokenizer: ByteTokenizer) -> None:
    served = ServedModel(ECHO, tokenizer)
    whole = [to_router_request(parse({"model": "echo", "prompt": "hi", **extra}), served, CONFIG).whole
             for extra in ({}, {"stream": True}, {"stop": ["x"]}, {"stop": []})]
    assert whole == [True, False, False, True]


def test_registry_picks_up_new_models_and_needs_a_tokenizer(tokenizer: ByteTokenizer) -> None:
    served = [ECHO]
    fake = EchoDispatcher(models=served)  # lists `served` as it is at each call
    registry = ModelRegistry(fake, {"echo": tokenizer, "late": tokenizer})
    assert registry.get("echo").info == ECHO
    with pytest.raises(ModelNotFoundError, match="'late'"):
        registry.get("late")
    late = ModelInfo("late", max_context=64, vocab_size=512, block_size=16)
    served.append(late)
    assert registry.get("late").info == late
    served.append(ModelInfo("no-tokenizer", max_context=64, vocab_size=512, block_size=16))
    with pytest.raises(PdRouterError, match="no tokenizer"):
        registry.get("no-tokenizer")


@pytest.mark.parametrize(("exc", "status", "error_type", "code", "headers"), [
    (FieldError("top_p", "bad"), 400, "invalid_request_error", "invalid_argument", {}),
    (PromptTooLongError("long"), 400, "invalid_request_error", "context_length_exceeded", {}),
    (ConfigError("cfg"), 400, "invalid_request_error", "failed_precondition", {}),
    (NotFoundError("nope"), 404, "not_found_error", "not_found", {}),
    (ModelNotFoundError("gpt-9"), 400, "invalid_request_error", "model_not_found", {}),
    (CapacityError("full"), 429, "rate_limit_error", "resource_exhausted", {"retry-after": "2"}),
    (RequestTooLargeError("huge"), 429, "rate_limit_error", "resource_exhausted", {"x-should-retry": "false"}),
    (TransferError("lost"), 503, "server_error", "unavailable", {"retry-after": "2"}),
    (DeadlineExceededError("late"), 504, "timeout_error", "deadline_exceeded", {"x-should-retry": "false"}),
    (CancelledError("gone"), 499, "cancelled", "cancelled", {"x-should-retry": "false"}),
    (PdRouterError("oops"), 500, "server_error", "internal", {"x-should-retry": "false"}),
    (KeyError("secret"), 500, "server_error", "internal", {}),
])
def test_error_reply_mapping(exc: Exception, status: int, error_type: str, code: str,
                             headers: dict[str, str]) -> None:
    reply = error_reply(exc, retry_after_s=2)
    assert (reply.status, reply.error["type"], reply.error["code"], reply.headers) == (
        status, error_type, code, headers)
    body = json.loads(reply.body())
    assert set(body["error"]) == {"message", "type", "param", "code"}
    assert "secret" not in body["error"]["message"]
    assert reply.sse_event() == b"data: " + reply.body() + b"\n\n"
    if isinstance(exc, FieldError):
        assert body["error"]["param"] == "top_p"


def test_sse_chunks_are_valid_json_in_openai_shapes() -> None:
    writer = SseWriter(True, "chatcmpl-1", 7, "echo", include_usage=True)
    first = json.loads(writer.text('say "hi"\n').removeprefix(b"data: "))
    assert first == {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 7, "model": "echo",
                     "choices": [{"index": 0, "delta": {"role": "assistant", "content": 'say "hi"\n'},
                                  "logprobs": None, "finish_reason": None}], "usage": None}
    assert json.loads(writer.text("x").removeprefix(b"data: "))["choices"][0]["delta"] == {"content": "x"}
    last, usage, done = writer.final("", FinishReason.LENGTH, Usage(3, 2, 1)).decode().split("\n\n")[:3]
    assert json.loads(last.removeprefix("data: "))["choices"][0] == {
        "index": 0, "delta": {}, "logprobs": None, "finish_reason": "length"}
    assert json.loads(usage.removeprefix("data: "))["usage"] == {
        "prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5, "prompt_tokens_details": {"cached_tokens": 1}}
    assert done == "data: [DONE]"
    plain = SseWriter(False, "cmpl-1", 7, "echo", include_usage=False)
    assert json.loads(plain.text("é").removeprefix(b"data: "))["choices"][0]["text"] == "é"
    assert plain.final("z", FinishReason.STOP, Usage(1, 1)).count(b"data: ") == 2


def test_invalid_request_error_is_the_base_of_field_errors() -> None:
    assert issubclass(FieldError, InvalidRequestError)
