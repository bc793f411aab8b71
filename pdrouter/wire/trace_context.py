"""Trace context on the wire: calls carry it, servicers continue it.

* :func:`call_metadata`: the ``traceparent`` / ``tracestate`` pairs a call sends (gRPC metadata, or
  the lane's ``META`` frame: both stubs take ``metadata=``), None when the process does not trace;
* :func:`traced`: decorates a worker servicer method (unary or streaming) whose servicer has a
  ``tracing`` attribute: with tracing on, the call runs in a server span continuing the caller's
  trace (from ``context.invocation_metadata()``, which the gRPC context and the lane's both have),
  as OpenTelemetry's current span, so spans made inside it, and calls made from it, join the trace.
  With tracing off the method runs as it is: a streaming method's own generator is returned.
"""

from __future__ import annotations

import functools
import inspect
import time
from collections.abc import AsyncIterator, Callable, Mapping
from typing import Any, TypeVar

from pdrouter.core.tracing import Tracing

F = TypeVar("F", bound=Callable[..., Any])


def call_metadata(tracing: Tracing | None, span: Any = None) -> list[tuple[str, str]] | None:
    """The trace context of ``span`` (None: the current span) as call metadata; None without tracing."""
    if tracing is None:
        return None
    return list(tracing.headers(span).items()) or None


def _attributes(name: str) -> dict[str, str]:
    service, _, method = name.rpartition("/")
    return {"rpc.system": "grpc", "rpc.service": service, "rpc.method": method}


async def _traced_stream(tracing: Tracing, name: str, context: Any,
                         responses: AsyncIterator[Any]) -> AsyncIterator[Any]:
    span = tracing.incoming(name, context.invocation_metadata(), _attributes(name))
    try:
        with tracing.current(span):
            async for item in responses:
                yield item
    except BaseException as exc:
        tracing.failed(span, exc)
        raise
    finally:
        aclose = getattr(responses, "aclose", None)
        if aclose is not None:
            await aclose()
        span.end()


def traced(name: str) -> Callable[[F], F]:
    """Run a servicer method in a server span named ``name`` (``pdrouter.v1.Service/Method``) when
    its servicer's ``tracing`` is set (see the module docstring). Put it above ``grpc_errors``."""

    def decorate(fn: F) -> F:
        if inspect.isasyncgenfunction(fn):
            @functools.wraps(fn)
            def stream(self: Any, request: Any, context: Any) -> AsyncIterator[Any]:
                responses = fn(self, request, context)
                tracing: Tracing | None = self.tracing
                if tracing is None:
                    return responses
                return _traced_stream(tracing, name, context, responses)

            return stream  # type: ignore[return-value]

        @functools.wraps(fn)
        async def unary(self: Any, request: Any, context: Any) -> Any:
            tracing: Tracing | None = self.tracing
            if tracing is None:
                return await fn(self, request, context)
            span = tracing.incoming(name, context.invocation_metadata(), _attributes(name))
            try:
                with tracing.current(span):
                    return await fn(self, request, context)
            except BaseException as exc:
                tracing.failed(span, exc)
                raise
            finally:
                span.end()

        return unary  # type: ignore[return-value]

    return decorate


def past_span(tracing: Tracing, name: str, start: float, end: float,
              attributes: Mapping[str, Any] | None = None) -> None:
    """A span under the current one for work that ran from ``start`` to ``end`` (``time.perf_counter()``
    readings), made once it is over."""
    now_ns, now = time.time_ns(), time.perf_counter()
    span = tracing.span(name, attributes=attributes, start_time_ns=now_ns - int((now - start) * 1e9))
    span.end(end_time=now_ns - int((now - end) * 1e9))
