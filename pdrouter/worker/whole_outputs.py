"""A non-streaming caller's engine outputs, merged: every token waits for the finish (``whole``).

Pure: engine outputs in, engine outputs out; no gRPC.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, AsyncIterator

from pdrouter.engine.outputs import RequestOutput

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
            yield out._replace(new_token_ids=(*held, *out.new_token_ids)) if held else out
            return
        held.extend(out.new_token_ids)
        last = out
        if len(held) >= limit:
            yield out._replace(new_token_ids=tuple(held))
            held = []
    if held and last is not None:
        yield last._replace(new_token_ids=tuple(held))
