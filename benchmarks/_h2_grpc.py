"""A gRPC server over HTTP/2 written for one purpose, to measure what a door on such a server would cost.

grpcio's asyncio server costs more CPU per call than the router's whole HTTP door (``docs/benchmarks.md``,
"The gRPC door against the HTTP door"); grpclib, on the ``h2`` library, costs about as much. Both are
general. This one does only what a gRPC server owes its clients, on the event loop the router runs on:

* the HTTP/2 preface and settings (the client's initial window and frame size applied, each acknowledged);
* frames read by hand from each read (a 9-byte header, no per-frame objects); headers decoded by ``hpack``,
  a header block that decodes without changing the decoder's table remembered with the table's
  generation (a gRPC client repeats one block per call once its fields are in its table);
* flow control both ways: the reads acknowledged with one WINDOW_UPDATE per read, the writes kept within
  the client's connection and stream windows (a write past them waits for its WINDOW_UPDATE);
* PING answered, RST_STREAM cancelling its call, GOAWAY honoured;
* per call: ``grpc-timeout`` read, the request message's length prefix checked (no compression), the
  handler run as a task with a context offering what the router's servicer uses (``write``, ``abort``,
  ``invocation_metadata``, ``time_remaining``), the response headers, messages and trailers written
  with one ``write`` per event-loop pass.

It serves unary-stream and unary-unary methods given as ``{"/pkg.Service/Method": (kind, request
class, handler)}``. Not served (a door on it would have to): TLS, server limits, health, interceptors.

    python benchmarks/_h2_grpc.py --port N     # the bare Generate of frontdoor_bench.py, alone
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import signal
import struct
import time
import urllib.parse
from collections.abc import Awaitable, Callable
from typing import Any

from hpack import Decoder

from pdrouter.core.aio import event_loop_factory

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
DATA, HEADERS, PRIORITY, RST_STREAM, SETTINGS, PUSH_PROMISE, PING, GOAWAY, WINDOW_UPDATE, CONTINUATION = range(10)
END_STREAM, ACK, END_HEADERS, PADDED, PRIORITY_FLAG = 0x1, 0x1, 0x4, 0x8, 0x20
DEFAULT_WINDOW = 65_535
RECEIVE_WINDOW = 1 << 24
"""What this server lets a client send ahead, per stream and per connection."""
MAX_MESSAGE = 16 << 20

# Response header blocks from HPACK's static table, never indexed: ``:status: 200`` is entry 8,
# ``content-type`` entry 31 (a literal without indexing, indexed name), ``grpc-status`` a new name.
_RESPONSE_HEADERS = b"\x88\x0f\x10\x10application/grpc"
_OK_TRAILERS = b"\x00\x0bgrpc-status\x010"
_TIMEOUT_UNITS = {"H": 3600.0, "M": 60.0, "S": 1.0, "m": 1e-3, "u": 1e-6, "n": 1e-9}
UNARY_STREAM, UNARY_UNARY = "unary_stream", "unary_unary"
Handler = Callable[[Any, "Context"], Awaitable[Any]]


def frame(kind: int, flags: int, stream: int, payload: bytes = b"") -> bytes:
    n = len(payload)
    return bytes((n >> 16, (n >> 8) & 0xFF, n & 0xFF, kind, flags)) + stream.to_bytes(4, "big") + payload


def _literal(name: bytes, value: bytes) -> bytes:
    """One header field, a literal without indexing with a new name (no Huffman); short strings only."""
    assert len(name) < 127 and len(value) < 127
    return b"\x00" + bytes((len(name),)) + name + bytes((len(value),)) + value


def trailers(code: int, message: str = "") -> bytes:
    if code == 0:
        return _OK_TRAILERS
    block = _literal(b"grpc-status", str(code).encode())
    if message:
        block += _literal(b"grpc-message", urllib.parse.quote(message[:100], safe=" ").encode())
    return block


class Abort(Exception):
    def __init__(self, code: int, details: str) -> None:
        super().__init__(details)
        self.code, self.details = code, details


class Context:
    """The part of ``grpc.aio.ServicerContext`` a servicer of the router uses."""

    __slots__ = ("_conn", "_deadline", "_metadata", "_stream", "headers_sent")

    def __init__(self, conn: Connection, stream: int, metadata: list[tuple[str, str]], deadline: float | None) -> None:
        self._conn, self._stream, self._metadata, self._deadline = conn, stream, metadata, deadline
        self.headers_sent = False

    def invocation_metadata(self) -> list[tuple[str, str]]:
        return self._metadata

    def time_remaining(self) -> float | None:
        return None if self._deadline is None else max(0.0, self._deadline - time.monotonic())

    async def write(self, message: Any) -> None:
        body = message.SerializeToString()
        data = b"\x00" + len(body).to_bytes(4, "big") + body
        conn = self._conn
        if not self.headers_sent:
            self.headers_sent = True
            conn.send(frame(HEADERS, END_HEADERS, self._stream, _RESPONSE_HEADERS))
        await conn.send_data(self._stream, data)

    async def abort(self, code: Any, details: str = "") -> None:
        raise Abort(code.value[0] if hasattr(code, "value") else int(code), details)


class _Stream:
    __slots__ = ("blocked", "body", "headers", "task", "window")

    def __init__(self, window: int) -> None:
        self.headers: list[tuple[str, str]] | None = None
        self.body: list[bytes] = []
        self.window = window
        self.task: asyncio.Task[None] | None = None
        self.blocked: asyncio.Future[None] | None = None


class Connection(asyncio.Protocol):
    def __init__(self, methods: dict[str, tuple[str, Any, Handler]]) -> None:
        self.methods = methods
        self.loop = asyncio.get_running_loop()
        self.buffer = b""
        self.started = False
        self.decoder = Decoder()
        self.generation = 0
        self.remembered: dict[bytes, tuple[int, list[tuple[str, str]]]] = {}
        self.streams: dict[int, _Stream] = {}
        self.window = DEFAULT_WINDOW
        self.initial_window = DEFAULT_WINDOW
        self.max_frame = 16_384
        self.received = 0
        self.pending: list[bytes] = []
        self.flush_scheduled = False
        self.in_read = False
        self.header_block: tuple[int, int, list[bytes]] | None = None  # stream, flags, pieces
        self.closing = False

    # -- writes ---------------------------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport: asyncio.Transport = transport  # type: ignore[assignment]
        settings = struct.pack(">HIHI", 0x3, 1024, 0x4, RECEIVE_WINDOW)  # max streams, initial window
        transport.write(frame(SETTINGS, 0, 0, settings)  # type: ignore[attr-defined]
                        + frame(WINDOW_UPDATE, 0, 0, (RECEIVE_WINDOW - DEFAULT_WINDOW).to_bytes(4, "big")))

    def send(self, data: bytes) -> None:
        self.pending.append(data)
        if not self.in_read and not self.flush_scheduled:
            self.flush_scheduled = True
            self.loop.call_soon(self.flush)

    def flush(self) -> None:
        self.flush_scheduled = False
        if self.pending and not self.transport.is_closing():
            self.transport.write(b"".join(self.pending))
        self.pending.clear()

    async def send_data(self, stream_id: int, data: bytes, end: bool = False) -> None:
        stream = self.streams.get(stream_id)
        while data:
            if stream is None or self.transport.is_closing():
                raise asyncio.CancelledError()
            n = min(len(data), self.window, stream.window, self.max_frame)
            if n <= 0:
                stream.blocked = self.loop.create_future()
                await stream.blocked
                continue
            self.window -= n
            stream.window -= n
            self.send(frame(DATA, 0, stream_id, data[:n]))
            data = data[n:]

    # -- reads ----------------------------------------------------------------------------------
    def data_received(self, data: bytes) -> None:
        buf = self.buffer + data if self.buffer else data
        pos = 0
        if not self.started:
            if len(buf) < len(PREFACE):
                self.buffer = buf
                return
            if not buf.startswith(PREFACE):
                self.transport.close()
                return
            pos, self.started = len(PREFACE), True
        self.in_read = True
        end = len(buf)
        try:
            while end - pos >= 9:
                length = (buf[pos] << 16) | (buf[pos + 1] << 8) | buf[pos + 2]
                if end - pos - 9 < length:
                    break
                kind, flags = buf[pos + 3], buf[pos + 4]
                stream_id = int.from_bytes(buf[pos + 5:pos + 9], "big") & 0x7FFFFFFF
                payload = buf[pos + 9:pos + 9 + length]
                pos += 9 + length
                self.on_frame(kind, flags, stream_id, payload)
            self.buffer = buf[pos:]
            if self.received:
                update = self.received.to_bytes(4, "big")
                self.pending.append(frame(WINDOW_UPDATE, 0, 0, update))
                self.received = 0
        finally:
            self.in_read = False
        self.flush()

    def on_frame(self, kind: int, flags: int, stream_id: int, payload: bytes) -> None:
        if kind == DATA:
            self.received += len(payload)
            stream = self.streams.get(stream_id)
            if flags & PADDED:
                payload = payload[1:len(payload) - payload[0]]
            if stream is not None and stream.task is None:
                stream.body.append(payload)
                if not flags & END_STREAM:
                    self.pending.append(frame(WINDOW_UPDATE, 0, stream_id, len(payload).to_bytes(4, "big")))
                else:
                    self.start_call(stream_id, stream)
        elif kind == HEADERS:
            if flags & PADDED:
                payload = payload[1:len(payload) - payload[0]]
            if flags & PRIORITY_FLAG:
                payload = payload[5:]
            if flags & END_HEADERS:
                self.on_headers(stream_id, flags, payload)
            else:
                self.header_block = (stream_id, flags, [payload])
        elif kind == CONTINUATION:
            assert self.header_block is not None and self.header_block[0] == stream_id
            self.header_block[2].append(payload)
            if flags & END_HEADERS:
                first_flags, pieces = self.header_block[1], self.header_block[2]
                self.header_block = None
                self.on_headers(stream_id, first_flags, b"".join(pieces))
        elif kind == SETTINGS:
            if not flags & ACK:
                for i in range(0, len(payload) - 5, 6):
                    key, value = struct.unpack_from(">HI", payload, i)
                    if key == 0x4:
                        delta = value - self.initial_window
                        self.initial_window = value
                        for stream in self.streams.values():
                            stream.window += delta
                        self.unblock()
                    elif key == 0x5:
                        self.max_frame = value
                self.pending.append(frame(SETTINGS, ACK, 0))
        elif kind == WINDOW_UPDATE:
            increment = int.from_bytes(payload[:4], "big") & 0x7FFFFFFF
            if stream_id == 0:
                self.window += increment
            elif (stream := self.streams.get(stream_id)) is not None:
                stream.window += increment
            self.unblock()
        elif kind == PING:
            if not flags & ACK:
                self.pending.append(frame(PING, ACK, 0, payload))
        elif kind == RST_STREAM:
            stream = self.streams.pop(stream_id, None)
            if stream is not None and stream.task is not None:
                stream.task.cancel()
        elif kind == GOAWAY:
            self.closing = True
            if not self.streams:
                self.transport.close()

    def unblock(self) -> None:
        for stream in self.streams.values():
            waiter = stream.blocked
            if waiter is not None and not waiter.done():
                stream.blocked = None
                waiter.set_result(None)

    def on_headers(self, stream_id: int, flags: int, block: bytes) -> None:
        known = self.remembered.get(block)
        if known is not None and known[0] == self.generation:
            headers = known[1]
        else:
            table = self.decoder.header_table.dynamic_entries
            before = (len(table), id(table[0]) if table else 0)
            headers = [(str(name), str(value)) for name, value in self.decoder.decode(block)]
            if (len(table), id(table[0]) if table else 0) != before:
                self.generation += 1
            elif len(self.remembered) < 1024:
                self.remembered[block] = (self.generation, headers)
        stream = self.streams.get(stream_id)
        if stream is None:  # the request's headers
            stream = self.streams[stream_id] = _Stream(self.initial_window)
            stream.headers = headers
            if flags & END_STREAM:
                self.start_call(stream_id, stream)

    # -- calls ----------------------------------------------------------------------------------
    def start_call(self, stream_id: int, stream: _Stream) -> None:
        stream.task = self.loop.create_task(self.call(stream_id, stream))

    async def call(self, stream_id: int, stream: _Stream) -> None:
        path, deadline, metadata = "", None, []
        for name, value in stream.headers or ():
            if name == ":path":
                path = value
            elif name == "grpc-timeout":
                deadline = time.monotonic() + int(value[:-1]) * _TIMEOUT_UNITS[value[-1]]
            elif name[0] != ":" and name not in ("content-type", "te", "grpc-accept-encoding", "user-agent"):
                metadata.append((name, value))
        context = Context(self, stream_id, metadata, deadline)
        code, details = 0, ""
        try:
            method = self.methods.get(path)
            if method is None:
                raise Abort(12, f"Method not found: {path}")
            kind, request_type, handler = method
            body = b"".join(stream.body)
            if len(body) < 5 or body[0] != 0 or int.from_bytes(body[1:5], "big") != len(body) - 5:
                raise Abort(13, "the request is not one uncompressed message")
            if len(body) > MAX_MESSAGE:
                raise Abort(8, "the request message is too large")
            request = request_type.FromString(body[5:])
            if kind == UNARY_UNARY:
                await context.write(await handler(request, context))
            else:
                await handler(request, context)
        except Abort as exc:
            code, details = exc.code, exc.details
        except asyncio.CancelledError:
            self.streams.pop(stream_id, None)
            return
        except Exception as exc:  # the server answers INTERNAL and serves on
            code, details = 13, f"{type(exc).__name__}"
        if self.streams.pop(stream_id, None) is None:
            return
        if context.headers_sent:
            self.send(frame(HEADERS, END_HEADERS | END_STREAM, stream_id, trailers(code, details)))
        else:  # trailers only
            self.send(frame(HEADERS, END_HEADERS | END_STREAM, stream_id, _RESPONSE_HEADERS + trailers(code, details)))
        if self.closing and not self.streams:
            self.loop.call_soon(self.transport.close)


async def start(methods: dict[str, tuple[str, Any, Handler]], host: str, port: int) -> asyncio.Server:
    loop = asyncio.get_running_loop()
    return await loop.create_server(lambda: Connection(methods), host, port, reuse_address=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--port", type=int, required=True)
    args = parser.parse_args()

    from pdrouter.wire.v1 import router_pb2

    async def generate(request: router_pb2.GenerateRequest, context: Context) -> None:
        await context.write(router_pb2.GenerateResponse(token_ids=list(range(request.sampling.max_tokens))))

    async def serve() -> None:
        server = await start({"/pdrouter.v1.Router/Generate": (UNARY_STREAM, router_pb2.GenerateRequest, generate)},
                             "127.0.0.1", args.port)
        stop = asyncio.Event()
        for sig in (signal.SIGTERM, signal.SIGINT):
            asyncio.get_running_loop().add_signal_handler(sig, stop.set)
        await stop.wait()
        server.close()

    with contextlib.suppress(KeyboardInterrupt), asyncio.Runner(loop_factory=event_loop_factory()) as runner:
        runner.run(serve())


if __name__ == "__main__":
    main()
