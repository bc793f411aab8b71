"""An in-process ``Dispatcher`` (``pdrouter.router.request``) with a deterministic "echo" model and fault injection.

It stands in for the real dispatcher in the front doors' tests and in measurements of the
front doors' own overhead. ``EchoDispatcher`` streams the prompt's byte tokens (ids below 256)
back, one delta at a time by default, then ``<eos>`` (id 258); it honours ``max_tokens``,
``stop_token_ids`` and ``ignore_eos`` (cycling through the prompt), reports usage (with
``CACHED_TOKENS`` cached prompt tokens), and records every request and whether its stream was
closed before it finished. Directives in the prompt text make it fail on purpose:

* ``#capacity`` ``#toolarge`` ``#unavailable`` ``#deadline`` ``#notfound`` ``#crash``: raise
  that error before the first token (``#crash`` raises a plain RuntimeError);
* ``#fail-after``: two tokens, then UnavailableError;
* ``#noend``: the stream ends after two tokens without a finish reason;
* ``#stall0:TAG`` / ``#stall:TAG``: wait forever before the first token / after two tokens;
  ``events(TAG)`` gives two ``threading.Event``: set when the request reaches the dispatcher,
  and when its stream is closed early (the request cancelled).
"""

from __future__ import annotations

import asyncio
import re
import threading
from collections.abc import AsyncGenerator, AsyncIterator
from contextlib import aclosing

from pdrouter.core.errors import (
    CapacityError,
    DeadlineExceededError,
    NotFoundError,
    RequestTooLargeError,
    UnavailableError,
)
from pdrouter.router.request import FinishReason, ModelInfo, RouterRequest, TokenDelta, Usage

ECHO = ModelInfo(name="echo", max_context=128, vocab_size=512, block_size=16, created=1_700_000_000)
TINY = ModelInfo(name="tiny", max_context=24, vocab_size=512, block_size=16)
EOS = 258
CACHED_TOKENS = 3
_ERRORS: dict[str, tuple[type[Exception], str]] = {
    "#capacity": (CapacityError, "no decode worker has KV room"),
    "#toolarge": (RequestTooLargeError, "the request needs more KV than any worker has"),
    "#unavailable": (UnavailableError, "no prefill worker is reachable"),
    "#deadline": (DeadlineExceededError, "the request's deadline passed"),
    "#notfound": (NotFoundError, "no worker serves this model"),
    "#crash": (RuntimeError, "a bug"),
}
_STALL = re.compile(r"#stall(0?):([\w-]+)")


class EchoDispatcher:
    """An in-process dispatcher serving the "echo" model family (see the module docstring)."""

    def __init__(self, models: list[ModelInfo] | None = None, tokens_per_delta: int = 1) -> None:
        self._models = models if models is not None else [ECHO, TINY]
        self.tokens_per_delta = tokens_per_delta
        self.requests: list[RouterRequest] = []
        self.cancelled: list[str] = []
        self.completed: list[str] = []
        self.started: dict[str, threading.Event] = {}
        self.closed: dict[str, threading.Event] = {}
        self._lock = threading.Lock()

    def models(self) -> list[ModelInfo]:
        return list(self._models)

    def events(self, tag: str) -> tuple[threading.Event, threading.Event]:
        with self._lock:
            return (self.started.setdefault(tag, threading.Event()),
                    self.closed.setdefault(tag, threading.Event()))

    def generate(self, request: RouterRequest) -> AsyncIterator[TokenDelta]:
        return self._generate(request)

    async def _generate(self, request: RouterRequest) -> AsyncGenerator[TokenDelta, None]:
        self.requests.append(request)
        prompt = bytes(t for t in request.prompt_token_ids if t < 256).decode("utf-8", "replace")
        stall = _STALL.search(prompt)
        started, closed = self.events(stall.group(2)) if stall else (None, None)
        if started is not None:
            started.set()
        finished = False
        try:
            for directive, (error, message) in _ERRORS.items():
                if directive in prompt:
                    raise error(message)
            if stall and stall.group(1) == "0":
                await asyncio.Event().wait()
            async with aclosing(self._echo(request, prompt, stall is not None)) as deltas:
                async for delta in deltas:
                    yield delta
            finished = True
        finally:
            if finished:
                self.completed.append(request.request_id)
            else:
                self.cancelled.append(request.request_id)
                if closed is not None:
                    closed.set()

    async def _echo(self, request: RouterRequest, prompt: str, stall: bool
                    ) -> AsyncGenerator[TokenDelta, None]:
        sampling = request.sampling
        source = [t for t in request.prompt_token_ids if t < 256] or [ord("x")]
        out: list[int] = []
        pending: list[int] = []
        reason: FinishReason | None = None
        while reason is None:
            position = len(out)
            if position == len(source) and not sampling.ignore_eos:
                token = EOS
            else:
                token = source[position % len(source)]
            out.append(token)
            pending.append(token)
            if token == EOS or token in sampling.stop_token_ids:
                reason = FinishReason.STOP
            elif len(out) >= sampling.max_tokens:
                reason = FinishReason.LENGTH
            if reason is None and len(pending) < self.tokens_per_delta:
                continue
            if reason is not None:
                usage = Usage(len(request.prompt_token_ids), len(out),
                              min(CACHED_TOKENS, len(request.prompt_token_ids)))
                yield TokenDelta(tuple(pending), reason, usage)
                return
            yield TokenDelta(tuple(pending))
            pending = []
            await asyncio.sleep(0)
            if len(out) == 2 and "#fail-after" in prompt:
                raise UnavailableError("the decode worker went away")
            if len(out) == 2 and "#noend" in prompt:
                return
            if len(out) == 2 and stall:
                await asyncio.Event().wait()
