"""Engine outputs → ``TokenChunk`` messages, streamed or (``whole``) merged first."""

from __future__ import annotations

from collections.abc import AsyncGenerator, AsyncIterator
from contextlib import aclosing
from typing import Any

from pdrouter.engine.outputs import FinishReason, OutputSink, RequestOutput
from pdrouter.wire.v1 import common_pb2
from pdrouter.worker.whole_outputs import whole_outputs

_FINISH_TO_PB = {FinishReason.STOP: common_pb2.FINISH_REASON_STOP,
                 FinishReason.LENGTH: common_pb2.FINISH_REASON_LENGTH}


def chunk_sink(request_id: str, context: Any) -> OutputSink | None:
    """For a streaming call over the lane: an ``OutputSink`` that sends each unfinished output as its
    chunk at once (``LaneContext.send_nowait``), the chunk :func:`token_chunks` would have yielded. None
    for a gRPC call, whose context cannot send outside the handler's iteration."""
    send_nowait = getattr(context, "send_nowait", None)
    if send_nowait is None:
        return None
    # One message for the request, its tokens replaced each time: ``send_nowait`` serializes it before
    # it returns, and setting a repeated field costs less than building the message (its id) again.
    chunk = common_pb2.TokenChunk(request_id=request_id)
    token_ids = chunk.token_ids

    def sink(out: RequestOutput) -> bool:
        token_ids[:] = out.new_token_ids
        return bool(send_nowait(chunk))

    return sink


async def token_chunks(request_id: str, outputs: AsyncIterator[RequestOutput], cached_tokens: int | None = None,
                       whole: bool = False) -> AsyncGenerator[common_pb2.TokenChunk, None]:
    """One chunk per engine output; the finished one carries finish_reason and usage.

    ``whole`` (the caller does not stream): the outputs are merged first (:func:`whole_outputs`), so
    a request is one chunk with every token and the finish, whatever its length (up to
    ``WHOLE_CHUNK_TOKENS``).
    """
    if whole:
        async with aclosing(whole_outputs(outputs)) as merged:
            async for chunk in token_chunks(request_id, merged, cached_tokens):
                yield chunk
        return
    async for out in outputs:
        chunk = common_pb2.TokenChunk(request_id=request_id, token_ids=out.new_token_ids)
        if out.finished:
            chunk.finish_reason = _FINISH_TO_PB.get(out.finish_reason,  # type: ignore[arg-type]
                                                    common_pb2.FINISH_REASON_STOP)
            chunk.usage.prompt_tokens = out.num_prompt_tokens
            chunk.usage.completion_tokens = out.num_output_tokens
            chunk.usage.cached_tokens = out.num_cached_tokens if cached_tokens is None else cached_tokens
        yield chunk
