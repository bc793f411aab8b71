"""Response bodies and SSE chunks are byte for byte what ``json.dumps`` makes of OpenAI's objects."""

from __future__ import annotations

import json
from typing import Any

from hypothesis import given
from hypothesis import strategies as st

from pdrouter.router.frontdoor.openai_responses import DONE, SseWriter, completion_body, usage_json
from pdrouter.router.request import FinishReason, Usage

REASONS = {FinishReason.STOP: "stop", FinishReason.LENGTH: "length", FinishReason.ABORT: "abort"}
texts = st.text(alphabet=st.characters(codec=None), max_size=40)  # any code point, quotes, controls, surrogates
usages = st.builds(Usage, st.integers(0, 10**6), st.integers(0, 10**6), st.integers(0, 10**6))
reasons = st.sampled_from(list(FinishReason))


def _dumps(obj: Any) -> str:
    return json.dumps(obj, separators=(",", ":"))


def _reference_body(chat: bool, rid: str, created: int, model: str, text: str, reason: FinishReason,
                    usage: Usage) -> bytes:
    choice: dict[str, Any] = {"index": 0}
    if chat:
        choice["message"] = {"role": "assistant", "content": text}
    else:
        choice["text"] = text
    choice.update(logprobs=None, finish_reason=REASONS[reason])
    return _dumps({"id": rid, "object": "chat.completion" if chat else "text_completion", "created": created,
                   "model": model, "choices": [choice], "usage": usage_json(usage)}).encode()


def _reference_final(chat: bool, envelope: dict[str, Any], first: bool, text: str, reason: FinishReason,
                     usage: Usage, include_usage: bool) -> bytes:
    choice: dict[str, Any] = {"index": 0}
    if chat:
        delta: dict[str, Any] = {"role": "assistant"} if first else {}
        if text or first:
            delta["content"] = text
        choice["delta"] = delta
    else:
        choice["text"] = text
    choice.update(logprobs=None, finish_reason=REASONS[reason])
    last: dict[str, Any] = {**envelope, "choices": [choice]}
    if include_usage:
        last["usage"] = None
    out = "data: " + _dumps(last) + "\n\n"
    if include_usage:
        out += "data: " + _dumps({**envelope, "choices": [], "usage": usage_json(usage)}) + "\n\n"
    return out.encode() + DONE


@given(chat=st.booleans(), rid=texts, created=st.integers(0, 2**40), model=texts, text=texts, reason=reasons,
       usage=usages)
def test_completion_body_matches_json_dumps(chat: bool, rid: str, created: int, model: str, text: str,
                                            reason: FinishReason, usage: Usage) -> None:
    assert completion_body(chat, rid, created, model, text, reason, usage) == _reference_body(
        chat, rid, created, model, text, reason, usage)


@given(chat=st.booleans(), include_usage=st.booleans(), rid=texts, created=st.integers(0, 2**40), model=texts,
       chunks=st.lists(texts, max_size=3), last=texts, reason=reasons, usage=usages)
def test_sse_chunks_match_json_dumps(chat: bool, include_usage: bool, rid: str, created: int, model: str,
                                     chunks: list[str], last: str, reason: FinishReason, usage: Usage) -> None:
    envelope = {"id": rid, "object": "chat.completion.chunk" if chat else "text_completion", "created": created,
                "model": model}
    writer = SseWriter(chat, rid, created, model, include_usage)
    for i, text in enumerate(chunks):
        choice: dict[str, Any] = {"index": 0}
        if chat:
            choice["delta"] = {"role": "assistant", "content": text} if i == 0 else {"content": text}
        else:
            choice["text"] = text
        choice.update(logprobs=None, finish_reason=None)
        chunk: dict[str, Any] = {**envelope, "choices": [choice]}
        if include_usage:
            chunk["usage"] = None
        assert writer.text(text) == ("data: " + _dumps(chunk) + "\n\n").encode()
    assert writer.final(last, reason, usage) == _reference_final(chat, envelope, not chunks, last, reason, usage,
                                                                 include_usage)
