"""A request's span at the front doors (only when the router traces, ``pdrouter.core.tracing``):
what it is described with, and how it ends. Both doors use these, so a trace reads the same
whichever door a request came through."""

from __future__ import annotations

import asyncio
from typing import Any

from pdrouter.core.tracing import Tracing
from pdrouter.router.request import RouterRequest


def describe(span: Any, request: RouterRequest) -> None:
    """A request's span gets what it asks for: its ids, its tenant, its model and size."""
    span.set_attribute("pdrouter.request_id", request.request_id)
    if request.label is not None:
        span.set_attribute("pdrouter.request_label", request.label)
    if request.tenant is not None:
        span.set_attribute("pdrouter.tenant", request.tenant.name)
    span.set_attribute("gen_ai.request.model", request.model)
    span.set_attribute("gen_ai.request.max_tokens", request.sampling.max_tokens)
    span.set_attribute("gen_ai.usage.input_tokens", len(request.prompt_token_ids))


def end_span(tracing: Tracing | None, span: Any, error: BaseException | None) -> None:
    """End a request's span, marked failed when ``error`` is a failure (a client that left is not)."""
    if error is not None and tracing is not None and not isinstance(error, asyncio.CancelledError | GeneratorExit):
        tracing.failed(span, error)
    span.end()
