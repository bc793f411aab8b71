"""One request's trip through the orchestrator, as the front doors see it: text pieces and timing.

:func:`stream_pieces` iterates the orchestrator's ``TokenDelta`` stream, decodes text
incrementally, applies stop strings, records time to first token and inter-token latency, and
always closes the orchestrator's iterator when it ends early (client gone, stop string, error),
which cancels the request on the workers. Protocol shaping (SSE, protobuf) stays in the doors.
"""

from __future__ import annotations

import time
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import dataclass

from pdrouter.core.errors import UnavailableError
from pdrouter.router.frontdoor.detokenize import TextStream
from pdrouter.router.metrics import FrontdoorMetrics
from pdrouter.router.request import FinishReason, Orchestrator, RouterRequest, TokenDelta, Usage


@dataclass(frozen=True, slots=True)
class Piece:
    """New output of a stream: tokens and the text they completed. The last piece is finished."""

    text: str
    token_ids: tuple[int, ...]
    finish_reason: FinishReason | None = None
    usage: Usage | None = None


async def _close(stream: AsyncIterator[TokenDelta]) -> None:
    aclose = getattr(stream, "aclose", None)
    if aclose is not None:
        await aclose()


async def stream_pieces(orchestrator: Orchestrator, request: RouterRequest, text: TextStream,
                        metrics: FrontdoorMetrics, arrival: float) -> AsyncGenerator[Piece, None]:
    """Pieces of ``request``'s output; the last one has ``finish_reason`` and ``usage``.

    ``arrival`` is the ``time.perf_counter()`` at which the front door received the request.
    After yielding the last piece the generator lets the orchestrator's stream run to its end
    (so the request finishes normally on the workers), unless a stop string cut the output, in
    which case the stream is closed at once. Errors of the orchestrator propagate unchanged; the
    caller must close this generator (``contextlib.aclosing``) when it stops early.
    """
    deltas = orchestrator.generate(request)
    prompt_len = len(request.prompt_token_ids)
    metrics.prompt_tokens.inc(prompt_len)
    generated = 0
    last_token_at = 0.0
    try:
        async for delta in deltas:
            ids = delta.token_ids
            chunk = ""
            if ids:
                now = time.perf_counter()
                if generated:
                    metrics.itl.observe((now - last_token_at) / len(ids))
                else:
                    metrics.ttft.observe(now - arrival)
                last_token_at = now
                generated += len(ids)
                chunk = text.push(ids)
                if text.stopped:  # a stop string: end here, and cancel the rest on the workers
                    usage = delta.usage if delta.usage is not None else Usage(prompt_len, generated)
                    yield Piece(chunk, ids, FinishReason.STOP, usage)
                    return
            if delta.finish_reason is not None:
                chunk += text.flush()
                reason = FinishReason.STOP if text.stopped else delta.finish_reason
                usage = delta.usage if delta.usage is not None else Usage(prompt_len, generated)
                yield Piece(chunk, ids, reason, usage)
                async for _ in deltas:  # the orchestrator's stream should end here
                    pass
                return
            if ids:
                yield Piece(chunk, ids)
        raise UnavailableError(f"request {request.request_id}: the token stream ended without a "
                               f"finish reason")
    finally:
        metrics.generation_tokens.inc(generated)
        await _close(deltas)
