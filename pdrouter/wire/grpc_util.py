"""gRPC plumbing shared by every server and client: status mapping, servers with health, shutdown.

Servicers raise ``PdRouterError`` subclasses; ``grpc_errors`` turns them into the matching status
code with the error's message (the mapping lives in ``pdrouter.core.errors``). Clients turn an
``AioRpcError`` back into the closest ``PdRouterError`` with ``from_rpc_error``.
"""

from __future__ import annotations

import functools
import inspect
import logging
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any, TypeVar

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from pdrouter.core.errors import PdRouterError, UnavailableError, error_from_grpc_code
from pdrouter.wire.grpc_limits import GrpcLimits

log = logging.getLogger(__name__)

F = TypeVar("F", bound=Callable[..., Any])

# Low-latency defaults: gRPC sets TCP_NODELAY itself; keepalive finds dead peers within seconds.
CHANNEL_OPTIONS: list[tuple[str, Any]] = [
    ("grpc.keepalive_time_ms", 30_000),
    ("grpc.keepalive_timeout_ms", 10_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),
    ("grpc.max_receive_message_length", 64 * 1024 * 1024),
    ("grpc.max_send_message_length", 64 * 1024 * 1024),
]
SERVER_OPTIONS: list[tuple[str, Any]] = [
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.min_recv_ping_interval_without_data_ms", 10_000),
    ("grpc.http2.max_ping_strikes", 0),
    ("grpc.so_reuseport", 0),
]
"""Every server's transport options besides its :class:`GrpcLimits`."""


def status_code(exc: PdRouterError) -> grpc.StatusCode:
    return grpc.StatusCode[exc.grpc_code]


class StatusError(grpc.RpcError):
    """A call that ended, or was never made, with a status of this process's own; ``code()`` /
    ``details()`` as on a failed gRPC call (the lane's calls, a worker that did not prove itself)."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(f"{code.name}: {details}")
        self._code = code
        self._details = details

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details


RPC_ERRORS = (grpc.RpcError, grpc.aio.UsageError)
"""What a failed call raises, over gRPC or the lane (``UsageError``: the channel closed under the call)."""


def from_rpc_error(err: grpc.RpcError | grpc.aio.UsageError) -> PdRouterError:
    """The ``PdRouterError`` matching a failed call's status (UNAVAILABLE for transport errors)."""
    if isinstance(err, grpc.aio.UsageError):  # the channel was closed under the call
        return UnavailableError(f"worker connection closed: {err}")
    code = err.code() if hasattr(err, "code") else grpc.StatusCode.UNKNOWN
    details = err.details() if hasattr(err, "details") else str(err)
    name = code.name if code is not None else "UNKNOWN"
    return error_from_grpc_code(name, details or name)


def grpc_errors(fn: F) -> F:
    """Decorate a servicer method (unary or async-generator) to map PdRouterError to a status.

    The wrapper keeps the method it wraps as ``maps_errors_of``: a server that maps errors the same
    way itself (the lane) calls that instead, one frame less for every message of a stream."""
    if inspect.isasyncgenfunction(fn):
        @functools.wraps(fn)
        async def stream_wrapper(self: Any, request: Any, context: grpc.aio.ServicerContext,
                                 ) -> AsyncIterator[Any]:
            try:
                async for item in fn(self, request, context):
                    yield item
            except PdRouterError as exc:
                await context.abort(status_code(exc), exc.message)

        stream_wrapper.maps_errors_of = fn  # type: ignore[attr-defined]
        return stream_wrapper  # type: ignore[return-value]

    @functools.wraps(fn)
    async def unary_wrapper(self: Any, request: Any, context: grpc.aio.ServicerContext) -> Any:
        try:
            return await fn(self, request, context)
        except PdRouterError as exc:
            await context.abort(status_code(exc), exc.message)

    unary_wrapper.maps_errors_of = fn  # type: ignore[attr-defined]
    return unary_wrapper  # type: ignore[return-value]


class GrpcServer:
    """A grpc.aio server with the standard health service, bound to ``host:port`` (0 = any free),
    under :class:`GrpcLimits` (deadlines and caps for every peer: ``pdrouter.wire.grpc_limits``)."""

    def __init__(self, host: str = "127.0.0.1", port: int = 0,
                 options: Sequence[tuple[str, Any]] = SERVER_OPTIONS,
                 interceptors: Sequence[grpc.aio.ServerInterceptor] = (),
                 credentials: grpc.ServerCredentials | None = None,
                 limits: GrpcLimits | None = None, advertise_host: str | None = None) -> None:
        """``interceptors`` run before every call, the health service's included; ``credentials``:
        TLS (``pdrouter.wire.security.grpc_server_credentials``), or None for plaintext; ``limits``:
        default :class:`GrpcLimits`' (a worker port's). ``advertise_host``: the host callers dial
        (default ``host``): an interceptor with ``bind_identity`` is told ``advertise_host:port``, the
        address the server answers as."""
        self.limits = GrpcLimits() if limits is None else limits
        self.server = grpc.aio.server(options=[*options, *self.limits.options()],
                                      interceptors=list(interceptors) or None,
                                      maximum_concurrent_rpcs=self.limits.max_inflight)
        self.health = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        address = f"{host}:{port}"
        self.tls = credentials is not None
        self.port = (self.server.add_insecure_port(address) if credentials is None
                     else self.server.add_secure_port(address, credentials))
        if self.port == 0:
            raise OSError(f"cannot bind gRPC server to {host}:{port}")
        self.host = host
        self.identity = f"{advertise_host or host}:{self.port}"
        for interceptor in interceptors:
            bind = getattr(interceptor, "bind_identity", None)
            if bind is not None:
                bind(self.identity)
        self._service_names: list[str] = []

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    def add(self, add_fn: Callable[[Any, grpc.aio.Server], None], servicer: Any, service_name: str) -> None:
        """Register a servicer (``add_XServicer_to_server``) and its full service name for health."""
        add_fn(servicer, self.server)
        self._service_names.append(service_name)

    async def start(self) -> None:
        await self.server.start()
        for name in ["", *self._service_names]:
            await self.health.set(name, health_pb2.HealthCheckResponse.SERVING)

    async def not_serving(self) -> None:
        """Report NOT_SERVING for the server and every service (calls are still taken)."""
        for name in ["", *self._service_names]:
            await self.health.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)

    async def stop(self, grace: float = 5.0) -> None:
        """Report NOT_SERVING, refuse new calls, and let in-flight ones finish within ``grace``."""
        await self.not_serving()
        await self.server.stop(grace)

    async def wait(self) -> None:
        await self.server.wait_for_termination()


async def check_health(address: str, service: str = "", timeout: float = 2.0,
                       credentials: grpc.ChannelCredentials | None = None) -> bool:
    """True when the server at ``address`` reports SERVING for ``service`` (over TLS with ``credentials``)."""
    channel = (grpc.aio.insecure_channel(address) if credentials is None
               else grpc.aio.secure_channel(address, credentials))
    async with channel:
        stub = health_pb2_grpc.HealthStub(channel)
        try:
            resp = await stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=timeout)
        except grpc.RpcError:
            return False
        return bool(resp.status == health_pb2.HealthCheckResponse.SERVING)
