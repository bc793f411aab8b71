"""Distributed tracing: W3C trace context in and out, OpenTelemetry spans exported over OTLP. Off by default.

A process traces when its environment asks for an exporter, the usual OpenTelemetry way:
``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`` or ``OTEL_EXPORTER_OTLP_ENDPOINT`` set, or
``OTEL_TRACES_EXPORTER`` naming ``otlp`` or ``console`` (``none``, or ``OTEL_SDK_DISABLED=true``,
turns it off). The SDK reads the rest itself: ``OTEL_EXPORTER_OTLP_PROTOCOL`` (``http/protobuf``,
the default, or ``grpc``), headers, timeouts, ``OTEL_SERVICE_NAME`` and ``OTEL_RESOURCE_ATTRIBUTES``,
the sampler (``OTEL_TRACES_SAMPLER``, default ``parentbased_always_on``) and the batch processor's
settings. The OpenTelemetry SDK and exporters are the optional extra ``pd-router[otel]``; asking for
tracing without them is a configuration error at start.

:func:`tracing_from_env` is read once per process, at start-up; it returns None when tracing is
off, and every caller holds ``Tracing | None``: with None, nothing here runs and nothing is
imported, so a request's path pays one ``is None`` test per place it could trace.

The context travels as W3C ``traceparent`` / ``tracestate``: in the doors' request headers (HTTP)
and metadata (gRPC), and to the workers in gRPC metadata or the lane's context frames
(``pdrouter.wire.trace_context``). The router passes its spans explicitly; workers keep the call's
span as OpenTelemetry's current context, so spans made deeper in a call join it.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

from pdrouter.core.errors import ConfigError

log = logging.getLogger(__name__)

TRACEPARENT = "traceparent"
TRACESTATE = "tracestate"
TRACE_HEADERS = (TRACEPARENT, TRACESTATE)
"""The W3C trace context headers (lower case, as gRPC metadata keys are)."""
MAX_TRACE_HEADER_CHARS = 1024
"""Longer values are ignored (W3C: a ``traceparent`` is 55 characters, a ``tracestate`` at most 512)."""
SCOPE = "pdrouter"


def wants_tracing(environ: Mapping[str, str]) -> bool:
    """Whether ``environ`` asks for traces (see the module docstring)."""
    if environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return False
    exporters = environ.get("OTEL_TRACES_EXPORTER", "").strip().lower()
    if exporters == "none":
        return False
    endpoint = environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or environ.get("OTEL_EXPORTER_OTLP_ENDPOINT")
    return bool(exporters or endpoint)


class Tracing:
    """One process's tracer: spans, and the W3C context they travel as.

    ``Span`` values are OpenTelemetry's (``set_attribute``, ``add_event``, ``set_status``, ``end``);
    ``parent`` arguments take a span, or None for the current context.
    """

    def __init__(self, provider: Any) -> None:
        from opentelemetry import context, trace
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        self._provider = provider
        self._tracer = provider.get_tracer(SCOPE)
        self._trace = trace
        self._context = context
        self._propagator = TraceContextTextMapPropagator()
        self.SERVER = trace.SpanKind.SERVER
        self.CLIENT = trace.SpanKind.CLIENT
        self.INTERNAL = trace.SpanKind.INTERNAL

    def _parent_context(self, parent: Any) -> Any:
        return None if parent is None else self._trace.set_span_in_context(parent)

    def incoming(self, name: str, headers: Iterable[tuple[str, Any]] | Mapping[str, Any] | None,
                 attributes: Mapping[str, Any] | None = None, kind: Any = None) -> Any:
        """A server span for a call that brought ``headers`` (its ``traceparent`` / ``tracestate``,
        str or bytes; a new trace without a valid ``traceparent``)."""
        carrier = _carrier(headers)
        parent = self._propagator.extract(carrier) if carrier else None
        return self._tracer.start_span(name, parent, self.SERVER if kind is None else kind, attributes)

    def span(self, name: str, parent: Any = None, attributes: Mapping[str, Any] | None = None,
             kind: Any = None, start_time_ns: int | None = None) -> Any:
        """A span under ``parent`` (None: the current span), started now or at ``start_time_ns``."""
        return self._tracer.start_span(name, self._parent_context(parent), self.INTERNAL if kind is None else kind,
                                       attributes, start_time=start_time_ns)

    def headers(self, span: Any = None) -> dict[str, str]:
        """``traceparent`` (and ``tracestate``) of ``span``'s context (None: the current one)."""
        carrier: dict[str, str] = {}
        self._propagator.inject(carrier, self._parent_context(span))
        return carrier

    @contextlib.contextmanager
    def current(self, span: Any) -> Iterator[Any]:
        """``span`` is the current span inside the block (spans made there, and calls' headers, follow it)."""
        token = self._context.attach(self._trace.set_span_in_context(span))
        try:
            yield span
        finally:
            with contextlib.suppress(ValueError):  # detached in another context (a generator closed elsewhere)
                self._context.detach(token)

    @staticmethod
    def failed(span: Any, exc: BaseException) -> None:
        """Mark ``span`` as failed with ``exc`` (its type and message; an exception event)."""
        from opentelemetry.trace import Status, StatusCode

        span.record_exception(exc)
        span.set_status(Status(StatusCode.ERROR, f"{type(exc).__name__}: {getattr(exc, 'message', exc)}"))

    def shutdown(self) -> None:
        """Export what is still buffered and stop (at process exit)."""
        self._provider.shutdown()


def _carrier(headers: Iterable[tuple[str, Any]] | Mapping[str, Any] | None) -> dict[str, str]:
    if headers is None:
        return {}
    items = headers.items() if isinstance(headers, Mapping) else headers
    out: dict[str, str] = {}
    for name, value in items:
        if name in TRACE_HEADERS and value is not None:
            text = value.decode("latin-1") if isinstance(value, bytes | bytearray) else str(value)
            if len(text) <= MAX_TRACE_HEADER_CHARS:
                out[name] = text
    return out


def tracing_from_env(service_name: str, environ: Mapping[str, str] | None = None) -> Tracing | None:
    """The process's :class:`Tracing` per the OpenTelemetry variables of ``environ`` (default:
    ``os.environ``), None when they ask for none. ``service_name``: the ``service.name`` unless
    ``OTEL_SERVICE_NAME`` says otherwise. ConfigError when tracing is asked for and cannot be set up."""
    env = os.environ if environ is None else environ
    if not wants_tracing(env):
        return None
    try:
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter
    except ImportError:
        raise ConfigError("tracing is asked for (OTEL_* environment variables) but the OpenTelemetry SDK is not "
                          "installed: pip install 'pd-router[otel]'") from None
    attributes = {} if env.get("OTEL_SERVICE_NAME") else {"service.name": service_name}
    provider = TracerProvider(resource=Resource.create(attributes))
    names = [n.strip() for n in env.get("OTEL_TRACES_EXPORTER", "otlp").lower().split(",") if n.strip()] or ["otlp"]
    for name in names:
        if name == "console":
            exporter: Any = ConsoleSpanExporter()
        elif name == "otlp":
            exporter = _otlp_exporter(env)
        else:
            raise ConfigError(f"OTEL_TRACES_EXPORTER={name!r}: this build exports traces with otlp or console")
        provider.add_span_processor(BatchSpanProcessor(exporter))
    log.info("tracing on: %s spans exported with %s", service_name, ", ".join(names))
    return Tracing(provider)


def _otlp_exporter(env: Mapping[str, str]) -> Any:
    protocol = (env.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL") or env.get("OTEL_EXPORTER_OTLP_PROTOCOL")
                or "http/protobuf").strip().lower()
    try:
        if protocol == "grpc":
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter as GrpcExporter

            return GrpcExporter()
        if protocol == "http/protobuf":
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter as HttpExporter

            return HttpExporter()
    except ImportError:
        raise ConfigError(f"OTLP over {protocol} is asked for but its exporter is not installed: "
                          f"pip install 'pd-router[otel]'") from None
    raise ConfigError(f"OTEL_EXPORTER_OTLP_PROTOCOL={protocol!r}: use http/protobuf or grpc")
