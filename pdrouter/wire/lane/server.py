"""The worker end of the lane: ``LaneServer`` serves the registered servicer methods on one TCP port.

Each ``CALL`` runs its handler in a task under the call's deadline, with a ``LaneContext`` for the
part of ``grpc.aio.ServicerContext`` the servicers use; a handler's failure becomes the ``END``
status, as a gRPC server would send it (``LaneContext.abort``'s code, a ``PdRouterError``'s gRPC
code, else UNKNOWN). A ``CANCEL`` or a lost connection cancels the handler: nobody is left to answer.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import Callable
from typing import Any, cast

import grpc
from google.protobuf.message import DecodeError, Message

from pdrouter.core.errors import PdRouterError
from pdrouter.wire.lane.frames import (
    CALL,
    CANCEL,
    END,
    HELLO,
    MAGIC,
    MESSAGE,
    METHODS,
    VERSION,
    LaneMethod,
    _Corked,
    _frame,
    _Frames,
)

log = logging.getLogger(__name__)

_WRITE_HIGH_WATER = 1 << 20

Handler = Callable[[Any, Any], Any]
"""A servicer method: ``(request, context)`` → response (unary) or an async iterator (streaming)."""


class LaneAbort(Exception):
    """Raised by :meth:`LaneContext.abort`: the handler ends the call with this status."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(details)
        self.code = code
        self.details = details


class LaneContext:
    """The part of ``grpc.aio.ServicerContext`` the worker servicers use (``abort``)."""

    __slots__ = ("deadline",)

    def __init__(self, deadline: float | None) -> None:
        self.deadline = deadline

    async def abort(self, code: grpc.StatusCode, details: str = "") -> None:
        raise LaneAbort(code, details)

    def time_remaining(self) -> float | None:
        return None if self.deadline is None else max(0.0, self.deadline - time.monotonic())


def _status_of(exc: BaseException) -> tuple[grpc.StatusCode, str]:
    if isinstance(exc, LaneAbort):
        return exc.code, exc.details
    if isinstance(exc, PdRouterError):
        return grpc.StatusCode[exc.grpc_code], exc.message
    return grpc.StatusCode.UNKNOWN, f"Unexpected {type(exc).__name__}: {exc}"


class LaneServer:
    """Serves registered worker methods on one TCP port."""

    def __init__(self, host: str = "127.0.0.1", port: int = 0) -> None:
        self.host = host
        self.requested_port = port
        self.port = 0
        self._handlers: dict[int, tuple[LaneMethod, Handler]] = {}
        self._server: asyncio.Server | None = None
        self._connections: set[_ServerConnection] = set()

    def add(self, method: LaneMethod, handler: Handler) -> None:
        self._handlers[method.id] = (method, handler)

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    @property
    def active_calls(self) -> int:
        return sum(len(c.calls) for c in self._connections)

    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(lambda: _ServerConnection(self), self.host, self.requested_port,
                                                reuse_address=True)
        self.port = self._server.sockets[0].getsockname()[1]

    async def stop(self, grace: float = 5.0) -> None:
        """Refuse new connections, give in-flight calls ``grace`` seconds, then cancel them and close."""
        if self._server is not None:
            self._server.close()
        for conn in self._connections:
            conn.closing = True
        calls = [t for c in self._connections for t in c.calls.values()]
        if calls:
            await asyncio.wait(calls, timeout=grace)
        for conn in list(self._connections):
            conn.abort()
        if self._server is not None:
            await self._server.wait_closed()
            self._server = None


class _ServerConnection(_Corked):
    def __init__(self, server: LaneServer) -> None:
        super().__init__()
        self.server = server
        self.frames = _Frames()
        self.calls: dict[int, asyncio.Task[None]] = {}
        self.greeted = False
        self.closing = False
        self._writable = asyncio.Event()
        self._writable.set()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # A stream transport (uvloop's do not subclass asyncio.Transport, hence no isinstance check).
        transport = cast(asyncio.Transport, transport)
        self.transport = transport
        transport.set_write_buffer_limits(high=_WRITE_HIGH_WATER)
        self.server._connections.add(self)

    def connection_lost(self, exc: Exception | None) -> None:
        self.server._connections.discard(self)
        for task in self.calls.values():
            task.cancel()
        self._writable.set()

    def pause_writing(self) -> None:
        self._writable.clear()

    def resume_writing(self) -> None:
        self._writable.set()

    def abort(self) -> None:
        if self.transport is not None:
            self.transport.abort()

    def data_received(self, data: bytes) -> None:
        if self.transport is None or self.transport.is_closing():
            return  # refused or going away: nothing more is read
        if not self.greeted:
            data = self._greet(data)
            if not data:
                return
        try:
            frames = self.frames.feed(data)
        except ValueError as exc:
            log.warning("lane: closing a connection: %s", exc)
            self.abort()
            return
        for stream, kind, arg, timeout_ms, body in frames:
            if kind == CALL:
                self._call(stream, arg, timeout_ms, body)
            elif kind == CANCEL:
                task = self.calls.get(stream)
                if task is not None:
                    task.cancel()

    def _greet(self, data: bytes) -> bytes:
        pending = bytes(self.frames._buf) + data
        if len(pending) < len(HELLO):
            self.frames._buf = bytearray(pending)
            return b""
        self.frames._buf = bytearray()
        hello, rest = pending[:len(HELLO)], pending[len(HELLO):]
        assert self.transport is not None
        if hello[:4] != MAGIC or hello[4] != VERSION:
            log.warning("lane: refusing a peer that speaks %r (this worker speaks lane version %d)",
                        hello, VERSION)
            self.transport.write(HELLO)  # tell it what this side speaks, then hang up
            self.transport.close()
            return b""
        self.transport.write(HELLO)
        self.greeted = True
        return rest

    def _end(self, stream: int, code: grpc.StatusCode, body: bytes) -> None:
        if self.transport is not None and not self.transport.is_closing():
            self._send(_frame(stream, END, code.value[0], body))

    def _call(self, stream: int, method_id: int, timeout_ms: int, body: bytes) -> None:
        entry = self.server._handlers.get(method_id)
        if entry is None:
            self._end(stream, grpc.StatusCode.UNIMPLEMENTED, f"lane method {method_id} is not served here".encode())
            return
        if self.closing:
            self._end(stream, grpc.StatusCode.UNAVAILABLE, b"the worker is shutting down")
            return
        method, handler = entry
        try:
            request = method.request.FromString(body)
        except DecodeError as exc:
            self._end(stream, grpc.StatusCode.INVALID_ARGUMENT, f"malformed {method.name} request: {exc}".encode())
            return
        task = asyncio.ensure_future(self._run(stream, method, handler, request, timeout_ms))
        self.calls[stream] = task
        # A done callback, not a ``finally``: a call cancelled before it started runs no code at all.
        task.add_done_callback(functools.partial(self._forget, stream))

    def _forget(self, stream: int, task: asyncio.Task[None]) -> None:
        if self.calls.get(stream) is task:
            del self.calls[stream]

    async def _run(self, stream: int, method: LaneMethod, handler: Handler, request: Message,
                   timeout_ms: int) -> None:
        scope = asyncio.timeout(timeout_ms / 1000 if timeout_ms else None)
        context = LaneContext(time.monotonic() + timeout_ms / 1000 if timeout_ms else None)
        try:
            async with scope:
                await self._serve(stream, method, handler, request, context)
        except asyncio.CancelledError:
            pass  # the caller cancelled or went away: nobody to answer
        except Exception as exc:  # every failure becomes a status, as with grpc
            if isinstance(exc, TimeoutError) and scope.expired():
                self._end(stream, grpc.StatusCode.DEADLINE_EXCEEDED, b"Deadline Exceeded")
                return
            code, details = _status_of(exc)
            if code is grpc.StatusCode.UNKNOWN:
                log.exception("lane: %s failed", method.name)
            self._end(stream, code, details.encode("utf-8", "replace"))

    async def _serve(self, stream: int, method: LaneMethod, handler: Handler, request: Message,
                     context: LaneContext) -> None:
        transport = self.transport
        assert transport is not None
        if not method.streaming:
            response = await handler(request, context)
            self._end(stream, grpc.StatusCode.OK, response.SerializeToString())
            return
        responses = handler(request, context)
        try:
            async for msg in responses:
                if not self._writable.is_set():
                    await self._writable.wait()
                if transport.is_closing():
                    return
                self._send(_frame(stream, MESSAGE, 0, msg.SerializeToString()))
        finally:
            await responses.aclose()
        self._end(stream, grpc.StatusCode.OK, b"")


def serve_servicer(server: LaneServer, servicer: Any) -> None:
    """Register every lane method ``servicer`` implements (matched by gRPC service and method name)."""
    service = type(servicer).__mro__
    for method in METHODS.values():
        service_name, name = method.name.rsplit("/", 1)
        base = service_name.rsplit(".", 1)[1] + "Servicer"
        if any(cls.__name__ == base for cls in service):
            server.add(method, getattr(servicer, name))
