"""The router's end of the lane: ``LaneChannel``, its calls and the typed stubs.

A ``LaneChannel`` is one worker's connection: opened on first use, reopened after a loss. Its calls
(``UnaryCall``, ``StreamCall``) are sent on first use and cancellable at any time, like grpc.aio
calls; a non-OK status raises ``LaneError`` (a ``grpc.RpcError``). ``PrefillLane``, ``DecodeLane``
and ``ColocatedLane`` have the call shapes of the grpc.aio stubs, so ``request_stubs`` hands either.

A channel given a ``token`` has the worker prove it first, as the address the channel dials, and
only then proves it in turn (``frames``' challenge-response): a server that cannot, or answers as
another address, is sent nothing, and the calls fail UNAUTHENTICATED. One given an ``ssl`` context
speaks TLS. A worker that refuses the connection says why, and the calls fail with its status
(UNAUTHENTICATED for a missing or wrong token).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import hmac
import logging
import secrets
from collections.abc import Callable, Generator, Sequence
from ssl import SSLContext
from typing import Any, Generic, TypeVar, cast

import grpc
from google.protobuf.message import Message
from mypy_extensions import mypyc_attr

from pdrouter.wire.grpc_util import StatusError
from pdrouter.wire.lane.frames import (
    ALLOCATE,
    AUTH,
    AUTH_REQUIRED,
    CALL,
    CANCEL,
    COLOCATED,
    DECODE,
    END,
    HELLO,
    MAX_IDENTITY_BYTES,
    MESSAGE,
    META,
    NONCE_SIZE,
    PREFILL,
    PROOF_SIZE,
    RELEASE,
    SERVE,
    VERSION,
    LaneMethod,
    _Corked,
    _frame,
    _Frames,
    client_proof,
    encode_metadata,
    server_proof,
)
from pdrouter.wire.v1 import common_pb2, worker_pb2, worker_pb2_grpc

log = logging.getLogger(__name__)

_STATUS_BY_VALUE = {code.value[0]: code for code in grpc.StatusCode}


@mypyc_attr(native_class=False)  # its base is a Python class (grpc.RpcError)
class LaneError(StatusError):
    """A lane call that ended with a non-OK status; ``code()`` / ``details()`` as on a gRPC error."""


def _nothing() -> None:
    """A call's ``flush`` without a sink."""


class _Inbox:
    """What one call has received: frames, then at most one terminal status."""

    __slots__ = ("flush", "items", "loop", "sink", "waiter")

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.items: collections.deque[tuple[int, int, bytes]] = collections.deque()
        self.loop = loop
        self.waiter: asyncio.Future[None] | None = None
        self.sink: Callable[[bytes], bool] | None = None
        """``StreamCall.set_sink``'s: offered a message's body while the consumer waits with nothing queued."""
        self.flush: Callable[[], None] = _nothing
        """``StreamCall.set_sink``'s: called after the messages of one read that the sink took."""

    def offer(self, body: bytes) -> bool:
        """A message the sink takes now (True), instead of queueing it: only while the consumer waits
        for its next message with none queued, so that every message before it has been consumed (a
        waiter already done was woken, or cancelled with its consumer)."""
        waiter = self.waiter
        return (not self.items and waiter is not None and not waiter.done() and self.sink is not None
                and self.sink(body))

    def put(self, item: tuple[int, int, bytes]) -> None:
        self.items.append(item)
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_result(None)

    async def get(self) -> tuple[int, int, bytes]:
        while not self.items:
            self.waiter = self.loop.create_future()
            await self.waiter
        return self.items.popleft()


_HELLO_STAGE, _CHALLENGE_STAGE, _ACCEPT_STAGE, _READY_STAGE = 0, 1, 2, 3


class _ClientConnection(_Corked):
    def __init__(self, address: str, token: bytes | None = None, tls: bool = False) -> None:
        """``address``: as dialled, the identity the server must prove itself as; ``tls``: the
        connection is TLS, its server verified by its certificate."""
        super().__init__()
        self.address = address
        self.token = token
        self.tls = tls
        self._nonce = secrets.token_bytes(NONCE_SIZE)
        self.frames = _Frames()
        self.calls: dict[int, _Inbox] = {}
        self.greeted: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.lost: str | None = None
        self.lost_code = grpc.StatusCode.UNAVAILABLE
        """The status of the calls the connection's end fails (the server's, when it said why)."""
        self._stage = _HELLO_STAGE
        self._next = 1

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        transport = cast(asyncio.Transport, transport)  # a stream transport (asyncio's or uvloop's)
        self.transport = transport
        transport.write(HELLO + _frame(0, AUTH, 0, self._nonce))

    def connection_lost(self, exc: Exception | None) -> None:
        if self.lost is None:
            self.lost = f"lost the lane connection to {self.address}" + (f": {exc}" if exc else "")
        self._fail_all()

    def _fail_all(self) -> None:
        assert self.lost is not None
        if not self.greeted.done():
            self.greeted.set_exception(LaneError(self.lost_code, self.lost))
        status = self.lost_code.value[0]
        for inbox in self.calls.values():
            inbox.put((END, status, self.lost.encode()))
        self.calls.clear()

    def _fail(self, code: grpc.StatusCode, details: str) -> None:
        """End the connection with ``code``: the greeting (if pending) and every open call fail with it."""
        if self.lost is None:
            self.lost, self.lost_code = details, code
        self._fail_all()
        if self.transport is not None:
            self.transport.close()

    def _closed_by_server(self, arg: int, body: bytes) -> None:
        code = _STATUS_BY_VALUE.get(arg, grpc.StatusCode.UNAVAILABLE)
        self._fail(code, f"the worker lane at {self.address} closed the connection: "
                         f"{body.decode('utf-8', 'replace')}")

    def data_received(self, data: bytes) -> None:
        if self.lost is not None:
            return
        if self._stage != _READY_STAGE:
            rest = self._handshake(data)
            if rest is None:
                return
            data = rest
        try:
            frames = self.frames.feed(data)
        except ValueError as exc:
            assert self.transport is not None
            self.transport.abort()
            log.warning("lane: %s: %s", self.address, exc)
            return
        sunk: list[_Inbox] | None = None
        for stream, kind, arg, _, body in frames:
            if stream == 0:
                if kind == END:  # the server says why it ends the connection
                    self._closed_by_server(arg, body)
                    return
                continue
            inbox = self.calls.get(stream)
            if inbox is None:
                continue  # a call this side already gave up
            if kind == END:
                del self.calls[stream]
            elif kind == MESSAGE and inbox.sink is not None and inbox.offer(body):
                if sunk is None:
                    sunk = [inbox]
                elif inbox is not sunk[-1] and inbox not in sunk:
                    sunk.append(inbox)
                continue
            if sunk is not None and inbox in sunk:  # what the sink took of this read goes before it
                sunk.remove(inbox)
                inbox.flush()
            inbox.put((kind, arg, body))
        if sunk is not None:
            for inbox in sunk:
                inbox.flush()

    def _handshake(self, data: bytes) -> bytes | None:
        """The greeting and, when the server asks, the proof of the token: the bytes after them once
        done (the connection is then greeted), None until then or when it failed."""
        if self._stage == _HELLO_STAGE:
            pending = bytes(self.frames._buf) + data
            if len(pending) < len(HELLO):
                self.frames._buf = bytearray(pending)
                return None
            self.frames._buf = bytearray()
            hello, data = pending[:len(HELLO)], pending[len(HELLO):]
            if hello[:5] != HELLO[:5] or hello[6:] != HELLO[6:] or hello[5] & ~AUTH_REQUIRED:
                self._fail(grpc.StatusCode.FAILED_PRECONDITION,
                           f"the worker at {self.address} speaks lane {hello!r}, not version {VERSION}")
                return None
            if not hello[5] & AUTH_REQUIRED:
                if self.token is not None and not self.tls:
                    if self._refusal_in(data):  # a worker refusing the connection outright says why
                        return None
                    self._fail(grpc.StatusCode.UNAUTHENTICATED,
                               f"the lane at {self.address} does not ask for the internal token: it is no worker "
                               f"of this cluster (or one started without PDROUTER_INTERNAL_TOKEN), and nothing "
                               f"is sent to it")
                    return None
                self._stage = _READY_STAGE
                self.greeted.set_result(None)
                return data
            if self.token is None:
                self._fail(grpc.StatusCode.UNAUTHENTICATED,
                           f"the worker lane at {self.address} requires the internal token "
                           f"(PDROUTER_INTERNAL_TOKEN), and this side has none")
                return None
            self._stage = _CHALLENGE_STAGE
        try:
            frames = self.frames.feed(data)
        except ValueError as exc:
            self._fail(grpc.StatusCode.FAILED_PRECONDITION, f"the worker lane at {self.address}: {exc}")
            return None
        assert self.transport is not None and self.token is not None
        for stream, kind, arg, _, body in frames:
            if stream == 0 and kind == END:
                self._closed_by_server(arg, body)
                return None
            if stream == 0 and kind == AUTH and self._stage == _CHALLENGE_STAGE:
                if not self._check_server(body):
                    return None
                server_nonce, identity = body[:NONCE_SIZE], self.address
                self.transport.write(_frame(0, AUTH, 0, client_proof(self.token, self._nonce, server_nonce, identity)))
                self._stage = _ACCEPT_STAGE
            elif stream == 0 and kind == AUTH and self._stage == _ACCEPT_STAGE and not body:
                self._stage = _READY_STAGE
                self.greeted.set_result(None)
            elif self._stage == _READY_STAGE:
                continue  # no call is open yet: nothing after the acceptance but an END on stream 0 concerns it
            else:
                self._fail(grpc.StatusCode.FAILED_PRECONDITION,
                           f"the worker lane at {self.address} sent an unexpected frame (kind {kind}) "
                           f"during the handshake")
                return None
        # Accepted: what is buffered stays in the parser for the next read.
        return b"" if self._stage == _READY_STAGE else None

    def _refusal_in(self, data: bytes) -> bool:
        """True when ``data`` (what followed a greeting) holds a server's ``END`` on stream 0, which then
        fails the connection with the server's reason."""
        try:
            frames = _Frames().feed(data)
        except ValueError:
            return False
        for stream, kind, arg, _, body in frames:
            if stream == 0 and kind == END:
                self._closed_by_server(arg, body)
                return True
        return False

    def _check_server(self, body: bytes) -> bool:
        """The server's proof (its nonce, proof and identity): True when it proves the token as the
        address dialled; else the connection fails, having sent nothing but the challenge."""
        assert self.token is not None
        nonce, proof = body[:NONCE_SIZE], body[NONCE_SIZE:NONCE_SIZE + PROOF_SIZE]
        identity = body[NONCE_SIZE + PROOF_SIZE:]
        if len(proof) != PROOF_SIZE or not 0 < len(identity) <= MAX_IDENTITY_BYTES:
            self._fail(grpc.StatusCode.UNAUTHENTICATED,
                       f"the lane at {self.address} sent a malformed proof of the internal token")
            return False
        said = identity.decode("utf-8", "replace")
        if said != self.address:
            self._fail(grpc.StatusCode.UNAUTHENTICATED,
                       f"the worker lane at {self.address} answers as {said}: the address it was dialled at (from "
                       f"the registry, or the worker list) is not its own; nothing was sent to it")
            return False
        if not hmac.compare_digest(proof, server_proof(self.token, self._nonce, nonce, self.address)):
            self._fail(grpc.StatusCode.UNAUTHENTICATED,
                       f"the lane at {self.address} did not prove the internal token: it is no worker of this "
                       f"cluster, or this side's PDROUTER_INTERNAL_TOKEN is not the cluster's; nothing was sent to it")
            return False
        return True

    def open(self, method: LaneMethod, body: bytes, timeout_ms: int, meta: bytes = b"") -> tuple[int, _Inbox]:
        """Start a call (``meta``: its encoded metadata, sent in a ``META`` frame before the ``CALL``)."""
        if self.lost is not None or self.transport is None or self.transport.is_closing():
            raise LaneError(self.lost_code, self.lost or f"the lane to {self.address} is closed")
        stream = self._next
        self._next = stream + 1 if stream < 0xFFFFFFFF else 1
        inbox = _Inbox(self.loop)
        self.calls[stream] = inbox
        if meta:
            self._send(_frame(stream, META, 0, meta))
        self._send(_frame(stream, CALL, method.id, body, timeout_ms))
        return stream, inbox

    def cancel(self, stream: int) -> None:
        if self.calls.pop(stream, None) is not None and self.transport is not None \
                and not self.transport.is_closing():
            self._send(_frame(stream, CANCEL))


class LaneChannel:
    """The client end of one worker's lane: connects on first use, reconnects after a loss.

    ``token``: the secret the worker must prove first (as ``address``), then this side (None: a
    worker that asks for it is refused here with UNAUTHENTICATED; with a token, so is one that does
    not ask, unless TLS proved it); ``ssl``: speak TLS, verifying the worker against the context's CA
    as ``server_hostname`` (default: the host of ``address``) and presenting its certificate, if any.
    """

    def __init__(self, address: str, connect_timeout_s: float = 2.0, *, token: bytes | None = None,
                 ssl: SSLContext | None = None, server_hostname: str | None = None) -> None:
        self.address = address
        self.connect_timeout_s = connect_timeout_s
        self.token = token or None
        self.ssl = ssl
        self.server_hostname = server_hostname
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
        host = host.strip("[]")
        loop = asyncio.get_running_loop()
        conn: _ClientConnection | None = None
        tls: dict[str, Any] = {} if self.ssl is None else {
            "ssl": self.ssl, "server_hostname": self.server_hostname or host,
            "ssl_handshake_timeout": self.connect_timeout_s}
        try:
            async with asyncio.timeout(self.connect_timeout_s):
                _, conn = await loop.create_connection(
                    lambda: _ClientConnection(self.address, self.token, self.ssl is not None), host, int(port), **tls)
                await conn.greeted
        except BaseException as exc:
            if conn is not None and conn.transport is not None:
                conn.transport.abort()  # connected but not greeted: do not keep the socket
            if isinstance(exc, (OSError, TimeoutError)):
                raise LaneError(grpc.StatusCode.UNAVAILABLE,
                                f"cannot reach the worker lane at {self.address}: "
                                f"{str(exc) or f'timed out after {self.connect_timeout_s}s'}") from None
            raise
        if conn.lost is not None:  # greeted, then told at once why the connection ends
            raise LaneError(conn.lost_code, conn.lost)
        self._conn = conn
        return conn

    def unary(self, method: LaneMethod, request: Message, timeout: float | None = None,
              metadata: Sequence[tuple[str, str]] | None = None) -> UnaryCall[Any]:
        return UnaryCall(self, method, request, timeout, metadata)

    def stream(self, method: LaneMethod, request: Message, timeout: float | None = None,
               metadata: Sequence[tuple[str, str]] | None = None) -> StreamCall[Any]:
        return StreamCall(self, method, request, timeout, metadata)

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
    """One call on a lane: sent on first use, cancellable at any time like a grpc.aio call.
    ``metadata`` (as grpc.aio's: ``(name, value)`` pairs) travels in the call's ``META`` frame."""

    def __init__(self, channel: LaneChannel, method: LaneMethod, request: Message, timeout: float | None,
                 metadata: Sequence[tuple[str, str]] | None = None) -> None:
        self._channel = channel
        self._method = method
        self._request = request
        self._timeout = timeout
        self._meta = encode_metadata(metadata) if metadata else b""
        self._conn: _ClientConnection | None = None
        self._stream = 0
        self._inbox: _Inbox | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._done = False
        self._cancelled = False
        self._sink: Callable[[bytes], bool] | None = None
        self._flush: Callable[[], None] = _nothing

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
        self._stream, inbox = conn.open(self._method, self._request.SerializeToString(), timeout_ms, self._meta)
        self._conn, self._inbox = conn, inbox
        inbox.sink, inbox.flush = self._sink, self._flush
        if self._timeout is not None:
            # The worker enforces the deadline too; this covers a worker that stopped answering.
            self._timer = conn.loop.call_later(self._timeout + 1.0, self._expire)
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

    def set_sink(self, sink: Callable[[bytes], bool], flush: Callable[[], None]) -> None:
        """Offer ``sink`` each message's body (serialized) as it arrives while the consumer waits for the
        next one with nothing queued, before the consumer would be woken for it; a message it takes
        (True) is not queued, one it refuses (False) is, as without a sink. After the messages of one
        read that it took, ``flush`` (before any later message of the read is queued). The order holds:
        a sink runs only when every earlier message has been read. Neither may raise (they run in the
        connection's ``data_received``, for every call on it)."""
        self._sink, self._flush = sink, flush
        if self._inbox is not None:
            self._inbox.sink, self._inbox.flush = sink, flush

    def has_waiting(self) -> bool:
        """True when a message or the call's end has arrived and not been read: the next ``__anext__``
        then returns (or raises) without waiting."""
        inbox = self._inbox
        return inbox is not None and bool(inbox.items)

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

    def Prefill(self, request: worker_pb2.PrefillRequest, timeout: float | None = None,
                metadata: Sequence[tuple[str, str]] | None = None) -> UnaryCall[worker_pb2.PrefillResponse]:
        return self._channel.unary(PREFILL, request, timeout, metadata)


class DecodeLane:
    """``DecodeWorker`` over a lane."""

    def __init__(self, channel: LaneChannel) -> None:
        self._channel = channel

    def Allocate(self, request: worker_pb2.AllocateRequest, timeout: float | None = None,
                 metadata: Sequence[tuple[str, str]] | None = None) -> UnaryCall[worker_pb2.AllocateResponse]:
        return self._channel.unary(ALLOCATE, request, timeout, metadata)

    def Generate(self, request: worker_pb2.DecodeRequest, timeout: float | None = None,
                 metadata: Sequence[tuple[str, str]] | None = None) -> StreamCall[common_pb2.TokenChunk]:
        return self._channel.stream(DECODE, request, timeout, metadata)

    def Release(self, request: worker_pb2.ReleaseRequest, timeout: float | None = None,
                metadata: Sequence[tuple[str, str]] | None = None) -> UnaryCall[worker_pb2.ReleaseResponse]:
        return self._channel.unary(RELEASE, request, timeout, metadata)

    def Serve(self, request: worker_pb2.ServeRequest, timeout: float | None = None,
              metadata: Sequence[tuple[str, str]] | None = None) -> StreamCall[common_pb2.TokenChunk]:
        return self._channel.stream(SERVE, request, timeout, metadata)


class ColocatedLane:
    """``ColocatedWorker`` over a lane."""

    def __init__(self, channel: LaneChannel) -> None:
        self._channel = channel

    def Generate(self, request: worker_pb2.WorkerGenerateRequest, timeout: float | None = None,
                 metadata: Sequence[tuple[str, str]] | None = None) -> StreamCall[common_pb2.TokenChunk]:
        return self._channel.stream(COLOCATED, request, timeout, metadata)


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
