"""OpenAI response shapes: unary bodies, SSE chunks, and the one mapping of errors to HTTP replies.

Bodies are rendered from string templates (the same bytes as ``json.dumps`` with compact
separators would produce from the equivalent objects), and streamed chunks from a per-response
envelope prepared once (id, object, created, model), so each token chunk costs one JSON string
encoding of its text.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from json.encoder import encode_basestring_ascii
from typing import Any

from pdrouter.core.errors import PdRouterError
from pdrouter.router.request import FinishReason, RouterRequest, Usage

FINISH_REASONS = {FinishReason.STOP: "stop", FinishReason.LENGTH: "length", FinishReason.ABORT: "abort"}
DONE = b"data: [DONE]\n\n"
_COMPACT = (",", ":")
_REASON_JSON = {reason: encode_basestring_ascii(name) for reason, name in FINISH_REASONS.items()}
_USAGE = ('{"prompt_tokens":%d,"completion_tokens":%d,"total_tokens":%d,'
          '"prompt_tokens_details":{"cached_tokens":%d}}')
_BODY = ('{"id":%s,"object":%s,"created":%d,"model":%s,"choices":[{"index":0,%s,"logprobs":null,'
         '"finish_reason":%s}],"usage":%s}')


def _dumps(obj: Any) -> str:
    return json.dumps(obj, separators=_COMPACT)


def _json_str(text: str) -> str:
    """``text`` as a JSON string literal, escaped to ASCII as ``json.dumps`` writes it."""
    return encode_basestring_ascii(text)


def usage_json(usage: Usage) -> dict[str, Any]:
    return {"prompt_tokens": usage.prompt_tokens, "completion_tokens": usage.completion_tokens,
            "total_tokens": usage.total_tokens,
            "prompt_tokens_details": {"cached_tokens": usage.cached_tokens}}


def _usage_text(usage: Usage) -> str:
    """``usage_json(usage)`` rendered as compact JSON."""
    return _USAGE % (usage.prompt_tokens, usage.completion_tokens, usage.total_tokens, usage.cached_tokens)


def response_id(request: RouterRequest, chat: bool) -> str:
    """OpenAI-style id (``cmpl-…`` / ``chatcmpl-…``) carrying the router's request id."""
    return ("chatcmpl-" if chat else "cmpl-") + request.request_id.removeprefix("req-")


def completion_body(chat: bool, rid: str, created: int, model: str, text: str,
                    finish_reason: FinishReason, usage: Usage) -> bytes:
    """A whole (non-streamed) ``text_completion`` or ``chat.completion`` response body."""
    if chat:
        kind = '"chat.completion"'
        content = '"message":{"role":"assistant","content":' + _json_str(text) + "}"
    else:
        kind = '"text_completion"'
        content = '"text":' + _json_str(text)
    return (_BODY % (_json_str(rid), kind, created, _json_str(model), content, _REASON_JSON[finish_reason],
                     _usage_text(usage))).encode()


class SseWriter:
    """The ``data: …`` events of one streamed response, in OpenAI's chunk shapes."""

    __slots__ = ("_chat", "_envelope", "_first", "_head", "_include_usage", "_open", "_open_first", "_tail")

    def __init__(self, chat: bool, rid: str, created: int, model: str, include_usage: bool) -> None:
        self._chat = chat
        self._include_usage = include_usage
        kind = '"chat.completion.chunk"' if chat else '"text_completion"'
        # The opening of every chunk, up to its "choices".
        self._envelope = (f'data: {{"id":{_json_str(rid)},"object":{kind},"created":{created:d},'
                          f'"model":{_json_str(model)}')
        self._head = head = self._envelope + ',"choices":[{"index":0,'
        if chat:
            self._open = head + '"delta":{"content":'
            self._open_first = head + '"delta":{"role":"assistant","content":'
            self._tail = '},"logprobs":null,"finish_reason":null}]'
        else:
            self._open = self._open_first = head + '"text":'
            self._tail = ',"logprobs":null,"finish_reason":null}]'
        self._tail += (',"usage":null}\n\n' if include_usage else "}\n\n")
        self._first = True

    def text(self, text: str) -> bytes:
        """A chunk carrying ``text`` (the first chat chunk also carries the assistant role)."""
        opening = self._open_first if self._first else self._open
        self._first = False
        return (opening + _json_str(text) + self._tail).encode()

    def final(self, text: str, finish_reason: FinishReason, usage: Usage) -> bytes:
        """The last chunk (finish_reason), the usage chunk when asked for, and ``[DONE]``."""
        if self._chat:
            if self._first:
                delta = '"delta":{"role":"assistant","content":' + _json_str(text) + "}"
            elif text:
                delta = '"delta":{"content":' + _json_str(text) + "}"
            else:
                delta = '"delta":{}'
        else:
            delta = '"text":' + _json_str(text)
        self._first = False
        out = self._head + delta + ',"logprobs":null,"finish_reason":' + _REASON_JSON[finish_reason] + "}]"
        if self._include_usage:
            out += (',"usage":null}\n\n' + self._envelope + ',"choices":[],"usage":' + _usage_text(usage)
                    + "}\n\n")
        else:
            out += "}\n\n"
        return out.encode() + DONE


@dataclass(frozen=True, slots=True)
class ErrorReply:
    """How an error is answered over HTTP: status, headers and OpenAI's ``{"error": {...}}`` body."""

    status: int
    headers: dict[str, str]
    error: dict[str, Any]

    def body(self) -> bytes:
        return _dumps({"error": self.error}).encode()

    def sse_event(self) -> bytes:
        """The error as a stream event, for failures after the stream started."""
        return b"data: " + self.body() + b"\n\n"


def error_reply(exc: BaseException, retry_after_s: int) -> ErrorReply:
    """The one mapping of exceptions to HTTP error replies (codes come from ``pdrouter.core.errors``).

    Retryable errors (capacity, unavailable) carry ``Retry-After``; errors a client would retry by
    default but should not (a request too large for any worker, a deadline, an internal error)
    carry ``x-should-retry: false``. Foreign exceptions become a 500 without their details.
    """
    headers: dict[str, str] = {}
    if not isinstance(exc, PdRouterError):
        return ErrorReply(500, headers, {"message": f"internal server error ({type(exc).__name__})",
                                         "type": "server_error", "param": None, "code": "internal"})
    if exc.retryable:
        headers["retry-after"] = str(retry_after_s)
    elif exc.http_status >= 429:
        headers["x-should-retry"] = "false"
    code = exc.openai_code or exc.grpc_code.lower()
    return ErrorReply(exc.http_status, headers, {"message": exc.message, "type": exc.openai_type,
                                                 "param": getattr(exc, "param", None), "code": code})
