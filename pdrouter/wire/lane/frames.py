"""The lane's frames and vocabulary, shared by both ends: the greeting, the header, the frame kinds,
the method table, the frame parser and the corked writer.

Wire format (version 1). The client opens with ``HELLO`` = ``b"PDRL"`` + version (u8) + 3 zero
bytes; the server answers the same 8 bytes with its version, or closes. Then frames, each a
16-byte header ``!IIBBHI`` (body length, stream id, kind, arg, reserved, timeout ms) and a body:

* ``CALL`` (client → server): ``arg`` = method id, ``timeout`` = deadline in ms (0: none), body =
  the serialized request;
* ``MESSAGE`` (server → client): one response of a streaming method;
* ``END`` (server → client): ``arg`` = status code; body = the response of a unary method when
  OK, the status details (UTF-8) otherwise. The stream is over;
* ``CANCEL`` (client → server): the caller gave up; the server cancels the handler.
"""

from __future__ import annotations

import asyncio
import struct
from dataclasses import dataclass

from google.protobuf.message import Message

from pdrouter.wire.v1 import common_pb2, worker_pb2

VERSION = 1
MAGIC = b"PDRL"
HELLO = MAGIC + bytes([VERSION, 0, 0, 0])
HEADER = struct.Struct("!IIBBHI")
MAX_BODY = 64 * 1024 * 1024
"""Largest frame body accepted (the gRPC channels' message limit)."""
CALL, MESSAGE, END, CANCEL = 1, 2, 3, 4


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
