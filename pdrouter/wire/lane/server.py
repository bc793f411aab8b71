"""The worker end of the lane: ``LaneServer`` serves the registered servicer methods on one TCP port.

Each ``CALL`` runs its handler in a task under the call's deadline, with a ``LaneContext`` for the
part of ``grpc.aio.ServicerContext`` the servicers use; a handler's failure becomes the ``END``
status, as a gRPC server would send it (``LaneContext.abort``'s code, a ``PdRouterError``'s gRPC
code, else UNKNOWN). A ``CANCEL`` or a lost connection cancels the handler: nobody is left to answer.

Who may call: with a ``token`` a connection is served only once it has proved it (the
challenge-response of ``frames``, in which this server proves the token first, as the address it
answers at: ``advertise_host`` and its port); with an ``ssl`` context the port speaks TLS only (a
context that requires client certificates makes it mutual TLS). Every connection is held to the
server's ``LaneLimits``: a handshake deadline, a deadline per begun frame that trickling cannot
move, a cap on its buffered bytes (a few KiB before the proof), a cap on connections and a smaller
budget for those that have not proved the token yet (past it the oldest of them is closed, so a
flood of unauthenticated connections never locks the router out). A connection refused or closed
for any of these gets, where it can still be told, an ``END`` on stream 0 saying why.
"""

from __future__ import annotations

import asyncio
import functools
import hmac
import logging
import secrets
import time
import types
from collections.abc import Callable
from ssl import SSLContext
from typing import Any, cast

import grpc
from google.protobuf.message import DecodeError, Message

from pdrouter.core.errors import PdRouterError
from pdrouter.wire.lane.frames import (
    AUTH,
    CALL,
    CANCEL,
    END,
    HEADER,
    HELLO,
    HELLO_AUTH,
    MAGIC,
    MESSAGE,
    META,
    METHODS,
    NONCE_SIZE,
    VERSION,
    LaneMethod,
    Metadata,
    _Corked,
    _frame,
    _Frames,
    client_proof,
    decode_metadata,
    server_proof,
)
from pdrouter.wire.lane.limits import LaneLimits

log = logging.getLogger(__name__)

_WRITE_HIGH_WATER = 1 << 20
LINGER_S = 1.0
"""How long a connection told why it is closed keeps reading (and dropping) before it closes, so the
reason is not lost to a TCP reset."""
_LOG_EVERY_S = 10.0
_last_logged: dict[str, float] = {}


def _log_limit(what: str, message: str, *args: object) -> None:
    """A warning about a refused or closed peer, at most once per ``_LOG_EVERY_S`` per kind."""
    now = time.monotonic()
    if now - _last_logged.get(what, -_LOG_EVERY_S) >= _LOG_EVERY_S:
        _last_logged[what] = now
        log.warning(message, *args)

Handler = Callable[[Any, Any], Any]
"""A servicer method: ``(request, context)`` → response (unary) or an async iterator (streaming)."""


class LaneAbort(Exception):
    """Raised by :meth:`LaneContext.abort`: the handler ends the call with this status."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(details)
        self.code = code
        self.details = details


class LaneContext:
    """The part of ``grpc.aio.ServicerContext`` the worker servicers use (``abort``, ``time_remaining``,
    ``invocation_metadata``), and :meth:`send_nowait`, which a gRPC context lacks."""

    __slots__ = ("_conn", "_stream", "deadline", "metadata")

    def __init__(self, deadline: float | None, metadata: Metadata = (), conn: _ServerConnection | None = None,
                 stream: int = 0) -> None:
        self.deadline = deadline
        self.metadata = metadata
        self._conn = conn
        self._stream = stream

    def send_nowait(self, message: Message) -> bool:
        """Send one message of this streaming call now, from outside its handler's iteration: from a
        callback that has the next message before the handler would be woken to yield it. False when
        the connection cannot take it now (its writes are paused, it is closing, or the call is over):
        the handler yields it then. The caller keeps the order: only when every message the handler
        yielded has been sent (the handler is waiting for its next one). The message is serialized
        before this returns: the caller may change it and send it again."""
        conn = self._conn
        return conn is not None and conn.send_now(self._stream, message)

    def invocation_metadata(self) -> Metadata:
        """The call's metadata (its ``META`` frame's pairs; empty without one)."""
        return self.metadata

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
    """Serves registered worker methods on one TCP port.

    ``token``: serve only connections that prove it (None: anyone who greets); ``ssl``: speak TLS
    (a context requiring client certificates makes it mutual TLS); ``limits``: what each connection
    may take (default :class:`LaneLimits`' defaults); ``advertise_host``: the host clients dial
    (default ``host``), which with the port is the identity this server proves itself as.
    """

    def __init__(self, host: str = "127.0.0.1", port: int = 0, *, token: bytes | None = None,
                 ssl: SSLContext | None = None, limits: LaneLimits | None = None,
                 advertise_host: str | None = None) -> None:
        if token is not None and not token:
            raise ValueError("the lane token must not be empty (None: no token)")
        self.host = host
        self.requested_port = port
        self.port = 0
        self.token = token
        self.ssl = ssl
        self.limits = LaneLimits() if limits is None else limits
        self.advertise_host = advertise_host or host
        self._handlers: dict[int, tuple[LaneMethod, Handler]] = {}
        self._server: asyncio.Server | None = None
        self._connections: set[_ServerConnection] = set()
        self._unproven: dict[_ServerConnection, None] = {}
        """Connections that have not proved the token yet, oldest first."""
        self._refused: set[_ServerConnection] = set()

    def add(self, method: LaneMethod, handler: Handler) -> None:
        self._handlers[method.id] = (method, handler)

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    @property
    def identity(self) -> str:
        """The address this server proves itself as: ``advertise_host:port``, what clients dial."""
        return f"{self.advertise_host}:{self.port}"

    def _evict_oldest_unproven(self) -> bool:
        """Close the oldest connection that has not proved the token; False when there is none."""
        if not self._unproven:
            return False
        oldest = next(iter(self._unproven))
        self._forget_connection(oldest)
        self._refused.add(oldest)
        _log_limit("unproven", "lane: closing the oldest connections that have not proved the internal token: %d "
                   "of them open (--lane-max-unauthenticated-connections)", self.limits.unauthenticated_budget)
        if not oldest.greeted:  # it never spoke the lane: nothing it would understand to say
            oldest.refused = True
            oldest.frames._buf = bytearray()
            if oldest.transport is not None:
                oldest.transport.close()
            return True
        oldest._close_with(grpc.StatusCode.UNAVAILABLE,
                           f"the worker lane holds its limit of {self.limits.unauthenticated_budget} connections "
                           f"that have not proved the internal token, and this was the oldest")
        return True

    def _forget_connection(self, conn: _ServerConnection) -> None:
        self._connections.discard(conn)
        self._unproven.pop(conn, None)

    @property
    def active_calls(self) -> int:
        return sum(len(c.calls) for c in self._connections)

    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(
            lambda: _ServerConnection(self), self.host, self.requested_port, reuse_address=True, ssl=self.ssl,
            ssl_handshake_timeout=self.limits.handshake_timeout_s if self.ssl is not None else None)
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
        for conn in [*self._connections, *self._refused]:
            conn.abort()
        if self._server is not None:
            await self._server.wait_closed()
            self._server = None


class _ServerConnection(_Corked):
    def __init__(self, server: LaneServer) -> None:
        super().__init__()
        self.server = server
        self.limits = server.limits
        self.frames = _Frames(self.limits.max_preauth_body)
        self.calls: dict[int, asyncio.Task[None]] = {}
        self.greeted = False
        self.ready = False
        """Greeted and, with a token, proved: calls are served."""
        self.closing = False
        self.refused = False
        """Refused or being closed: nothing more is read."""
        self._answered = False
        """This side's greeting was sent (a reason sent after it needs none of its own)."""
        self._client_nonce = b""
        self._server_nonce = b""
        self._frame_t0: float | None = None
        """When the incomplete frame in the buffer began (loop time), None without one."""
        self._timers: dict[str, asyncio.TimerHandle] = {}
        self._meta: tuple[int, bytes] | None = None
        """The last ``META`` frame (stream, body), for the ``CALL`` that follows it on that stream."""
        self._writable = asyncio.Event()
        self._writable.set()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._expired: set[int] = set()
        """Calls whose deadline passed (their task was cancelled for it)."""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # A stream transport (uvloop's do not subclass asyncio.Transport, hence no isinstance check).
        transport = cast(asyncio.Transport, transport)
        self.transport = transport
        self._loop = asyncio.get_running_loop()
        transport.set_write_buffer_limits(high=_WRITE_HIGH_WATER)
        server, limits = self.server, self.limits
        if len(server._unproven) >= limits.unauthenticated_budget:
            server._evict_oldest_unproven()
        if len(server._connections) >= limits.max_connections and not server._evict_oldest_unproven():
            server._refused.add(self)
            _log_limit("connections", "lane: refusing connections past %d open (--lane-max-connections)",
                       limits.max_connections)
            self._close_with(grpc.StatusCode.UNAVAILABLE,
                             f"the worker lane has its limit of {limits.max_connections} connections open "
                             f"(--lane-max-connections); retry later")
            return
        server._connections.add(self)
        server._unproven[self] = None
        self._timers["handshake"] = asyncio.get_running_loop().call_later(limits.handshake_timeout_s,
                                                                           self._handshake_expired)

    def connection_lost(self, exc: Exception | None) -> None:
        self.refused = True
        self.server._forget_connection(self)
        self.server._refused.discard(self)
        for timer in self._timers.values():
            timer.cancel()
        self._timers.clear()
        self.frames._buf = bytearray()
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
        if self.refused or self.transport is None or self.transport.is_closing():
            return  # refused or going away: nothing more is read
        if not self.greeted:
            data = self._greet(data)
            if not data:
                return
        try:
            frames = self.frames.feed(data)
        except ValueError as exc:
            _log_limit("size", "lane: closing connections whose frames exceed their limit (--lane-max-buffered-bytes; "
                       "%d bytes before the proof, --lane-max-preauth-bytes): %s", self.limits.max_preauth_bytes, exc)
            self.abort()
            return
        completed = bool(frames)
        if not self.ready:
            frames = self._authenticate(frames)
            if self.refused:
                return
        for stream, kind, arg, timeout_ms, body in frames:
            if kind == CALL:
                meta, self._meta = self._meta, None
                self._call(stream, arg, timeout_ms, body,
                           decode_metadata(meta[1]) if meta is not None and meta[0] == stream else ())
            elif kind == META:
                self._meta = (stream, body)
            elif kind == CANCEL:
                task = self.calls.get(stream)
                if task is not None:
                    task.cancel()
        self._watch_frame(completed)

    # -- the handshake ----------------------------------------------------------------------------
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
            self.refused = True
            self.transport.write(HELLO)  # tell it what this side speaks, then hang up
            self.transport.close()
            return b""
        self.greeted = True
        if self.server.token is None:  # the client's challenge (its first frame) is ignored
            self._answered = True
            self.transport.write(HELLO)
            self._ready()
        return rest

    def _authenticate(self, frames: list[tuple[int, int, int, int, bytes]]) -> list[tuple[int, int, int, int, bytes]]:
        """The frames after a valid proof (the connection is then ready); none while the handshake is
        not done. The client's challenge is answered with this server's proof; a frame that is not
        the handshake's next, or a wrong proof, refuses the connection."""
        token = self.server.token
        assert token is not None and self.transport is not None
        for at, (stream, kind, _, _, body) in enumerate(frames):
            if stream != 0 or kind != AUTH:
                _log_limit("no-proof", "lane: refusing a connection that sent no proof of the internal token")
                self._close_with(grpc.StatusCode.UNAUTHENTICATED,
                                 "this worker lane requires the internal token (PDROUTER_INTERNAL_TOKEN), and the "
                                 "connection sent a call before proving it")
                return []
            identity = self.server.identity
            if not self._answered:  # the client's challenge: prove the token first, as this address
                if len(body) != NONCE_SIZE:
                    self._close_with(grpc.StatusCode.UNAUTHENTICATED, "the lane handshake expects a "
                                     f"{NONCE_SIZE}-byte challenge first")
                    return []
                self._client_nonce, self._server_nonce = body, secrets.token_bytes(NONCE_SIZE)
                proof = server_proof(token, self._client_nonce, self._server_nonce, identity)
                self._answered = True
                self.transport.write(HELLO_AUTH + _frame(0, AUTH, 0, self._server_nonce + proof + identity.encode()))
                continue
            if not hmac.compare_digest(body, client_proof(token, self._client_nonce, self._server_nonce, identity)):
                _log_limit("wrong-proof", "lane: refusing a connection with a wrong proof of the internal token")
                self._close_with(grpc.StatusCode.UNAUTHENTICATED,
                                 "wrong internal token: the lane proof does not match this worker's "
                                 "PDROUTER_INTERNAL_TOKEN")
                return []
            self.transport.write(_frame(0, AUTH))
            self._ready()
            return frames[at + 1:]
        return []

    def _ready(self) -> None:
        self.ready = True
        self.server._unproven.pop(self, None)
        self.frames.max_body = self.limits.max_body
        timer = self._timers.pop("handshake", None)
        if timer is not None:
            timer.cancel()

    def _handshake_expired(self) -> None:
        self._timers.pop("handshake", None)
        if self.ready or self.refused or self.transport is None:
            return
        timeout = self.limits.handshake_timeout_s
        _log_limit("handshake", "lane: closing connections that did not complete the handshake within %g s "
                   "(--lane-handshake-timeout)", timeout)
        if not self.greeted:  # it never spoke the lane: nothing it would understand to say
            self.refused = True
            self.frames._buf = bytearray()
            self.transport.close()
            return
        self._close_with(grpc.StatusCode.UNAUTHENTICATED,
                         f"no proof of the internal token within {timeout:g} s (--lane-handshake-timeout)")

    # -- limits -----------------------------------------------------------------------------------
    def _watch_frame(self, completed: bool) -> None:
        """After a read: start the deadline of a frame begun in it (one that completed frames and
        left the start of another, or the first bytes after none); a frame still incomplete keeps
        the deadline it had."""
        if not self.frames._buf:
            self._frame_t0 = None
            return
        if not completed and self._frame_t0 is not None:
            return
        loop = asyncio.get_running_loop()
        now = self._frame_t0 = loop.time()
        due = now + self.limits.frame_timeout_s
        timer = self._timers.get("frame")
        if timer is not None:
            if timer.when() <= due:
                return  # fires first and re-arms for the frame of the moment
            timer.cancel()
        self._timers["frame"] = loop.call_at(due, self._frame_expired)

    def _frame_expired(self) -> None:
        self._timers.pop("frame", None)
        t0 = self._frame_t0
        if t0 is None or self.refused:
            return
        limits, buf = self.limits, self.frames._buf
        size = HEADER.size + (HEADER.unpack_from(buf)[0] if len(buf) >= HEADER.size else 0)
        due = t0 + max(limits.frame_timeout_s, size / limits.frame_min_rate_bps)
        loop = asyncio.get_running_loop()
        if loop.time() < due - 0.001:
            self._timers["frame"] = loop.call_at(due, self._frame_expired)
            return
        _log_limit("frame", "lane: closing connections whose frame did not complete in time (--lane-frame-timeout "
                   "%g s, --lane-frame-min-rate %d bytes/s)", limits.frame_timeout_s, limits.frame_min_rate_bps)
        came = len(buf)
        self.frames._buf = bytearray()  # the partial frame is dropped now, not when the connection goes
        self._close_with(grpc.StatusCode.UNAVAILABLE,
                         f"a lane frame did not complete within {due - t0:.3g} s ({came} of {size} bytes came; "
                         f"--lane-frame-timeout {limits.frame_timeout_s:g} s, --lane-frame-min-rate "
                         f"{limits.frame_min_rate_bps} bytes/s)")

    def _close_with(self, code: grpc.StatusCode, details: str) -> None:
        """Tell the peer why (an ``END`` on stream 0, after this side's greeting if it was not sent), then close.

        The connection is half-closed at once, and what the peer still sends is read and dropped
        for up to :data:`LINGER_S`, so that closing with unread data does not reset the connection
        before the peer has read the reason.
        """
        transport = self.transport
        self.refused = True
        self.frames._buf = bytearray()
        if transport is None or transport.is_closing():
            return
        self._flush()  # what was corked leaves first
        hello, self._answered = (b"" if self._answered else HELLO), True
        transport.write(hello + _frame(0, END, code.value[0], details.encode()))
        try:
            if transport.can_write_eof():
                transport.write_eof()
                self._timers["linger"] = asyncio.get_running_loop().call_later(LINGER_S, transport.close)
                return
        except (OSError, RuntimeError, NotImplementedError):
            pass
        transport.close()

    # -- calls ------------------------------------------------------------------------------------
    def _end(self, stream: int, code: grpc.StatusCode, body: bytes) -> None:
        if self.transport is not None and not self.transport.is_closing():
            self._send(_frame(stream, END, code.value[0], body))

    def _call(self, stream: int, method_id: int, timeout_ms: int, body: bytes, metadata: Metadata = ()) -> None:
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
        loop = self._loop
        assert loop is not None  # set when the connection was made, before any frame
        task = loop.create_task(self._run(stream, method, handler, request, timeout_ms, metadata))
        self.calls[stream] = task
        # The deadline is one timer that cancels the call's task (``asyncio.timeout`` costs a scope
        # object, its own timer and task bookkeeping per call); ``_run`` answers DEADLINE_EXCEEDED.
        timer = loop.call_later(timeout_ms / 1000, self._expire, stream, task) if timeout_ms else None
        # A done callback, not a ``finally``: a call cancelled before it started runs no code at all.
        task.add_done_callback(functools.partial(self._forget, stream, timer))

    def _forget(self, stream: int, timer: asyncio.TimerHandle | None, task: asyncio.Task[None]) -> None:
        if timer is not None:
            timer.cancel()
        if self.calls.get(stream) is task:
            del self.calls[stream]
            self._expired.discard(stream)

    def _expire(self, stream: int, task: asyncio.Task[None]) -> None:
        if self.calls.get(stream) is task and not task.done():
            self._expired.add(stream)
            task.cancel()

    async def _run(self, stream: int, method: LaneMethod, handler: Handler, request: Message,
                   timeout_ms: int, metadata: Metadata = ()) -> None:
        context = LaneContext(time.monotonic() + timeout_ms / 1000 if timeout_ms else None, metadata, self, stream)
        try:
            await self._serve(stream, method, handler, request, context)
        except asyncio.CancelledError:
            if stream in self._expired:  # the deadline, not the caller: it is told why
                self._end(stream, grpc.StatusCode.DEADLINE_EXCEEDED, b"Deadline Exceeded")
            # else the caller cancelled or went away: nobody to answer
        except Exception as exc:  # every failure becomes a status, as with grpc
            code, details = _status_of(exc)
            if code is grpc.StatusCode.UNKNOWN:
                log.exception("lane: %s failed", method.name)
            self._end(stream, code, details.encode("utf-8", "replace"))

    def send_now(self, stream: int, message: Message) -> bool:
        """``LaneContext.send_nowait``: one message of the live call ``stream``, framed and corked as its
        handler's own are; False when it cannot be sent now."""
        transport = self.transport
        if (transport is None or transport.is_closing() or not self._writable.is_set()
                or stream not in self.calls):
            return False
        self._send(_frame(stream, MESSAGE, 0, message.SerializeToString()))
        return True

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
            handler = getattr(servicer, name)
            # The lane maps a PdRouterError to its status itself (``_status_of``), as ``grpc_errors``
            # does for gRPC: its method without that wrapper.
            inner = getattr(getattr(handler, "__func__", None), "maps_errors_of", None)
            server.add(method, types.MethodType(inner, servicer) if inner is not None else handler)
