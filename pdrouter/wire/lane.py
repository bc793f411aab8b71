"""The worker lane: the router's hot path to its workers, the same protobuf messages with less machinery.

Every worker serves its RPCs over gRPC (the contract, used by every other client) and, by default,
over this lane too: one persistent TCP connection per router and worker, carrying many concurrent
calls as length-prefixed frames. A call is the gRPC method's request message; the answer is the
method's response message(s) and a final status with a ``grpc.StatusCode``, so both ends keep the
gRPC semantics (status codes, deadlines, cancellation) and the servicers serve both unchanged.

Why: on a small CPU budget a ``grpc.aio`` streaming call costs the caller about 600 µs of CPU,
a lane call a few tens of µs (``benchmarks/router_overhead.py`` shows the end-to-end effect).

Wire format (version 1). The client opens with ``HELLO`` = ``b"PDRL"`` + version (u8) + 3 zero
bytes; the server answers the same 8 bytes with its version, or closes. Then frames, each a
16-byte header ``!IIBBHI`` (body length, stream id, kind, arg, reserved, timeout ms) and a body:

* ``CALL`` (client → server): ``arg`` = method id, ``timeout`` = deadline in ms (0: none), body =
  the serialized request;
* ``MESSAGE`` (server → client): one response of a streaming method;
* ``END`` (server → client): ``arg`` = status code; body = the response of a unary method when
  OK, the status details (UTF-8) otherwise. The stream is over;
* ``CANCEL`` (client → server): the caller gave up; the server cancels the handler.

A lost connection fails every open call with UNAVAILABLE on the client and cancels every handler
on the server (what gRPC does when a peer goes away).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import functools
import logging
import struct
import time
from collections.abc import Callable, Generator
from dataclasses import dataclass
from typing import Any, Generic, TypeVar, cast

import grpc
from google.protobuf.message import DecodeError, Message

from pdrouter.core.errors import PdRouterError
from pdrouter.wire.v1 import common_pb2, worker_pb2, worker_pb2_grpc

log = logging.getLogger(__name__)

VERSION = 1
MAGIC = b"PDRL"
HELLO = MAGIC + bytes([VERSION, 0, 0, 0])
HEADER = struct.Struct("!IIBBHI")
MAX_BODY = 64 * 1024 * 1024
"""Largest frame body accepted (the gRPC channels' message limit)."""
CALL, MESSAGE, END, CANCEL = 1, 2, 3, 4
_STATUS_BY_VALUE = {code.value[0]: code for code in grpc.StatusCode}
_WRITE_HIGH_WATER = 1 << 20

@dataclass(frozen=True)
class LaneMethod:
    """One worker RPC as the lane knows it: id on the wire, gRPC name, message types."""

    id: int
    name: str
    request: type[Message]
    response: type[Message]
    streaming: bool


PREFILL = LaneMethod(1, "/pdrouter.v1.PrefillWorker/Prefill", worker_pb2.PrefillRequest,
                     worker_pb2.PrefillResponse, False)
ALLOCATE = LaneMethod(2, "/pdrouter.v1.DecodeWorker/Allocate", worker_pb2.AllocateRequest,
                      worker_pb2.AllocateResponse, False)
DECODE = LaneMethod(3, "/pdrouter.v1.DecodeWorker/Generate", worker_pb2.DecodeRequest,
                    common_pb2.TokenChunk, True)
RELEASE = LaneMethod(4, "/pdrouter.v1.DecodeWorker/Release", worker_pb2.ReleaseRequest,
                     worker_pb2.ReleaseResponse, False)
COLOCATED = LaneMethod(5, "/pdrouter.v1.ColocatedWorker/Generate", worker_pb2.WorkerGenerateRequest,
                       common_pb2.TokenChunk, True)
SERVE = LaneMethod(6, "/pdrouter.v1.DecodeWorker/Serve", worker_pb2.ServeRequest, common_pb2.TokenChunk, True)
METHODS = {m.id: m for m in (PREFILL, ALLOCATE, DECODE, RELEASE, COLOCATED, SERVE)}


class LaneError(grpc.RpcError):
    """A lane call that ended with a non-OK status; ``code()`` / ``details()`` as on a gRPC error."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(f"{code.name}: {details}")
        self._code = code
        self._details = details

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details


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


class _Frames:
    """Incremental frame parser shared by both ends."""

    def __init__(self) -> None:
        self._buf = bytearray()

    def feed(self, data: bytes) -> list[tuple[int, int, int, int, bytes]]:
        """Append ``data``; the complete frames so far as (stream, kind, arg, timeout_ms, body)."""
        buf = self._buf
        buf += data
        frames = []
        pos, size = 0, len(buf)
        while size - pos >= HEADER.size:
            length, stream, kind, arg, _, timeout_ms = HEADER.unpack_from(buf, pos)
            if length > MAX_BODY:
                raise ValueError(f"lane frame of {length} bytes exceeds the {MAX_BODY}-byte limit")
            end = pos + HEADER.size + length
            if end > size:
                break
            frames.append((stream, kind, arg, timeout_ms, bytes(buf[pos + HEADER.size:end])))
            pos = end
        if pos:
            del buf[:pos]
        return frames


def _frame(stream: int, kind: int, arg: int = 0, body: bytes = b"", timeout_ms: int = 0) -> bytes:
    return HEADER.pack(len(body), stream, kind, arg, 0, timeout_ms) + body


class _Corked(asyncio.Protocol):
    """Frames written during one event-loop iteration leave in one ``send``: under load many calls
    share a system call (on loopback a send costs as much as the rest of a call)."""

    transport: asyncio.Transport | None

    def __init__(self) -> None:
        self.transport = None
        self._out: list[bytes] = []
        self._loop = asyncio.get_running_loop()

    def _send(self, data: bytes) -> None:
        if not self._out:
            self._loop.call_soon(self._flush)
        self._out.append(data)

    def _flush(self) -> None:
        out, self._out = self._out, []
        if out and self.transport is not None and not self.transport.is_closing():
            self.transport.write(out[0] if len(out) == 1 else b"".join(out))


# -- server ------------------------------------------------------------------------------------

Handler = Callable[[Any, Any], Any]
"""A servicer method: ``(request, context)`` → response (unary) or an async iterator (streaming)."""


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


# -- client ------------------------------------------------------------------------------------


class _Inbox:
    """What one call has received: frames, then at most one terminal status."""

    __slots__ = ("items", "waiter")

    def __init__(self) -> None:
        self.items: collections.deque[tuple[int, int, bytes]] = collections.deque()
        self.waiter: asyncio.Future[None] | None = None

    def put(self, item: tuple[int, int, bytes]) -> None:
        self.items.append(item)
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_result(None)

    async def get(self) -> tuple[int, int, bytes]:
        while not self.items:
            self.waiter = asyncio.get_running_loop().create_future()
            await self.waiter
        return self.items.popleft()


class _ClientConnection(_Corked):
    def __init__(self, address: str) -> None:
        super().__init__()
        self.address = address
        self.frames = _Frames()
        self.calls: dict[int, _Inbox] = {}
        self.greeted: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.lost: str | None = None
        self._next = 1

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        transport = cast(asyncio.Transport, transport)  # a stream transport (asyncio's or uvloop's)
        self.transport = transport
        transport.write(HELLO)

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost = f"lost the lane connection to {self.address}" + (f": {exc}" if exc else "")
        if not self.greeted.done():
            self.greeted.set_exception(LaneError(grpc.StatusCode.UNAVAILABLE, self.lost))
        status = grpc.StatusCode.UNAVAILABLE.value[0]
        for inbox in self.calls.values():
            inbox.put((END, status, self.lost.encode()))
        self.calls.clear()

    def data_received(self, data: bytes) -> None:
        if not self.greeted.done():
            pending = bytes(self.frames._buf) + data
            if len(pending) < len(HELLO):
                self.frames._buf = bytearray(pending)
                return
            self.frames._buf = bytearray()
            if pending[:len(HELLO)] != HELLO:
                self.greeted.set_exception(LaneError(
                    grpc.StatusCode.FAILED_PRECONDITION,
                    f"the worker at {self.address} speaks lane {pending[:len(HELLO)]!r}, not version {VERSION}"))
                assert self.transport is not None
                self.transport.close()
                return
            self.greeted.set_result(None)
            data = pending[len(HELLO):]
        try:
            frames = self.frames.feed(data)
        except ValueError as exc:
            assert self.transport is not None
            self.transport.abort()
            log.warning("lane: %s: %s", self.address, exc)
            return
        for stream, kind, arg, _, body in frames:
            inbox = self.calls.get(stream)
            if inbox is None:
                continue  # a call this side already gave up
            if kind == END:
                del self.calls[stream]
            inbox.put((kind, arg, body))

    def open(self, method: LaneMethod, body: bytes, timeout_ms: int) -> tuple[int, _Inbox]:
        if self.lost is not None or self.transport is None or self.transport.is_closing():
            raise LaneError(grpc.StatusCode.UNAVAILABLE, self.lost or f"the lane to {self.address} is closed")
        stream = self._next
        self._next = stream + 1 if stream < 0xFFFFFFFF else 1
        inbox = _Inbox()
        self.calls[stream] = inbox
        self._send(_frame(stream, CALL, method.id, body, timeout_ms))
        return stream, inbox

    def cancel(self, stream: int) -> None:
        if self.calls.pop(stream, None) is not None and self.transport is not None \
                and not self.transport.is_closing():
            self._send(_frame(stream, CANCEL))


class LaneChannel:
    """The client end of one worker's lane: connects on first use, reconnects after a loss."""

    def __init__(self, address: str, connect_timeout_s: float = 2.0) -> None:
        self.address = address
        self.connect_timeout_s = connect_timeout_s
        self._conn: _ClientConnection | None = None
        self._connecting: asyncio.Future[_ClientConnection] | None = None
        self._closed = False

    async def connection(self) -> _ClientConnection:
        conn = self._conn
        if conn is not None and conn.lost is None:
            return conn
        if self._closed:
            raise LaneError(grpc.StatusCode.UNAVAILABLE, f"the lane to {self.address} was closed")
        if self._connecting is None:
            self._connecting = asyncio.ensure_future(self._connect())
        try:
            return await asyncio.shield(self._connecting)
        finally:
            if self._connecting is not None and self._connecting.done():
                self._connecting = None

    async def _connect(self) -> _ClientConnection:
        host, _, port = self.address.rpartition(":")
        loop = asyncio.get_running_loop()
        conn: _ClientConnection | None = None
        try:
            async with asyncio.timeout(self.connect_timeout_s):
                _, conn = await loop.create_connection(lambda: _ClientConnection(self.address), host.strip("[]"),
                                                       int(port))
                await conn.greeted
        except BaseException as exc:
            if conn is not None and conn.transport is not None:
                conn.transport.abort()  # connected but not greeted: do not keep the socket
            if isinstance(exc, (OSError, TimeoutError)):
                raise LaneError(grpc.StatusCode.UNAVAILABLE,
                                f"cannot reach the worker lane at {self.address}: "
                                f"{str(exc) or f'timed out after {self.connect_timeout_s}s'}") from None
            raise
        self._conn = conn
        return conn

    def unary(self, method: LaneMethod, request: Message, timeout: float | None = None) -> UnaryCall[Any]:
        return UnaryCall(self, method, request, timeout)

    def stream(self, method: LaneMethod, request: Message, timeout: float | None = None) -> StreamCall[Any]:
        return StreamCall(self, method, request, timeout)

    async def close(self) -> None:
        """Close the connection; calls still open fail with UNAVAILABLE."""
        self._closed = True
        if self._connecting is not None:
            self._connecting.cancel()
            with contextlib.suppress(BaseException):
                await self._connecting
        if self._conn is not None and self._conn.transport is not None:
            self._conn.transport.close()
        self._conn = None


class _Call:
    """One call on a lane: sent on first use, cancellable at any time like a grpc.aio call."""

    def __init__(self, channel: LaneChannel, method: LaneMethod, request: Message, timeout: float | None) -> None:
        self._channel = channel
        self._method = method
        self._request = request
        self._timeout = timeout
        self._conn: _ClientConnection | None = None
        self._stream = 0
        self._inbox: _Inbox | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._done = False
        self._cancelled = False

    async def _start(self) -> _Inbox:
        if self._cancelled:
            raise asyncio.CancelledError()
        conn = self._channel._conn
        if conn is None or conn.lost is not None:  # not connected yet, or lost: (re)connect
            conn = await self._channel.connection()
            if self._cancelled:
                raise asyncio.CancelledError()
        timeout_ms = 0
        if self._timeout is not None:
            if self._timeout <= 0:
                raise LaneError(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded")
            timeout_ms = max(1, int(self._timeout * 1000))
        self._stream, inbox = conn.open(self._method, self._request.SerializeToString(), timeout_ms)
        self._conn, self._inbox = conn, inbox
        if self._timeout is not None:
            # The worker enforces the deadline too; this covers a worker that stopped answering.
            self._timer = asyncio.get_running_loop().call_later(self._timeout + 1.0, self._expire)
        return inbox

    def _expire(self) -> None:
        if not self._done and self._inbox is not None:
            self._finish()
            self._inbox.put((END, grpc.StatusCode.DEADLINE_EXCEEDED.value[0], b"Deadline Exceeded"))

    def _finish(self) -> None:
        self._done = True
        if self._timer is not None:
            self._timer.cancel()
        if self._conn is not None:
            self._conn.cancel(self._stream)

    def _ended(self, code: int, body: bytes) -> None:
        self._done = True
        if self._timer is not None:
            self._timer.cancel()
        if self._cancelled:  # as with grpc.aio: using a call cancelled here raises CancelledError
            raise asyncio.CancelledError()
        status = _STATUS_BY_VALUE.get(code, grpc.StatusCode.UNKNOWN)
        if status is not grpc.StatusCode.OK:
            raise LaneError(status, body.decode("utf-8", "replace"))

    def cancel(self) -> bool:
        """Give up the call (the worker cancels its handler); False if it had already ended."""
        if self._done:
            return False
        self._cancelled = True
        self._finish()
        if self._inbox is not None:
            self._inbox.put((END, grpc.StatusCode.CANCELLED.value[0], b"Locally cancelled"))
        return True

    def done(self) -> bool:
        return self._done


T = TypeVar("T", bound=Message)


class UnaryCall(_Call, Generic[T]):
    """Awaitable: the response, or :class:`LaneError`."""

    def __await__(self) -> Generator[Any, None, T]:
        return self._result().__await__()

    async def _result(self) -> T:
        inbox = await self._start()
        if inbox.items:
            _, arg, body = inbox.items.popleft()
        else:
            try:
                _, arg, body = await inbox.get()
            except asyncio.CancelledError:
                self.cancel()
                raise
        self._ended(arg, body)
        return self._method.response.FromString(body)


class StreamCall(_Call, Generic[T]):
    """Async iterator over the responses; ends on OK, raises :class:`LaneError` otherwise.

    The call is its own iterator (no async generator): a consumer that stops early leaves
    nothing for the garbage collector to finalize, and ends the call with ``cancel()``, as with
    grpc.aio. A consumer cancelled while waiting cancels the call.
    """

    def __aiter__(self) -> StreamCall[T]:
        return self

    async def __anext__(self) -> T:
        inbox = self._inbox
        if inbox is None:
            inbox = await self._start()  # a call cancelled before it started raises CancelledError
        elif self._done and not inbox.items:
            raise StopAsyncIteration
        if inbox.items:  # already here: no waiting
            kind, arg, body = inbox.items.popleft()
        else:
            try:
                kind, arg, body = await inbox.get()
            except asyncio.CancelledError:
                if not self._done:
                    self.cancel()
                raise
        if kind == END:
            self._ended(arg, body)
            raise StopAsyncIteration
        return self._method.response.FromString(body)


# -- stubs -------------------------------------------------------------------------------------


class PrefillLane:
    """``PrefillWorker`` over a lane (the call shapes of the grpc.aio stub)."""

    def __init__(self, channel: LaneChannel) -> None:
        self._channel = channel

    def Prefill(self, request: worker_pb2.PrefillRequest,
                timeout: float | None = None) -> UnaryCall[worker_pb2.PrefillResponse]:
        return self._channel.unary(PREFILL, request, timeout)


class DecodeLane:
    """``DecodeWorker`` over a lane."""

    def __init__(self, channel: LaneChannel) -> None:
        self._channel = channel

    def Allocate(self, request: worker_pb2.AllocateRequest,
                 timeout: float | None = None) -> UnaryCall[worker_pb2.AllocateResponse]:
        return self._channel.unary(ALLOCATE, request, timeout)

    def Generate(self, request: worker_pb2.DecodeRequest,
                 timeout: float | None = None) -> StreamCall[common_pb2.TokenChunk]:
        return self._channel.stream(DECODE, request, timeout)

    def Release(self, request: worker_pb2.ReleaseRequest,
                timeout: float | None = None) -> UnaryCall[worker_pb2.ReleaseResponse]:
        return self._channel.unary(RELEASE, request, timeout)

    def Serve(self, request: worker_pb2.ServeRequest,
              timeout: float | None = None) -> StreamCall[common_pb2.TokenChunk]:
        return self._channel.stream(SERVE, request, timeout)


class ColocatedLane:
    """``ColocatedWorker`` over a lane."""

    def __init__(self, channel: LaneChannel) -> None:
        self._channel = channel

    def Generate(self, request: worker_pb2.WorkerGenerateRequest,
                 timeout: float | None = None) -> StreamCall[common_pb2.TokenChunk]:
        return self._channel.stream(COLOCATED, request, timeout)


def serve_servicer(server: LaneServer, servicer: Any) -> None:
    """Register every lane method ``servicer`` implements (matched by gRPC service and method name)."""
    service = type(servicer).__mro__
    for method in METHODS.values():
        service_name, name = method.name.rsplit("/", 1)
        base = service_name.rsplit(".", 1)[1] + "Servicer"
        if any(cls.__name__ == base for cls in service):
            server.add(method, getattr(servicer, name))


def request_stubs(channel: grpc.aio.Channel | None, lane: LaneChannel | None) -> tuple[Any, Any, Any]:
    """``(prefill, decode, colocated)`` stubs over ``lane`` when given, else over the gRPC ``channel``.

    Both kinds have the same call shapes: ``Stub.Method(request, timeout=…)`` returns an awaitable
    (unary) or an async iterable (streaming) with ``cancel()``; failures are ``grpc.RpcError``.
    """
    if lane is not None:
        return PrefillLane(lane), DecodeLane(lane), ColocatedLane(lane)
    assert channel is not None, "a gRPC channel or a lane is needed"
    return (worker_pb2_grpc.PrefillWorkerStub(channel), worker_pb2_grpc.DecodeWorkerStub(channel),
            worker_pb2_grpc.ColocatedWorkerStub(channel))
