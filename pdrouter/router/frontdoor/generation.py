"""One request's trip through the dispatcher, as the front doors see it: text pieces and timing.

:func:`stream_pieces` iterates the dispatcher's ``TokenDelta`` stream, decodes text
incrementally, applies stop strings, records time to first token and inter-token latency, and
always closes the dispatcher's iterator when it ends early (client gone, stop string, error),
which cancels the request on the workers. Protocol shaping (SSE, protobuf) stays in the doors.
"""

from __future__ import annotations

import time
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import dataclass

from pdrouter.core.errors import UnavailableError
from pdrouter.router.frontdoor.detokenize import TextStream
from pdrouter.router.metrics import FrontdoorMetrics
from pdrouter.router.request import Dispatcher, FinishReason, RouterRequest, TokenDelta, Usage


@dataclass(slots=True)
class Piece:
    """New output of a stream: tokens and the text they completed. The last piece is finished.

    One per delta of the stream, so a plain slotted dataclass (a frozen one costs three times as
    much to build): treat it as a value.
    """

    text: str
    token_ids: tuple[int, ...]
    finish_reason: FinishReason | None = None
    usage: Usage | None = None


async def _close(stream: AsyncIterator[TokenDelta]) -> None:
    aclose = getattr(stream, "aclose", None)
    if aclose is not None:
        await aclose()


def _push_each(text: TextStream, ids: tuple[int, ...]) -> tuple[str, int]:
    """Push ``ids`` one by one until a stop string completes: (their text, how many were taken)."""
    parts = []
    for i, token in enumerate(ids):
        parts.append(text.push((token,)))
        if text.stopped:
            return "".join(parts), i + 1
    return "".join(parts), len(ids)


class PieceState:
    """What :func:`stream_pieces` keeps of a stream as it goes: its text decoder, the tokens produced,
    when the last came. A front door's ``TokenSink`` shares it, to do a later delta's work outside
    the stream (``later_text``) exactly as the stream would."""

    __slots__ = ("generated", "last_token_at", "metrics", "text")

    def __init__(self, text: TextStream, metrics: FrontdoorMetrics) -> None:
        self.text = text
        self.metrics = metrics
        self.generated = 0
        self.last_token_at = 0.0

    def later_text(self, ids: tuple[int, ...]) -> str:
        """The text of a delta of ``ids`` after the first, not the last, of a stream without stop
        strings: its inter-token latency observed and its tokens counted, as :func:`stream_pieces` does."""
        now = time.perf_counter()
        self.metrics.itl.observe((now - self.last_token_at) / len(ids))
        self.last_token_at = now
        self.generated += len(ids)
        return self.text.push(ids)


async def stream_pieces(dispatcher: Dispatcher, request: RouterRequest, text: TextStream,
                        metrics: FrontdoorMetrics, arrival: float,
                        stop_strings: bool = False, state: PieceState | None = None) -> AsyncGenerator[Piece, None]:
    """Pieces of ``request``'s output; the last one has ``finish_reason`` and ``usage``.

    ``arrival`` is the ``time.perf_counter()`` at which the front door received the request.
    After yielding the last piece the generator lets the dispatcher's stream run to its end
    (so the request finishes normally on the workers), unless a stop string cut the output, in
    which case the stream is closed at once. Errors of the dispatcher propagate unchanged; the
    caller must close this generator (``contextlib.aclosing``) when it stops early.

    Time to first token and inter-token latency go to ``metrics`` as the deltas come, except the
    time to first token of a ``whole`` request whose tokens all came at once (it is not known).

    A delta of several tokens is one piece (its text decoded at once). ``stop_strings``: ``text``
    cuts at stop strings; such a delta is then decoded token by token, so the output ends at the
    token that completed the stop string and ``usage`` counts the tokens up to it, exactly as if
    the tokens had come one by one.

    ``state``: the stream's progress, shared with the caller (``PieceState``; one of its own if None).
    """
    deltas = dispatcher.generate(request)
    whole = request.whole
    prompt_len = len(request.prompt_token_ids)
    metrics.prompt_tokens.inc(prompt_len)
    if state is None:
        state = PieceState(text, metrics)
    try:
        async for delta in deltas:
            ids = delta.token_ids
            chunk = ""
            if ids:
                now = time.perf_counter()
                if state.generated:
                    metrics.itl.observe((now - state.last_token_at) / len(ids))
                elif not (whole and delta.finish_reason is not None and len(ids) > 1):
                    metrics.ttft.observe(now - arrival)  # (not known when every token came at once)
                state.last_token_at = now
                if stop_strings and len(ids) > 1:
                    chunk, taken = _push_each(text, ids)
                else:
                    chunk, taken = text.push(ids), len(ids)
                state.generated += taken
                if text.stopped:  # a stop string: end here, and cancel the rest on the workers
                    if taken < len(ids):  # it ended before the delta's last token
                        ids, usage = ids[:taken], Usage(prompt_len, state.generated)
                    else:
                        usage = delta.usage if delta.usage is not None else Usage(prompt_len, state.generated)
                    yield Piece(chunk, ids, FinishReason.STOP, usage)
                    return
            if delta.finish_reason is not None:
                chunk += text.flush()
                reason = FinishReason.STOP if text.stopped else delta.finish_reason
                usage = delta.usage if delta.usage is not None else Usage(prompt_len, state.generated)
                yield Piece(chunk, ids, reason, usage)
                async for _ in deltas:  # the dispatcher's stream should end here
                    pass
                return
            if ids:
                yield Piece(chunk, ids)
        raise UnavailableError(f"request {request.request_id}: the token stream ended without a "
                               f"finish reason")
    finally:
        metrics.generation_tokens.inc(state.generated)
        await _close(deltas)
