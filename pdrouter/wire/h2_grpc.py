"""The router's gRPC front door server: gRPC over HTTP/2 on the event loop, written for the purpose.

grpcio's asyncio server costs several times the HTTP door's whole path per call (completion queues, a
poller thread and a round trip through its core for every message), and grpclib, on the general ``h2``
state machine, about as much. This server does what a gRPC server owes its clients and nothing more;
``docs/benchmarks.md`` ("A gRPC server written for the door") has the measurements:

* the HTTP/2 preface and settings (the client's initial window and frame size applied and acknowledged);
  frames are cut from each read by hand; header blocks are decoded by ``hpack``, and a block that leaves
  the decoder's table unchanged is remembered with the table's generation (a gRPC client repeats one
  block per call once its fields are in its table);
* flow control both ways: reads are acknowledged per read (and per stream while its message is still
  coming), writes stay within the client's connection and stream windows and wait while the socket's
  buffer is full;
* PING answered, RST_STREAM cancelling its call, GOAWAY honoured and sent on stop, age and idleness;
* per call: ``grpc-timeout`` (DEADLINE_EXCEEDED at the deadline, the handler cancelled), the handler
  run as a task with a :class:`H2Context` (``write``, ``abort``, ``invocation_metadata``,
  ``time_remaining``, ``peer``), the response headers and an OK status as ready-made bytes, one socket
  write per event-loop pass;
* :class:`GrpcLimits` as grpcio enforces them: a handshake deadline (TLS and the preface), an idle
  deadline, a connection age with its grace, a cap on connections, the streams per connection announced
  and enforced, calls in flight (RESOURCE_EXHAUSTED), the request message's size (RESOURCE_EXHAUSTED
  without buffering past the cap) and the headers' size;
* credentials on the headers, before any byte of the request message is read (``refusal``, as
  :class:`pdrouter.wire.security.CredentialInterceptor` decides), the health service open;
* the standard health service (``grpc.health.v1.Health``: ``Check`` and ``Watch``);
* TLS from :class:`pdrouter.core.tls.TlsFiles` (ALPN ``h2``).

Methods are unary-unary or unary-stream (what the door serves). Request messages are taken
uncompressed only (a compressed one ends UNIMPLEMENTED); answers are never compressed.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import logging
import socket
import ssl
import struct
import time
import urllib.parse
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, NoReturn

import grpc
from grpc_health.v1 import health_pb2
from hpack import Decoder
from hpack.exceptions import HPACKError

from pdrouter.core.tls import TlsFiles
from pdrouter.wire.grpc_limits import GrpcLimits

log = logging.getLogger(__name__)

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
DATA, HEADERS, PRIORITY, RST_STREAM, SETTINGS, PUSH_PROMISE, PING, GOAWAY, WINDOW_UPDATE, CONTINUATION = range(10)
END_STREAM = ACK = 0x1
END_HEADERS, PADDED, PRIORITY_FLAG = 0x4, 0x8, 0x20
NO_ERROR, PROTOCOL_ERROR, FLOW_CONTROL_ERROR, FRAME_SIZE_ERROR, REFUSED_STREAM, CANCEL, COMPRESSION_ERROR = (
    0x0, 0x1, 0x3, 0x6, 0x7, 0x8, 0x9)
ENHANCE_YOUR_CALM = 0xB
SETTINGS_MAX_CONCURRENT_STREAMS, SETTINGS_INITIAL_WINDOW_SIZE, SETTINGS_MAX_FRAME_SIZE = 0x3, 0x4, 0x5
SETTINGS_MAX_HEADER_LIST_SIZE = 0x6
DEFAULT_WINDOW = 65_535
MAX_FRAME = 16_384
"""The frame size this server takes (HTTP/2's default; it announces no other)."""
STREAM_WINDOW = 1 << 20
CONNECTION_WINDOW = 16 << 20
MAX_WINDOW = (1 << 31) - 1
UNARY_UNARY, UNARY_STREAM = "unary_unary", "unary_stream"
HEALTH_SERVICE = "grpc.health.v1.Health"
OPEN_PREFIX = f"/{HEALTH_SERVICE}/"
_TIMEOUT_UNITS = {"H": 3600.0, "M": 60.0, "S": 1.0, "m": 1e-3, "u": 1e-6, "n": 1e-9}
_SKIPPED = frozenset(("content-type", "te", "grpc-accept-encoding", "user-agent", "grpc-timeout", "grpc-encoding"))
"""Request headers that are the transport's, not the call's metadata (grpcio leaves them out too)."""
_MESSAGE_SAFE = "".join(chr(c) for c in range(0x20, 0x7F) if chr(c) != "%")
_MAX_BLOCK_FACTOR = 4
"""A header block (with its CONTINUATIONs) past this many times the metadata limit closes the connection."""


def frame(kind: int, flags: int, stream: int, payload: bytes = b"") -> bytes:
    """One HTTP/2 frame."""
    n = len(payload)
    return bytes((n >> 16, (n >> 8) & 0xFF, n & 0xFF, kind, flags)) + stream.to_bytes(4, "big") + payload


def _integer(value: int, prefix_bits: int) -> bytes:
    """HPACK's integer with a ``prefix_bits`` prefix (the byte's other bits 0)."""
    limit = (1 << prefix_bits) - 1
    if value < limit:
        return bytes((value,))
    out = bytearray((limit,))
    value -= limit
    while value >= 128:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def literal(name: bytes | int, value: bytes) -> bytes:
    """One header field as an HPACK literal without indexing (no Huffman coding): it leaves the peer's
    table as it was, so a block of them is the same bytes every time. ``name``: the name, or its
    index in HPACK's static table."""
    head = _integer(name, 4) if isinstance(name, int) else b"\x00" + _integer(len(name), 7) + name
    return head + _integer(len(value), 7) + value


# ``:status: 200`` is HPACK's static entry 8 (indexed); ``content-type`` entry 31.
_RESPONSE_HEADERS = b"\x88" + literal(31, b"application/grpc")
_OK_TRAILERS = literal(b"grpc-status", b"0")


def _trailers(code: int, message: str) -> bytes:
    if code == 0:
        return _OK_TRAILERS
    block = literal(b"grpc-status", str(code).encode())
    if message:
        block += literal(b"grpc-message", urllib.parse.quote(message[:4096], safe=_MESSAGE_SAFE).encode())
    return block


class HeaderDecoder:
    """An HPACK decoder (``hpack``'s) that remembers the blocks that left its table as they were, with
    the table's generation: a gRPC peer repeats one block per call once its fields are in its table,
    and a remembered block costs a dict look-up instead of a decode. At most ``blocks`` blocks of at
    most ``block_bytes`` bytes each are remembered, whatever a peer sends. ``decode`` raises what
    ``hpack`` raises for a block it cannot decode."""

    def __init__(self, blocks: int = 64, block_bytes: int = 512) -> None:
        self._decoder = Decoder()
        self._decoder.max_allowed_table_size = 4096  # HTTP/2's default SETTINGS_HEADER_TABLE_SIZE
        self._blocks, self._block_bytes = blocks, block_bytes
        self._remembered: dict[bytes, tuple[int, list[tuple[str, str]]]] = {}
        self._generation = 0

    def decode(self, block: bytes) -> list[tuple[str, str]]:
        known = self._remembered.get(block)
        if known is not None and known[0] == self._generation:
            return known[1]
        table = self._decoder.header_table.dynamic_entries
        before = (len(table), id(table[0]) if table else 0)
        fields = [(str(name), str(value)) for name, value in self._decoder.decode(block)]
        if (len(table), id(table[0]) if table else 0) != before:
            self._generation += 1
        elif len(block) <= self._block_bytes and len(self._remembered) < self._blocks:
            self._remembered[block] = (self._generation, fields)
        return fields


class Abort(Exception):
    """Ends a call with a status (what :meth:`H2Context.abort` raises)."""

    def __init__(self, code: int, details: str) -> None:
        super().__init__(details)
        self.code = code
        self.details = details


def _code(code: grpc.StatusCode | int) -> int:
    return code if isinstance(code, int) else int(code.value[0])


@dataclass(frozen=True, slots=True)
class Method:
    """One method of a service: its shape, its handler ``(request, context)``, its message codecs."""

    cardinality: str
    handler: Callable[[Any, Any], Awaitable[Any]]
    deserialize: Callable[[bytes], Any]
    serialize: Callable[[Any], bytes]


class H2Context:
    """The part of ``grpc.aio.ServicerContext`` the door's servicers use."""

    __slots__ = ("_call",)

    def __init__(self, call: _Call) -> None:
        self._call = call

    def invocation_metadata(self) -> tuple[tuple[str, str | bytes], ...]:
        return self._call.metadata

    def time_remaining(self) -> float | None:
        deadline = self._call.deadline
        return None if deadline is None else max(0.0, deadline - time.monotonic())

    def peer(self) -> str:
        return self._call.conn.peer

    async def write(self, message: Any) -> None:
        call = self._call
        assert call.method is not None  # a call runs only once its method is known
        body = call.method.serialize(message)
        await call.conn.send_data(call, b"\x00" + len(body).to_bytes(4, "big") + body)

    async def abort(self, code: grpc.StatusCode | int, details: str = "") -> NoReturn:
        raise Abort(_code(code), details)


class _Call:
    """One stream: its request as it arrives, then its handler's task."""

    __slots__ = ("blocked", "body", "conn", "deadline", "ended_by_client", "headers_sent", "id", "metadata",
                 "method", "path", "size", "task", "timer", "window")

    def __init__(self, conn: _Connection, stream_id: int, window: int) -> None:
        self.conn = conn
        self.id = stream_id
        self.window = window
        self.path = ""
        self.metadata: tuple[tuple[str, str | bytes], ...] = ()
        self.deadline: float | None = None
        self.method: Method | None = None
        self.body: list[bytes] = []
        self.size = 0
        self.ended_by_client = False
        self.headers_sent = False
        self.task: asyncio.Task[None] | None = None
        self.timer: asyncio.TimerHandle | None = None
        self.blocked: asyncio.Future[None] | None = None


class _ProtocolError(Exception):
    def __init__(self, code: int, reason: str) -> None:
        super().__init__(reason)
        self.code = code


class _Connection(asyncio.Protocol):
    """One client connection."""

    def __init__(self, server: H2GrpcServer) -> None:
        self.server = server
        self.limits = server.limits
        self.loop = server.loop
        self.transport: asyncio.Transport | None = None
        self.peer = ""
        self.buffer = b""
        self.started = False
        self.handshaken = False
        self.decoder = HeaderDecoder()
        self.calls: dict[int, _Call] = {}
        self.last_stream = 0
        self.window = DEFAULT_WINDOW
        self.initial_window = DEFAULT_WINDOW
        self.max_frame = MAX_FRAME
        self.received = 0
        self.pending: list[bytes] = []
        self.flush_scheduled = False
        self.in_read = False
        self.block: tuple[int, int, list[bytes], int] | None = None  # stream, flags, pieces, size
        self.going_away = False
        self.paused: asyncio.Future[None] | None = None
        self.writes_paused = False
        self.any_blocked = False
        self.timers: list[asyncio.TimerHandle] = []
        self.idle: asyncio.TimerHandle | None = None

    # -- the connection's life ----------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        server = self.server
        if len(server.connections) >= self.limits.max_connections or server.stopping:
            transport.abort()  # type: ignore[attr-defined]
            return
        server.connections.add(self)
        address = transport.get_extra_info("peername")
        self.peer = f"ipv4:{address[0]}:{address[1]}" if address else ""
        sock = transport.get_extra_info("socket")
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        limits = self.limits
        self.timers.append(self.loop.call_later(limits.handshake_timeout_s, self._handshake_expired))
        self.timers.append(self.loop.call_later(limits.max_connection_age_s, self._aged))
        settings = struct.pack(">HIHIHI", SETTINGS_MAX_CONCURRENT_STREAMS, limits.max_streams,
                               SETTINGS_INITIAL_WINDOW_SIZE, STREAM_WINDOW,
                               SETTINGS_MAX_HEADER_LIST_SIZE, limits.max_metadata_bytes)
        transport.write(frame(SETTINGS, 0, 0, settings)  # type: ignore[attr-defined]
                        + frame(WINDOW_UPDATE, 0, 0, (CONNECTION_WINDOW - DEFAULT_WINDOW).to_bytes(4, "big")))

    def connection_lost(self, exc: Exception | None) -> None:
        self.server.connections.discard(self)
        for timer in self.timers:
            timer.cancel()
        if self.idle is not None:
            self.idle.cancel()
        for call in list(self.calls.values()):
            self._drop(call)
        if self.paused is not None and not self.paused.done():
            self.paused.set_result(None)

    def pause_writing(self) -> None:
        self.writes_paused = True

    def resume_writing(self) -> None:
        self.writes_paused = False
        if self.paused is not None and not self.paused.done():
            self.paused.set_result(None)
        self.paused = None

    def _handshake_expired(self) -> None:
        """The preface and the client's first SETTINGS did not come in time (however they trickled)."""
        if not self.handshaken and self.transport is not None:
            self.transport.close()

    def _aged(self) -> None:
        self.go_away(NO_ERROR)
        self.timers.append(self.loop.call_later(self.limits.max_connection_age_grace_s, self.close))

    def _idle_expired(self) -> None:
        self.idle = None
        if not self.calls:
            self.go_away(NO_ERROR)
            self.close()

    def _watch_idle(self) -> None:
        if self.idle is None and not self.calls:
            self.idle = self.loop.call_later(self.limits.idle_timeout_s, self._idle_expired)

    def go_away(self, code: int, reason: str = "") -> None:
        """Tell the client that no stream past the last one it opened will be served."""
        if not self.going_away:
            self.going_away = True
            self.send(frame(GOAWAY, 0, 0, struct.pack(">II", self.last_stream, code) + reason.encode()[:256]))
            self.flush()
        if not self.calls:
            self.loop.call_soon(self.close)

    def close(self) -> None:
        if self.transport is not None and not self.transport.is_closing():
            self.flush()
            self.transport.close()

    # -- writes -------------------------------------------------------------------------------
    def send(self, data: bytes) -> None:
        self.pending.append(data)
        if not self.in_read and not self.flush_scheduled:
            self.flush_scheduled = True
            self.loop.call_soon(self.flush)

    def flush(self) -> None:
        self.flush_scheduled = False
        if self.pending:
            transport = self.transport
            if transport is not None and not transport.is_closing():
                transport.write(b"".join(self.pending))
            self.pending.clear()

    async def send_data(self, call: _Call, data: bytes) -> None:
        """``data`` on ``call``'s stream, within the client's windows (waiting for them to open)."""
        if not call.headers_sent:
            call.headers_sent = True
            self.send(frame(HEADERS, END_HEADERS, call.id, _RESPONSE_HEADERS))
        view = memoryview(data)
        while view:
            if self.calls.get(call.id) is not call:
                raise asyncio.CancelledError()
            if self.writes_paused:
                self.paused = self.paused or self.loop.create_future()
                await self.paused
                continue
            n = min(len(view), self.window, call.window, self.max_frame)
            if n <= 0:
                call.blocked = self.loop.create_future()
                self.any_blocked = True
                await call.blocked
                continue
            self.window -= n
            call.window -= n
            self.send(frame(DATA, 0, call.id, bytes(view[:n])))
            view = view[n:]

    def _unblock(self) -> None:
        """Wake the writes waiting for a window (a WINDOW_UPDATE or new settings came)."""
        if not self.any_blocked:
            return
        self.any_blocked = False
        for call in self.calls.values():
            waiter = call.blocked
            if waiter is not None:
                call.blocked = None
                if not waiter.done():
                    waiter.set_result(None)

    # -- reads --------------------------------------------------------------------------------
    def data_received(self, data: bytes) -> None:
        buf = self.buffer + data if self.buffer else data
        pos = 0
        if not self.started:
            if len(buf) < len(PREFACE):
                if not PREFACE.startswith(buf):
                    self.close()
                self.buffer = buf
                return
            if not buf.startswith(PREFACE):
                self.close()
                return
            pos = len(PREFACE)
            self.started = True
            self._watch_idle()
        self.in_read = True
        end = len(buf)
        try:
            while end - pos >= 9:
                length = (buf[pos] << 16) | (buf[pos + 1] << 8) | buf[pos + 2]
                if length > MAX_FRAME:
                    raise _ProtocolError(FRAME_SIZE_ERROR, "frame larger than the maximum frame size")
                if end - pos - 9 < length:
                    break
                kind, flags = buf[pos + 3], buf[pos + 4]
                stream_id = int.from_bytes(buf[pos + 5:pos + 9], "big") & 0x7FFFFFFF
                payload = buf[pos + 9:pos + 9 + length]
                pos += 9 + length
                if self.block is not None and kind != CONTINUATION:
                    raise _ProtocolError(PROTOCOL_ERROR, "a header block was interrupted")
                self._frame(kind, flags, stream_id, payload)
            self.buffer = buf[pos:]
            if self.received:
                self.pending.append(frame(WINDOW_UPDATE, 0, 0, self.received.to_bytes(4, "big")))
                self.received = 0
        except _ProtocolError as exc:
            self.buffer = b""
            self.in_read = False
            log.debug("gRPC connection from %s: %s", self.peer, exc)
            self.go_away(exc.code, str(exc))
            self.close()
            return
        finally:
            self.in_read = False
        self.flush()

    def _frame(self, kind: int, flags: int, stream_id: int, payload: bytes) -> None:
        if kind == DATA:
            self._data(flags, stream_id, payload)
        elif kind == HEADERS:
            if stream_id == 0 or stream_id % 2 == 0:
                raise _ProtocolError(PROTOCOL_ERROR, "HEADERS on a stream a client may not open")
            payload = _unpadded(flags, payload)
            if flags & PRIORITY_FLAG:
                payload = payload[5:]
            self._block_start(stream_id, flags, payload)
        elif kind == CONTINUATION:
            block = self.block
            if block is None or block[0] != stream_id:
                raise _ProtocolError(PROTOCOL_ERROR, "CONTINUATION without its HEADERS")
            size = block[3] + len(payload)
            if size > _MAX_BLOCK_FACTOR * self.limits.max_metadata_bytes + MAX_FRAME:
                raise _ProtocolError(ENHANCE_YOUR_CALM, "header block too large")
            block[2].append(payload)
            self.block = (stream_id, block[1], block[2], size)
            if flags & END_HEADERS:
                self.block = None
                self._headers(stream_id, block[1], b"".join(block[2]))
        elif kind == SETTINGS:
            self._settings(flags, stream_id, payload)
        elif kind == WINDOW_UPDATE:
            if len(payload) != 4:
                raise _ProtocolError(FRAME_SIZE_ERROR, "WINDOW_UPDATE of the wrong size")
            increment = int.from_bytes(payload, "big") & 0x7FFFFFFF
            if stream_id == 0:
                if increment == 0 or self.window + increment > MAX_WINDOW:
                    raise _ProtocolError(FLOW_CONTROL_ERROR, "bad connection window update")
                self.window += increment
            elif (call := self.calls.get(stream_id)) is not None:
                call.window += increment
            self._unblock()
        elif kind == PING:
            if len(payload) != 8 or stream_id:
                raise _ProtocolError(FRAME_SIZE_ERROR, "PING of the wrong size")
            if not flags & ACK:
                self.pending.append(frame(PING, ACK, 0, payload))
        elif kind == RST_STREAM:
            call = self.calls.get(stream_id)
            if call is not None:
                self._drop(call)
        elif kind == GOAWAY:
            self.going_away = True
            if not self.calls:
                self.loop.call_soon(self.close)
        elif kind == PUSH_PROMISE:
            raise _ProtocolError(PROTOCOL_ERROR, "a client may not push")
        # PRIORITY and unknown frame types are ignored (RFC 9113, 4.1 and 5.5).

    def _settings(self, flags: int, stream_id: int, payload: bytes) -> None:
        if stream_id:
            raise _ProtocolError(PROTOCOL_ERROR, "SETTINGS on a stream")
        if flags & ACK:
            return
        if len(payload) % 6:
            raise _ProtocolError(FRAME_SIZE_ERROR, "SETTINGS of the wrong size")
        for i in range(0, len(payload), 6):
            key, value = struct.unpack_from(">HI", payload, i)
            if key == SETTINGS_INITIAL_WINDOW_SIZE:
                if value > MAX_WINDOW:
                    raise _ProtocolError(FLOW_CONTROL_ERROR, "initial window too large")
                delta = value - self.initial_window
                self.initial_window = value
                for call in self.calls.values():
                    call.window += delta
                self._unblock()
            elif key == SETTINGS_MAX_FRAME_SIZE:
                if not MAX_FRAME <= value < 1 << 24:
                    raise _ProtocolError(PROTOCOL_ERROR, "bad maximum frame size")
                self.max_frame = value
        self.pending.append(frame(SETTINGS, ACK, 0))
        self.handshaken = True

    def _block_start(self, stream_id: int, flags: int, block: bytes) -> None:
        if flags & END_HEADERS:
            self._headers(stream_id, flags, block)
        else:
            self.block = (stream_id, flags, [block], len(block))

    def _headers(self, stream_id: int, flags: int, block: bytes) -> None:
        try:
            headers = self.decoder.decode(block)
        except (HPACKError, UnicodeDecodeError, ValueError) as exc:
            raise _ProtocolError(COMPRESSION_ERROR, f"header block not decodable ({type(exc).__name__})") from None
        call = self.calls.get(stream_id)
        if call is not None or stream_id <= self.last_stream:  # trailers of a request (none expected)
            if call is not None and flags & END_STREAM:
                self._ended(call)
            return
        self.last_stream = stream_id
        if self.going_away:
            self.send(frame(RST_STREAM, 0, stream_id, REFUSED_STREAM.to_bytes(4, "big")))
            return
        if len(self.calls) >= self.limits.max_streams:
            self.send(frame(RST_STREAM, 0, stream_id, REFUSED_STREAM.to_bytes(4, "big")))
            return
        call = _Call(self, stream_id, self.initial_window)
        self.calls[stream_id] = call
        if self.idle is not None:
            self.idle.cancel()
            self.idle = None
        refusal = self._admit(call, headers)
        if refusal is not None:
            self._finish(call, *refusal)
            return
        if flags & END_STREAM:
            self._ended(call)

    def _admit(self, call: _Call, headers: list[tuple[str, str]]) -> tuple[int, str] | None:
        """Read the call's headers; the status that ends it before its message is read, if any."""
        size = 0
        metadata: list[tuple[str, str | bytes]] = []
        content_type = verb = ""
        for name, value in headers:
            size += len(name) + len(value) + 32
            if name == ":path":
                call.path = value
            elif name == ":method":
                verb = value
            elif name == "content-type":
                content_type = value
            elif name == "grpc-timeout":
                try:
                    call.deadline = time.monotonic() + int(value[:-1]) * _TIMEOUT_UNITS[value[-1]]
                except (ValueError, KeyError, IndexError):
                    return _code(grpc.StatusCode.INVALID_ARGUMENT), f"bad grpc-timeout {value[:20]!r}"
            elif name == "grpc-encoding" and value != "identity":
                return _code(grpc.StatusCode.UNIMPLEMENTED), f"grpc-encoding {value[:20]!r} is not accepted"
            elif name[0] != ":" and name not in _SKIPPED:
                if name.endswith("-bin"):  # binary metadata travels base64-encoded, padding optional
                    try:
                        metadata.append((name, base64.b64decode(value + "=" * (-len(value) % 4), validate=True)))
                    except ValueError:
                        return _code(grpc.StatusCode.INVALID_ARGUMENT), f"metadata {name[:40]!r} is not base64"
                else:
                    metadata.append((name, value))
        if size > self.limits.max_metadata_bytes:
            return (_code(grpc.StatusCode.RESOURCE_EXHAUSTED),
                    f"headers of {size} bytes, over the limit of {self.limits.max_metadata_bytes}")
        if verb != "POST":
            return _code(grpc.StatusCode.UNIMPLEMENTED), f"gRPC calls are POSTs, not {verb[:20]!r}"
        if not content_type.startswith("application/grpc"):
            return _code(grpc.StatusCode.INTERNAL), f"content-type {content_type[:40]!r} is not gRPC's"
        call.metadata = tuple(metadata)
        server = self.server
        method = server.methods.get(call.path)
        if method is None:
            return _code(grpc.StatusCode.UNIMPLEMENTED), f"Method not found: {call.path[:200]}"
        call.method = method
        if server.refusal is not None and not call.path.startswith(OPEN_PREFIX):
            reason = server.refusal(call.metadata)
            if reason is not None:
                return _code(grpc.StatusCode.UNAUTHENTICATED), reason
        inflight = self.limits.max_inflight
        if inflight is not None and server.inflight >= inflight:
            return _code(grpc.StatusCode.RESOURCE_EXHAUSTED), f"the server has {inflight} calls in flight; retry"
        if call.deadline is not None:
            call.timer = self.loop.call_at(self.loop.time() + max(0.0, call.deadline - time.monotonic()),
                                           self._expired, call)
        return None

    def _data(self, flags: int, stream_id: int, payload: bytes) -> None:
        self.received += len(payload)
        if stream_id == 0:
            raise _ProtocolError(PROTOCOL_ERROR, "DATA on stream 0")
        call = self.calls.get(stream_id)
        if call is None or call.ended_by_client or call.task is not None:
            return
        payload = _unpadded(flags, payload)
        call.size += len(payload)
        if call.size > self.limits.max_message_bytes + 5:
            self._finish(call, _code(grpc.StatusCode.RESOURCE_EXHAUSTED),
                         f"the request message is over the limit of {self.limits.max_message_bytes} bytes")
            return
        call.body.append(payload)
        if flags & END_STREAM:
            self._ended(call)
        elif payload:
            self.pending.append(frame(WINDOW_UPDATE, 0, stream_id, len(payload).to_bytes(4, "big")))

    def _ended(self, call: _Call) -> None:
        """The client sent its whole request: run the handler."""
        call.ended_by_client = True
        method = call.method
        if method is None or call.task is not None:
            return
        body = b"".join(call.body)
        call.body = []
        if len(body) < 5:
            self._finish(call, _code(grpc.StatusCode.INTERNAL), "the call carries no request message")
            return
        if body[0] != 0:
            self._finish(call, _code(grpc.StatusCode.UNIMPLEMENTED), "compressed messages are not accepted")
            return
        if int.from_bytes(body[1:5], "big") != len(body) - 5:
            self._finish(call, _code(grpc.StatusCode.INTERNAL), "the request is not exactly one message")
            return
        call.task = self.loop.create_task(self._run(call, method, body[5:]))

    async def _run(self, call: _Call, method: Method, message: bytes) -> None:
        # Counted here, not when the task is made: a task cancelled before its first step (a stream
        # reset in the read that ended it) never runs its body, so it must not have been counted.
        self.server.inflight += 1
        code, details = 0, ""
        try:
            request = method.deserialize(message)
            context = H2Context(call)
            if method.cardinality == UNARY_UNARY:
                response = await method.handler(request, context)
                await context.write(response)
            else:
                await method.handler(request, context)
        except Abort as exc:
            code, details = exc.code, exc.details
        except asyncio.CancelledError:
            return
        except Exception as exc:
            log.error("gRPC call %s failed", call.path, exc_info=exc)
            code, details = _code(grpc.StatusCode.INTERNAL), f"internal error ({type(exc).__name__})"
        finally:
            self.server.inflight -= 1
        if self.calls.get(call.id) is call:
            self._finish(call, code, details)

    def _expired(self, call: _Call) -> None:
        if self.calls.get(call.id) is call:
            self._finish(call, _code(grpc.StatusCode.DEADLINE_EXCEEDED), "Deadline Exceeded")

    def _finish(self, call: _Call, code: int, details: str) -> None:
        """End ``call`` with its status (trailers, or headers and status together when nothing was sent)."""
        block = _trailers(code, details) if call.headers_sent else _RESPONSE_HEADERS + _trailers(code, details)
        self.send(frame(HEADERS, END_HEADERS | END_STREAM, call.id, block))
        if not call.ended_by_client:  # answered before the request was whole: the client stops sending
            self.send(frame(RST_STREAM, 0, call.id, NO_ERROR.to_bytes(4, "big")))
        self._drop(call)

    def _drop(self, call: _Call) -> None:
        """Forget ``call``, cancelling its handler if it still runs."""
        if self.calls.pop(call.id, None) is None:
            return
        if call.timer is not None:
            call.timer.cancel()
        task = call.task
        if task is not None and not task.done() and task is not asyncio.current_task():
            task.cancel()
        if call.blocked is not None and not call.blocked.done():
            call.blocked.set_result(None)
        if not self.calls:
            if self.going_away:
                self.loop.call_soon(self.close)
            elif self.started:
                self._watch_idle()
        self.server.call_ended()


def _unpadded(flags: int, payload: bytes) -> bytes:
    if not flags & PADDED:
        return payload
    if not payload or payload[0] >= len(payload):
        raise _ProtocolError(PROTOCOL_ERROR, "padding longer than the frame")
    return payload[1:len(payload) - payload[0]]


class _Health:
    """``grpc.health.v1.Health``: each service's status, and the watchers waiting for a change."""

    def __init__(self) -> None:
        self.statuses: dict[str, int] = {}
        self.changed = asyncio.Event()

    def set(self, service: str, status: int) -> None:
        if self.statuses.get(service) != status:
            self.statuses[service] = status
            self.changed.set()
            self.changed = asyncio.Event()

    async def check(self, request: health_pb2.HealthCheckRequest, context: H2Context) -> health_pb2.HealthCheckResponse:
        status = self.statuses.get(request.service)
        if status is None:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"unknown service {request.service[:200]!r}")
        return health_pb2.HealthCheckResponse(status=status)

    async def watch(self, request: health_pb2.HealthCheckRequest, context: H2Context) -> None:
        last = None
        while True:
            status = self.statuses.get(request.service, health_pb2.HealthCheckResponse.SERVICE_UNKNOWN)
            if status != last:
                await context.write(health_pb2.HealthCheckResponse(status=status))
                last = status
            await self.changed.wait()

    def methods(self) -> dict[str, Method]:
        codec = (health_pb2.HealthCheckRequest.FromString, health_pb2.HealthCheckResponse.SerializeToString)
        return {f"/{HEALTH_SERVICE}/Check": Method(UNARY_UNARY, self.check, *codec),
                f"/{HEALTH_SERVICE}/Watch": Method(UNARY_STREAM, self.watch, *codec)}


class H2GrpcServer:
    """A gRPC server on ``host:port`` (0: any free port; bound at once), with the health service,
    under :class:`GrpcLimits`; TLS with ``tls``; ``refusal(metadata)`` gives the reason a call is
    refused UNAUTHENTICATED (None: served), checked for every call but the health service's.
    Create it inside the event loop that serves it."""

    def __init__(self, host: str = "127.0.0.1", port: int = 0, *, tls: TlsFiles | None = None,
                 limits: GrpcLimits | None = None,
                 refusal: Callable[[Sequence[tuple[str, str | bytes]]], str | None] | None = None) -> None:
        self.limits = GrpcLimits() if limits is None else limits
        self.loop = asyncio.get_running_loop()
        self.refusal = refusal
        self.tls = tls is not None
        self._ssl: ssl.SSLContext | None = None
        if tls is not None:
            self._ssl = tls.server_context(require_client_cert=False)
            self._ssl.set_alpn_protocols(["h2"])
        self._health = _Health()
        self.methods: dict[str, Method] = dict(self._health.methods())
        self._service_names: list[str] = []
        self.connections: set[_Connection] = set()
        self.inflight = 0
        self.stopping = False
        self._idle_calls: asyncio.Event | None = None
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._sock = socket.socket(family, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            self._sock.bind((host, port))
        except OSError as exc:
            self._sock.close()
            raise OSError(f"cannot bind gRPC server to {host}:{port}: {exc.strerror}") from exc
        self._sock.listen(1024)
        self._sock.setblocking(False)
        self.host = host
        self.port: int = self._sock.getsockname()[1]
        self.identity = f"{host}:{self.port}"
        self._server: asyncio.Server | None = None
        self._stopped = asyncio.Event()

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    def add_service(self, service_name: str, methods: dict[str, Method]) -> None:
        """Serve ``methods`` (by method name) as ``service_name``, reported SERVING once started."""
        for name, method in methods.items():
            self.methods[f"/{service_name}/{name}"] = method
        self._service_names.append(service_name)

    async def start(self) -> None:
        self._server = await self.loop.create_server(
            lambda: _Connection(self), sock=self._sock, ssl=self._ssl,
            ssl_handshake_timeout=self.limits.handshake_timeout_s if self._ssl is not None else None)
        for name in ["", *self._service_names]:
            self._health.set(name, health_pb2.HealthCheckResponse.SERVING)

    async def not_serving(self) -> None:
        """Report NOT_SERVING for the server and every service (calls are still taken)."""
        for name in ["", *self._service_names]:
            self._health.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)

    def call_ended(self) -> None:
        if self._idle_calls is not None and not any(c.calls for c in self.connections):
            self._idle_calls.set()

    async def stop(self, grace: float = 5.0) -> None:
        """Report NOT_SERVING, refuse new calls (GOAWAY), let calls in flight finish within ``grace``,
        then cancel what is left and close every connection."""
        await self.not_serving()
        self.stopping = True
        if self._server is not None:
            self._server.close()
        self._idle_calls = asyncio.Event()
        for conn in list(self.connections):
            conn.go_away(NO_ERROR)
        self.call_ended()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._idle_calls.wait(), grace)
        for conn in list(self.connections):
            for call in list(conn.calls.values()):
                conn._finish(call, _code(grpc.StatusCode.UNAVAILABLE), "the server is shutting down")
            conn.close()
        if self._server is None:
            self._sock.close()
        self._stopped.set()

    async def wait(self) -> None:
        await self._stopped.wait()
