"""A non-streaming caller's engine outputs, merged: every token waits for the finish (``whole``).

Pure: engine outputs in, engine outputs out; no gRPC.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, AsyncIterator

from pdrouter.engine.outputs import RequestOutput

WHOLE_CHUNK_TOKENS = 1024
"""The most tokens one chunk of a ``whole`` request carries (its size stays bounded, a few KiB)."""


class WholeMerge:
    """The merging rule of :func:`whole_outputs`, one output at a time, for a producer that pushes
    (``pdrouter.worker.driver``: a ``whole`` request's outputs merged where they are delivered)."""

    __slots__ = ("first_alone", "held", "last", "limit")

    def __init__(self, first_alone: bool = False, limit: int = WHOLE_CHUNK_TOKENS) -> None:
        self.first_alone = first_alone
        self.limit = limit
        self.held: list[int] = []
        self.last: RequestOutput | None = None

    def add(self, out: RequestOutput) -> RequestOutput | None:
        """What goes on now for ``out``: itself (the first with tokens, with ``first_alone``), the
        tokens held merged into it (the finished one, or ``limit`` tokens), or None (held)."""
        if self.first_alone and out.new_token_ids:
            self.first_alone = False
            return out
        held = self.held
        if out.finished:
            if not held:
                return out
            self.held = []
            return out._replace(new_token_ids=(*held, *out.new_token_ids))
        held.extend(out.new_token_ids)
        self.last = out
        if len(held) < self.limit:
            return None
        self.held = []
        return out._replace(new_token_ids=tuple(held))

    def rest(self) -> RequestOutput | None:
        """The tokens still held when the outputs ended unfinished (with the last one's counts), or None."""
        if self.held and self.last is not None:
            return self.last._replace(new_token_ids=tuple(self.held))
        return None


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
    merge = WholeMerge(first_alone, limit)
    async for out in outputs:
        ready = merge.add(out)
        if ready is not None:
            yield ready
            if ready.finished:
                return
    rest = merge.rest()
    if rest is not None:
        yield rest
