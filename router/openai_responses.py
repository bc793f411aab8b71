"""OpenAI response shapes: unary bodies, SSE chunks, and the one mapping of errors to HTTP replies.

Streamed chunks are rendered from a per-response envelope prepared once (id, object, created,
model), so each token chunk costs one ``json.dumps`` of its text.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from pdcommon.errors import PdRouterError, PromptTooLongError
from router.request import FinishReason, RouterRequest, Usage

FINISH_REASONS = {FinishReason.STOP: "stop", FinishReason.LENGTH: "length", FinishReason.ABORT: "abort"}
DONE = b"data: [DONE]\n\n"
_COMPACT = (",", ":")


def _dumps(obj: Any) -> str:
    return json.dumps(obj, separators=_COMPACT)


def usage_json(usage: Usage) -> dict[str, Any]:
    return {"prompt_tokens": usage.prompt_tokens, "completion_tokens": usage.completion_tokens,
            "total_tokens": usage.total_tokens,
            "prompt_tokens_details": {"cached_tokens": usage.cached_tokens}}


def response_id(request: RouterRequest, chat: bool) -> str:
    """OpenAI-style id (``cmpl-…`` / ``chatcmpl-…``) carrying the router's request id."""
    return ("chatcmpl-" if chat else "cmpl-") + request.request_id.removeprefix("req-")


def completion_body(chat: bool, rid: str, created: int, model: str, text: str,
                    finish_reason: FinishReason, usage: Usage) -> bytes:
    """A whole (non-streamed) ``text_completion`` or ``chat.completion`` response body."""
    reason = FINISH_REASONS[finish_reason]
    choice: dict[str, Any]
    if chat:
        choice = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                  "finish_reason": reason}
    else:
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": reason}
    body = {"id": rid, "object": "chat.completion" if chat else "text_completion", "created": created,
            "model": model, "choices": [choice], "usage": usage_json(usage)}
    return _dumps(body).encode()


class SseWriter:
    """The ``data: …`` events of one streamed response, in OpenAI's chunk shapes."""

    __slots__ = ("_chat", "_envelope", "_first", "_include_usage", "_open", "_open_first", "_tail")

    def __init__(self, chat: bool, rid: str, created: int, model: str, include_usage: bool) -> None:
        self._chat = chat
        self._include_usage = include_usage
        self._envelope = {"id": rid, "object": "chat.completion.chunk" if chat else "text_completion",
                          "created": created, "model": model}
        head = "data: " + _dumps(self._envelope)[:-1] + ',"choices":[{"index":0,'
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
        return (opening + json.dumps(text) + self._tail).encode()

    def final(self, text: str, finish_reason: FinishReason, usage: Usage) -> bytes:
        """The last chunk (finish_reason), the usage chunk when asked for, and ``[DONE]``."""
        reason = FINISH_REASONS[finish_reason]
        choice: dict[str, Any]
        if self._chat:
            delta: dict[str, Any] = {"role": "assistant"} if self._first else {}
            if text or self._first:
                delta["content"] = text
            choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": reason}
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": reason}
        self._first = False
        last: dict[str, Any] = {**self._envelope, "choices": [choice]}
        if self._include_usage:
            last["usage"] = None
        out = "data: " + _dumps(last) + "\n\n"
        if self._include_usage:
            out += "data: " + _dumps({**self._envelope, "choices": [], "usage": usage_json(usage)}) + "\n\n"
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
    """The one mapping of exceptions to HTTP error replies (codes come from ``pdcommon.errors``).

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
    code = "context_length_exceeded" if isinstance(exc, PromptTooLongError) else exc.grpc_code.lower()
    return ErrorReply(exc.http_status, headers, {"message": exc.message, "type": exc.openai_type,
                                                 "param": getattr(exc, "param", None), "code": code})
