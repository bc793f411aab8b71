"""Trace context on the wire: calls carry it, servicers continue it.

* :func:`call_metadata`: the ``traceparent`` / ``tracestate`` pairs a call sends (gRPC metadata, or
  the lane's ``META`` frame: both stubs take ``metadata=``), None when the process does not trace;
* :class:`traced`: decorates a worker servicer method (unary or streaming) whose servicer has a
  ``tracing`` attribute: with tracing on, the call runs in a server span continuing the caller's
  trace (from ``context.invocation_metadata()``, which the gRPC context and the lane's both have),
  as OpenTelemetry's current span, so spans made inside it, and calls made from it, join the trace.
  With tracing off the servers are handed the method itself.
"""

from __future__ import annotations

import functools
import inspect
import time
import types
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


class traced:
    """Run a servicer method in a server span named ``name`` (``pdrouter.v1.Service/Method``) when its
    servicer's ``tracing`` is set (see the module docstring). Put it above ``grpc_errors``.

    A descriptor: reading the method off a servicer whose ``tracing`` is None gives the method
    itself, so a server (gRPC or the lane), which reads it once when the servicer is registered,
    calls it with nothing in between. With tracing it gives the traced method, of the same kind
    (a coroutine function, or an async generator function: what gRPC tells apart).
    """

    def __init__(self, name: str) -> None:
        self.name = name
        self.attributes = _attributes(name)
        self.fn: Callable[..., Any] | None = None

    def __call__(self, fn: F) -> F:
        self.fn = fn
        functools.update_wrapper(self, fn)
        return self  # type: ignore[return-value]

    def __get__(self, instance: Any, owner: type | None = None) -> Any:
        fn = self.fn
        assert fn is not None
        if instance is None:
            return self
        tracing: Tracing | None = getattr(instance, "tracing", None)
        if tracing is None:
            return fn.__get__(instance, owner)
        name, attributes = self.name, self.attributes
        if inspect.isasyncgenfunction(fn):
            async def stream(servicer: Any, request: Any, context: Any) -> AsyncIterator[Any]:
                span = tracing.incoming(name, context.invocation_metadata(), attributes)
                responses = fn(servicer, request, context)
                try:
                    with tracing.current(span):
                        async for item in responses:
                            yield item
                except BaseException as exc:
                    if not isinstance(exc, GeneratorExit):
                        tracing.failed(span, exc)
                    raise
                finally:
                    await responses.aclose()
                    span.end()

            return types.MethodType(stream, instance)

        async def unary(servicer: Any, request: Any, context: Any) -> Any:
            span = tracing.incoming(name, context.invocation_metadata(), attributes)
            try:
                with tracing.current(span):
                    return await fn(servicer, request, context)
            except BaseException as exc:
                tracing.failed(span, exc)
                raise
            finally:
                span.end()

        return types.MethodType(unary, instance)


def past_span(tracing: Tracing, name: str, start: float, end: float,
              attributes: Mapping[str, Any] | None = None) -> None:
    """A span under the current one for work that ran from ``start`` to ``end`` (``time.perf_counter()``
    readings), made once it is over."""
    now_ns, now = time.time_ns(), time.perf_counter()
    span = tracing.span(name, attributes=attributes, start_time_ns=now_ns - int((now - start) * 1e9))
    span.end(end_time=now_ns - int((now - end) * 1e9))
