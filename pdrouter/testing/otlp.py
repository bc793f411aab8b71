"""An OTLP trace receiver in the test's process: what a collector would get from pd-router's processes.

``OtlpSink`` listens on two loopback ports, as a collector does: OTLP/HTTP (``POST /v1/traces``,
protobuf, plain or gzip) and OTLP/gRPC (``TraceService/Export``), and keeps every span it is sent
as a :class:`ReceivedSpan` (ids as hex, the service that sent it, its attributes as plain values).
Point a process at it with :meth:`OtlpSink.environment`. It needs the ``otel`` extra.
"""

from __future__ import annotations

import gzip
import threading
from collections.abc import Iterator
from concurrent import futures
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc


@dataclass(frozen=True)
class ReceivedSpan:
    service: str
    name: str
    trace_id: str
    span_id: str
    parent_id: str
    """Empty for a root span."""
    kind: int
    """OTLP's: 1 internal, 2 server, 3 client."""
    start_ns: int
    end_ns: int
    attributes: dict[str, Any] = field(default_factory=dict)
    status_code: int = 0
    """OTLP's: 0 unset, 1 ok, 2 error."""


SERVER, CLIENT, INTERNAL = 2, 3, 1


def _value(v: Any) -> Any:
    which = v.WhichOneof("value")
    if which == "array_value":
        return [_value(x) for x in v.array_value.values]
    return getattr(v, which) if which else None


class OtlpSink:
    """Collects the spans exported to it over OTLP/HTTP and OTLP/gRPC; a context manager."""

    def __init__(self) -> None:
        self._spans: list[ReceivedSpan] = []
        self._lock = threading.Lock()
        self.exports = 0
        sink = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("content-length", "0")))
                if self.headers.get("content-encoding") == "gzip":
                    body = gzip.decompress(body)
                sink._take(trace_service_pb2.ExportTraceServiceRequest.FromString(body))
                reply = trace_service_pb2.ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("content-type", "application/x-protobuf")
                self.send_header("content-length", str(len(reply)))
                self.end_headers()
                self.wfile.write(reply)

            def log_message(self, format: str, *args: Any) -> None:
                return

        class Servicer(trace_service_pb2_grpc.TraceServiceServicer):
            def Export(self, request: Any, context: Any) -> Any:
                sink._take(request)
                return trace_service_pb2.ExportTraceServiceResponse()

        self._http = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._http_thread = threading.Thread(target=self._http.serve_forever, name="otlp-http", daemon=True)
        self._grpc = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(Servicer(), self._grpc)
        self.grpc_port = self._grpc.add_insecure_port("127.0.0.1:0")

    @property
    def http_endpoint(self) -> str:
        """The OTLP/HTTP traces URL (``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT``)."""
        return f"http://127.0.0.1:{self._http.server_address[1]}/v1/traces"

    @property
    def grpc_endpoint(self) -> str:
        return f"http://127.0.0.1:{self.grpc_port}"

    def environment(self, protocol: str = "http/protobuf", service: str | None = None) -> dict[str, str]:
        """The variables that make a pd-router process export its spans here, within 50 ms."""
        env = {"OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": protocol, "OTEL_BSP_SCHEDULE_DELAY": "50",
               "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": self.http_endpoint if protocol == "http/protobuf"
               else self.grpc_endpoint}
        if service is not None:
            env["OTEL_SERVICE_NAME"] = service
        return env

    def _take(self, request: Any) -> None:
        spans = []
        for resource_spans in request.resource_spans:
            attrs = {a.key: _value(a.value) for a in resource_spans.resource.attributes}
            service = str(attrs.get("service.name", ""))
            for scope in resource_spans.scope_spans:
                for s in scope.spans:
                    spans.append(ReceivedSpan(
                        service, s.name, s.trace_id.hex(), s.span_id.hex(), s.parent_span_id.hex(), s.kind,
                        s.start_time_unix_nano, s.end_time_unix_nano,
                        {a.key: _value(a.value) for a in s.attributes}, s.status.code))
        with self._lock:
            self._spans.extend(spans)
            self.exports += 1

    @property
    def spans(self) -> list[ReceivedSpan]:
        with self._lock:
            return list(self._spans)

    def trace(self, trace_id: str) -> list[ReceivedSpan]:
        return [s for s in self.spans if s.trace_id == trace_id]

    def __enter__(self) -> OtlpSink:
        self._http_thread.start()
        self._grpc.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._http.shutdown()
        self._http.server_close()
        self._grpc.stop(0)

    def __iter__(self) -> Iterator[ReceivedSpan]:
        return iter(self.spans)
