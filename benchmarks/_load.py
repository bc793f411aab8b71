"""Load-generator pieces the router benchmarks share: front-door clients and a process's CPU time."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc

from pdrouter.wire.grpc_util import CHANNEL_OPTIONS
from pdrouter.wire.h2_grpc import PREFACE, HeaderDecoder, frame, literal
from pdrouter.wire.v1 import common_pb2, router_pb2, router_pb2_grpc


def cpu_times(pid: int) -> tuple[float, float]:
    """User and system CPU seconds of process ``pid`` (all its threads) so far (clock ticks: 10 ms)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    tick = os.sysconf("SC_CLK_TCK")
    return int(fields[11]) / tick, int(fields[12]) / tick


def cpu_seconds(pid: int) -> float:
    """CPU seconds of process ``pid`` (all its threads, those gone included) so far, to the nanosecond.

    Reads the process's CPU-time clock (Linux: ``clock_getcpuclockid`` is ``~pid << 3 | 2``, the
    scheduler's clock); ``/proc/<pid>/stat`` counts in 10 ms ticks, coarse next to the ~250 µs
    per request measured over a few hundred milliseconds. Elsewhere, the ticks.
    """
    try:
        return time.clock_gettime(((~pid) << 3) | 2)
    except (OSError, OverflowError, AttributeError):
        return sum(cpu_times(pid))


class HttpCompletions:
    """``POST /v1/completions`` over one keep-alive connection per slot (a minimal HTTP/1.1 client).

    Minimal on purpose: the load generator's own CPU stays small next to the server's. ``prompts``,
    when given, gives each request's prompt (text or ids) in place of ``ids``, e.g. shared prefixes
    with unique suffixes.
    """

    def __init__(self, host: str, port: int, model: str, ids: list[int], max_tokens: int, stream: bool,
                 prompts: Iterator[str | list[int]] | None = None,
                 connections: dict[int, tuple[asyncio.StreamReader, asyncio.StreamWriter]] | None = None) -> None:
        """``connections``: the slots' connections, to share with other clients of the same server."""
        self._host, self._port = host, port
        self._fields = {"model": model, "prompt": ids, "max_tokens": max_tokens, "temperature": 0,
                        "ignore_eos": True, "stream": stream}
        self._prompts = prompts
        self._request = self._encode(ids)
        self._conns = connections if connections is not None else {}
        self.events = 0
        """Chunks of streamed bodies received so far (each one a write of the server's)."""

    def _encode(self, prompt: str | list[int]) -> bytes:
        body = json.dumps({**self._fields, "prompt": prompt}).encode()
        return (f"POST /v1/completions HTTP/1.1\r\nhost: {self._host}:{self._port}\r\n"
                f"content-type: application/json\r\ncontent-length: {len(body)}\r\n\r\n").encode() + body

    async def once(self, slot: int) -> tuple[float, float]:
        """One request on connection ``slot``: (seconds to the last byte, seconds to the first token)."""
        conn = self._conns.get(slot)
        if conn is None or conn[0].at_eof():  # new, or closed by the server's keep-alive timeout
            conn = self._conns[slot] = await asyncio.open_connection(self._host, self._port)
        reader, writer = conn
        request = self._request if self._prompts is None else self._encode(next(self._prompts))
        start = time.perf_counter()
        writer.write(request)
        head = await reader.readuntil(b"\r\n\r\n")
        first = time.perf_counter() - start
        if not head.startswith(b"HTTP/1.1 200"):
            raise RuntimeError(f"the front door answered {head!r}")
        headers = head.lower()
        if b"transfer-encoding: chunked" not in headers:
            length = int(headers.split(b"content-length:", 1)[1].split(b"\r\n", 1)[0])
            body = await reader.readexactly(length)
            if b'"finish_reason"' not in body:
                raise RuntimeError(f"unexpected completion {body!r}")
            return time.perf_counter() - start, first
        first, last = 0.0, b""
        while True:
            size = int((await reader.readuntil(b"\r\n")).split(b";", 1)[0], 16)
            if size == 0:
                await reader.readuntil(b"\r\n")
                break
            last = await reader.readexactly(size + 2)
            self.events += 1
            if not first and b"data:" in last:
                first = time.perf_counter() - start
        if b"[DONE]" not in last:
            raise RuntimeError(f"the stream did not end with [DONE]: {last!r}")
        return time.perf_counter() - start, first

    async def close(self) -> None:
        for _, writer in self._conns.values():
            writer.close()
            with contextlib.suppress(OSError):
                await writer.wait_closed()


class RouterGenerate:
    """``pdrouter.v1.Router.Generate`` with the prompt's token ids, on one channel (``texts``, when
    given: each request's prompt text instead)."""

    def __init__(self, address: str, model: str, ids: list[int], max_tokens: int,
                 texts: Iterator[str] | None = None) -> None:
        self._channel = grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS)
        self._stub = router_pb2_grpc.RouterStub(self._channel)
        self._request = router_pb2.GenerateRequest(
            model=model, token_ids=router_pb2.TokenIds(ids=ids),
            sampling=common_pb2.SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))
        self._texts = texts
        self._max_tokens = max_tokens
        self.messages = 0
        """Responses received so far."""

    async def once(self, slot: int) -> tuple[float, float]:
        """One request: (seconds to the stream's end, seconds to its first message)."""
        request = self._request
        if self._texts is not None:
            request = router_pb2.GenerateRequest(model=request.model, text=next(self._texts), sampling=request.sampling)
        start = time.perf_counter()
        first, tokens = 0.0, 0
        async for msg in self._stub.Generate(request):
            if not first:
                first = time.perf_counter() - start
            tokens += len(msg.token_ids)
            self.messages += 1
        if tokens != self._max_tokens:
            raise RuntimeError(f"Generate returned {tokens} tokens, expected {self._max_tokens}")
        return time.perf_counter() - start, first

    async def close(self) -> None:
        await self._channel.close()


class GrpcGenerate:
    """``pdrouter.v1.Router.Generate`` over one HTTP/2 connection shared by every slot: a minimal gRPC
    client, as :class:`HttpCompletions` is a minimal HTTP/1.1 one, so that the load generator's own CPU
    stays small next to the server's (a ``grpc.aio`` channel costs its caller several times what the
    router spends on the call, and at 32 calls at once its queueing shows in the latencies measured).

    It does what a gRPC client owes the server: the HTTP/2 preface and settings, one header block per
    call (literals without indexing, the same bytes every call), the request as one length-prefixed
    message, the server's settings and pings acknowledged, the answer's flow control granted per read;
    the answer's messages are parsed and their tokens counted, and a call ends with its ``grpc-status``
    (anything but OK raises). Same arguments and ``once`` as :class:`RouterGenerate`.
    """

    WINDOW = 1 << 24

    def __init__(self, address: str, model: str, ids: list[int], max_tokens: int,
                 texts: Iterator[str] | None = None) -> None:
        self._host, _, port = address.rpartition(":")
        self._port = int(port)
        self._request = router_pb2.GenerateRequest(
            model=model, token_ids=router_pb2.TokenIds(ids=ids),
            sampling=common_pb2.SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))
        self._texts = texts
        self._max_tokens = max_tokens
        # :method POST and :scheme http are HPACK static entries 3 and 6; :authority 1, :path 4 and
        # content-type 31 name theirs.
        self._headers = (b"\x83\x86" + literal(4, b"/pdrouter.v1.Router/Generate") + literal(1, address.encode())
                         + literal(31, b"application/grpc") + literal(b"te", b"trailers"))
        self._decoder = HeaderDecoder()
        self._lock = asyncio.Lock()
        self._writer: asyncio.StreamWriter | None = None
        self._reader_task: asyncio.Task[None] | None = None
        self._next_stream = 1
        self._calls: dict[int, list[Any]] = {}  # stream → [future, start, first, tokens, buffer, headers seen]
        self.messages = 0
        """Responses received so far."""

    async def _connect(self) -> None:
        reader, writer = await asyncio.open_connection(self._host, self._port)
        settings = b"\x00\x02\x00\x00\x00\x00" + b"\x00\x04" + self.WINDOW.to_bytes(4, "big")  # no push; window
        writer.write(PREFACE + frame(4, 0, 0, settings)
                     + frame(8, 0, 0, (self.WINDOW - 65_535).to_bytes(4, "big")))
        self._writer = writer
        self._reader_task = asyncio.create_task(self._read(reader, writer))

    async def once(self, slot: int) -> tuple[float, float]:
        """One request: (seconds to the stream's end, seconds to its first message)."""
        if self._writer is None or self._writer.is_closing():
            async with self._lock:
                if self._writer is None or self._writer.is_closing():
                    await self._connect()
        writer = self._writer
        assert writer is not None
        request = self._request
        if self._texts is not None:
            request = router_pb2.GenerateRequest(model=request.model, text=next(self._texts), sampling=request.sampling)
        body = request.SerializeToString()
        stream = self._next_stream
        self._next_stream += 2
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        start = time.perf_counter()
        call = self._calls[stream] = [done, start, 0.0, 0, b"", False]
        writer.write(frame(1, 0x4, stream, self._headers)
                     + frame(0, 0x1, stream, b"\x00" + len(body).to_bytes(4, "big") + body))
        await done
        if call[3] != self._max_tokens:
            raise RuntimeError(f"Generate returned {call[3]} tokens, expected {self._max_tokens}")
        return time.perf_counter() - start, call[2]

    def _end(self, stream: int, error: str | None) -> None:
        call = self._calls.pop(stream, None)
        if call is not None and not call[0].done():
            if error is None:
                call[0].set_result(None)
            else:
                call[0].set_exception(RuntimeError(error))

    async def _read(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        buf = b""
        try:
            while data := await self._read_some(reader):
                buf += data
                out: list[bytes] = []
                received = 0
                pos = 0
                while len(buf) - pos >= 9:
                    length = int.from_bytes(buf[pos:pos + 3], "big")
                    if len(buf) - pos - 9 < length:
                        break
                    kind, flags = buf[pos + 3], buf[pos + 4]
                    stream = int.from_bytes(buf[pos + 5:pos + 9], "big") & 0x7FFFFFFF
                    payload = buf[pos + 9:pos + 9 + length]
                    pos += 9 + length
                    if kind == 0:  # DATA: length-prefixed messages
                        received += length
                        call = self._calls.get(stream)
                        if call is not None:
                            chunk = call[4] + payload
                            while len(chunk) >= 5 and len(chunk) - 5 >= (n := int.from_bytes(chunk[1:5], "big")):
                                msg = router_pb2.GenerateResponse.FromString(chunk[5:5 + n])
                                chunk = chunk[5 + n:]
                                if not call[2]:
                                    call[2] = time.perf_counter() - call[1]
                                call[3] += len(msg.token_ids)
                                self.messages += 1
                            call[4] = chunk
                            if length and not flags & 0x1:
                                out.append(frame(8, 0, stream, length.to_bytes(4, "big")))
                    elif kind == 1:  # HEADERS: the answer's, or its trailers
                        if flags & 0x8:
                            payload = payload[1:len(payload) - payload[0]]
                        if not flags & 0x4:
                            raise RuntimeError("the server sent a header block in several frames (unsupported)")
                        headers = dict(self._decoder.decode(payload))
                        if flags & 0x1:
                            status = headers.get("grpc-status", "")
                            error = (f"the call ended {status or headers.get(':status')}: "
                                     f"{headers.get('grpc-message', '')}")
                            self._end(stream, None if status == "0" else error)
                    elif kind == 3:  # RST_STREAM
                        self._end(stream, "the server reset the stream")
                    elif kind == 4 and not flags & 0x1:  # SETTINGS
                        out.append(frame(4, 0x1, 0))
                    elif kind == 6 and not flags & 0x1:  # PING
                        out.append(frame(6, 0x1, 0, payload))
                    elif kind == 7:  # GOAWAY
                        break
                buf = buf[pos:]
                if received:
                    out.append(frame(8, 0, 0, received.to_bytes(4, "big")))
                if out:
                    writer.write(b"".join(out))
        finally:
            writer.close()
            for stream in list(self._calls):
                self._end(stream, "the connection closed")

    @staticmethod
    async def _read_some(reader: asyncio.StreamReader) -> bytes:
        try:
            return await reader.read(1 << 18)
        except ConnectionError:
            return b""

    async def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
        if self._reader_task is not None:
            self._reader_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._reader_task


GRPC_CLIENTS: dict[str, type[GrpcGenerate] | type[RouterGenerate]] = {"minimal": GrpcGenerate, "grpcio": RouterGenerate}
"""The load generators' gRPC clients by the name their ``--grpc-client`` flag takes."""
