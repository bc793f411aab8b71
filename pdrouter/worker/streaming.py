"""Engine outputs → ``TokenChunk`` messages, and the services every worker serves."""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from contextlib import aclosing

import grpc

from pdrouter.core.errors import IncompatibleError, InvalidRequestError
from pdrouter.core.workers import WorkerLoad, WorkerRecord
from pdrouter.engine.outputs import FinishReason, RequestOutput
from pdrouter.wire.convert import load_to_pb, record_to_pb
from pdrouter.wire.v1 import common_pb2, worker_pb2, worker_pb2_grpc

_FINISH_TO_PB = {FinishReason.STOP: common_pb2.FINISH_REASON_STOP,
                 FinishReason.LENGTH: common_pb2.FINISH_REASON_LENGTH}

WHOLE_CHUNK_TOKENS = 1024
"""The most tokens one chunk of a ``whole`` request carries (its size stays bounded, a few KiB)."""


async def whole_outputs(outputs: AsyncIterator[RequestOutput], first_alone: bool = False,
                        limit: int = WHOLE_CHUNK_TOKENS) -> AsyncGenerator[RequestOutput, None]:
    """The engine's outputs for a caller that does not stream (``whole``), merged.

    Every token waits, and goes in one output with the finished one (or in outputs of ``limit``
    tokens, the last one finished); with ``first_alone`` the first output with tokens is passed on
    by itself first (``Serve``: its chunk carries the prefill report, which must not wait). The
    merged output carries the finished output's counts and reason, so its tokens, reason and usage
    are those of the outputs one by one. When ``outputs`` ends without finishing, what it had is
    passed on unfinished.
    """
    held: list[int] = []
    last: RequestOutput | None = None
    async for out in outputs:
        if first_alone and out.new_token_ids:
            first_alone = False
            yield out
            continue
        if out.finished:
            yield dataclasses.replace(out, new_token_ids=(*held, *out.new_token_ids)) if held else out
            return
        held.extend(out.new_token_ids)
        last = out
        if len(held) >= limit:
            yield dataclasses.replace(out, new_token_ids=tuple(held))
            held = []
    if held and last is not None:
        yield dataclasses.replace(last, new_token_ids=tuple(held))


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


class WorkerInfoServicer(worker_pb2_grpc.WorkerInfoServiceServicer):
    """``GetInfo`` / ``GetLoad`` from the worker's record and a live load callback."""

    def __init__(self, info: Callable[[], WorkerRecord], load: Callable[[], WorkerLoad],
                 geometry: common_pb2.ModelGeometry, kv_layout: common_pb2.KvLayout) -> None:
        self._info = info
        self._load = load
        self._geometry = geometry
        self._kv_layout = kv_layout

    async def GetInfo(self, request: worker_pb2.GetInfoRequest,
                      context: grpc.aio.ServicerContext) -> common_pb2.WorkerInfo:
        msg = record_to_pb(self._info())
        msg.model.CopyFrom(self._geometry)
        msg.kv_layout.CopyFrom(self._kv_layout)
        return msg

    async def GetLoad(self, request: worker_pb2.GetLoadRequest,
                      context: grpc.aio.ServicerContext) -> common_pb2.WorkerLoad:
        return load_to_pb(self._load())


def check_request(request_id: str, model_compat_hash: str, expected_compat_hash: str) -> None:
    """The checks every worker RPC starts with: a request id, and the same model on both ends."""
    if not request_id:
        raise InvalidRequestError("request_id is required")
    if model_compat_hash != expected_compat_hash:
        raise IncompatibleError(f"model_compat_hash {model_compat_hash!r} does not match this worker's "
                                f"{expected_compat_hash!r} (different model, dtype or block size)")
