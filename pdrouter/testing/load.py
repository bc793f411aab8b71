"""A closed-loop load on a router that every request of is classified, for the tests and benchmarks
that break things under load (kill workers, send bad input) and then check nothing else broke.

:func:`classified_load` is ``pdrouter.bench.runner``'s closed loop (``concurrency`` requests in
flight, each slot sending its next one when the previous one ends) over streamed completions: a
shared prompt (the request's number picks which, so the prefix index fills) and a unique question,
sent as the prompt's UTF-8 bytes for token ids. :class:`LoadOutcomes` sorts the answers.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import overload

from pdrouter.bench.runner import RunConfig, run
from pdrouter.bench.stats import RequestRecord
from pdrouter.bench.workload import RequestSpec

CRASH_REPLY = "Internal Server Error"
"""The one answer of the router that is not the API's error object: the plain-text 500 its HTTP
server writes for a request whose handler raised (``pdrouter.router.http_server``); every other
failure is answered through the error tree's JSON reply."""


@dataclass
class LoadOutcomes:
    """How the requests of a load ended."""

    ok: int = 0
    failed_cleanly: int = 0
    """An HTTP error status with the API's error object, or an error event in the stream."""
    hung: int = 0
    """No answer within the request bound."""
    broken: list[str] = field(default_factory=list)
    """Answers that were neither a completion nor a clean error (a dropped connection, a body that
    is not the API's error object, a stream cut short), described."""

    def add(self, record: RequestRecord) -> None:
        """Count one request as the bench client recorded it."""
        if record.ok:
            self.ok += 1
        elif record.error == "timeout":
            self.hung += 1
        elif record.error == "stream_error" or (record.error.startswith("http_") and record.detail != CRASH_REPLY):
            self.failed_cleanly += 1
        else:
            self.broken.append(f"{record.error_kind} {record.detail}")


class _Questions(Sequence[RequestSpec]):
    """Request ``i``: shared prompt ``i mod len(prompts)`` and question ``i``, built when drawn."""

    def __init__(self, prompts: Sequence[str], max_tokens: int, count: int) -> None:
        self._prompts = prompts
        self._max_tokens = max_tokens
        self._count = count

    def __len__(self) -> int:
        return self._count

    def _spec(self, i: int) -> RequestSpec:
        if not 0 <= i < self._count:
            raise IndexError(i)
        text = self._prompts[i % len(self._prompts)] + f"Question {i}: why is the sky blue?"
        return RequestSpec(index=i, prompt=tuple(text.encode()), max_tokens=self._max_tokens)

    @overload
    def __getitem__(self, i: int) -> RequestSpec: ...
    @overload
    def __getitem__(self, i: slice) -> Sequence[RequestSpec]: ...
    def __getitem__(self, i: int | slice) -> RequestSpec | Sequence[RequestSpec]:
        if isinstance(i, slice):
            return [self._spec(j) for j in range(*i.indices(self._count))]
        return self._spec(i)

    def __iter__(self) -> Iterator[RequestSpec]:
        return (self._spec(i) for i in range(self._count))


async def classified_load(port: int, outcomes: LoadOutcomes, *, model: str, prompts: Sequence[str], concurrency: int,
                          until: float, bound_s: float, max_tokens: int = 32) -> None:
    """``concurrency`` slots sending completions to the router's HTTP door on ``port`` one after
    another until ``until`` (loop time), every answer counted into ``outcomes``. Cancelling it ends
    the load; the requests in flight then are not counted."""
    duration = until - asyncio.get_running_loop().time()
    if duration <= 0:
        return
    config = RunConfig(base_url=f"http://127.0.0.1:{port}/v1", model=model, concurrency=concurrency,
                       duration_s=duration, timeout_s=bound_s)
    # At most one request a millisecond per slot: a bound no load here reaches, never materialized.
    specs = _Questions(prompts, max_tokens, concurrency * max(1, int(duration * 1000)))
    await run(config, specs, on_record=outcomes.add)
