"""The lane's frames and vocabulary, shared by both ends: the greeting, the header, the frame kinds,
the method table, the token proof, the frame parser and the corked writer.

Wire format (version 3), over TCP or, when both ends are given an ``ssl`` context, inside TLS.

Greeting. The client opens with ``HELLO`` = ``b"PDRL"`` + version (u8) + 3 zero bytes, and its
challenge: an ``AUTH`` frame (stream 0) whose body is a random ``NONCE_SIZE``-byte nonce. The server
answers 8 bytes: ``b"PDRL"`` + its version + flags (u8) + 2 zero bytes; when the client's version is
not its own it answers its ``HELLO`` and closes. Flag ``AUTH_REQUIRED`` (bit 0) says the server
holds the token; then both prove it, the server first, and each proof is bound to the server's
*identity*, the address it answers as (``host:port``, as registered), so that neither can be relayed:

1. server → client, right after its greeting: ``AUTH`` (stream 0), body = its own random nonce,
   :func:`server_proof` (HMAC-SHA256 over a label, both nonces and the identity) and the identity
   (UTF-8). The client checks that the identity is the address it dialled and the proof, and
   otherwise closes having sent nothing more: a server without the token, or one that has it but
   answers as another address (a relay behind a registry record that names it), is never sent a
   call or a proof;
2. client → server: ``AUTH`` (stream 0), body = :func:`client_proof` (the same, another label);
3. server → client: ``AUTH`` (stream 0, empty body) when the proof matches (compared in constant
   time); else ``END`` (stream 0, UNAUTHENTICATED) and the connection closes. A frame other than the
   proof is refused the same way. The client sends its calls after the acceptance.

A server without the token ignores the client's challenge and serves at once; a client that holds
the token refuses such a server unless TLS proved it (a certificate from the cluster's CA).

A server refusing a connection outright (too many open) sends a plain greeting and, at once, an
``END`` on stream 0 saying why.

Frames, each a 16-byte header ``!IIBBHI`` (body length, stream id, kind, arg, reserved, timeout ms)
and a body:

* ``CALL`` (client → server): ``arg`` = method id, ``timeout`` = deadline in ms (0: none), body =
  the serialized request;
* ``MESSAGE`` (server → client): one response of a streaming method;
* ``END`` (server → client): ``arg`` = status code; body = the response of a unary method when
  OK, the status details (UTF-8) otherwise. The stream is over. On stream 0 it ends the
  connection: the server says why it closes it (a refused proof, too many connections, the
  handshake or a frame past its deadline), and the client fails every open call with that status;
* ``CANCEL`` (client → server): the caller gave up; the server cancels the handler;
* ``AUTH`` (stream 0, both ways): the challenge, the proof and the acceptance above;
* ``META`` (client → server, optional): the call's metadata, sent on its stream just before its
  ``CALL`` (today the W3C trace context: ``traceparent``, ``tracestate``), one ``name:value`` a line
  (:func:`encode_metadata`), at most ``MAX_META_BYTES``. A server keeps only the last one and gives it
  to the ``CALL`` that follows on the same stream; a server that predates it ignores the frame, so
  a client sends it whatever the server's version.

The server's ``LaneLimits`` (``pdrouter.wire.lane.limits``) bound a connection's handshake time,
the time a begun frame may take, its buffered bytes (so the frame size) and the connections open.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import cast

from google.protobuf.message import Message
from mypy_extensions import mypyc_attr

from pdrouter.wire.v1 import common_pb2, worker_pb2

VERSION = 3
MAGIC = b"PDRL"
HELLO = MAGIC + bytes([VERSION, 0, 0, 0])
"""The client's greeting, and the server's answer when it asks for no proof."""
AUTH_REQUIRED = 0x01
"""Flag (byte 5) of the server's greeting: prove the token (an ``AUTH`` challenge follows)."""
HELLO_AUTH = MAGIC + bytes([VERSION, AUTH_REQUIRED, 0, 0])
"""The server's greeting when it holds a token."""
HEADER = struct.Struct("!IIBBHI")
MAX_BODY = 64 * 1024 * 1024
"""Largest frame body accepted (the gRPC channels' message limit)."""
CALL, MESSAGE, END, CANCEL, AUTH, META = 1, 2, 3, 4, 5, 6
MAX_META_BYTES = 4096
"""The largest ``META`` body a server reads (a larger one is ignored)."""
NONCE_SIZE = 32
PROOF_SIZE = 32
MAX_IDENTITY_BYTES = 512
"""The longest identity (``host:port``) a server's proof may carry."""
SERVER_PROOF_LABEL = b"pdrouter lane v3: the worker proves the internal token\x00"
CLIENT_PROOF_LABEL = b"pdrouter lane v3: the client proves the internal token\x00"
"""Bound into the proofs, so that each answers this handshake of this protocol, in this direction."""


def _proof(label: bytes, token: bytes, client_nonce: bytes, server_nonce: bytes, identity: str) -> bytes:
    return hmac.new(token, label + client_nonce + server_nonce + identity.encode(), hashlib.sha256).digest()


def server_proof(token: bytes, client_nonce: bytes, server_nonce: bytes, identity: str) -> bytes:
    """The server's proof of the token, as the server answering at ``identity``."""
    return _proof(SERVER_PROOF_LABEL, token, client_nonce, server_nonce, identity)


def client_proof(token: bytes, client_nonce: bytes, server_nonce: bytes, identity: str) -> bytes:
    """The client's proof of the token, to the server answering at ``identity``."""
    return _proof(CLIENT_PROOF_LABEL, token, client_nonce, server_nonce, identity)


Metadata = tuple[tuple[str, str], ...]


def encode_metadata(metadata: Sequence[tuple[str, str]]) -> bytes:
    """A ``META`` body: one ``name:value`` a line; names are lower-case tokens, values printable ASCII.
    ValueError for anything else (nothing a caller gets from a client goes here unchecked)."""
    lines = []
    for name, value in metadata:
        if not name or not name.isascii() or not name.islower() or ":" in name or not name.isprintable() \
                or not value.isascii() or not value.isprintable():
            raise ValueError(f"lane metadata must be lower-case ASCII names and printable ASCII values: {name!r}")
        lines.append(f"{name}:{value}")
    body = "\n".join(lines).encode("ascii")
    if len(body) > MAX_META_BYTES:
        raise ValueError(f"lane metadata of {len(body)} bytes is over {MAX_META_BYTES}")
    return body


def decode_metadata(body: bytes) -> Metadata:
    """The pairs of a ``META`` body (empty for one that is too large or not ASCII)."""
    if len(body) > MAX_META_BYTES or not body.isascii():
        return ()
    pairs = []
    for line in body.decode("ascii").split("\n"):
        name, sep, value = line.partition(":")
        if sep:
            pairs.append((name, value))
    return tuple(pairs)


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

    def __init__(self, max_body: int = MAX_BODY) -> None:
        self._buf = bytearray()
        self.max_body = max_body
        """The largest body accepted: a header announcing more raises ``ValueError`` before it is buffered."""

    def feed(self, data: bytes | bytearray) -> list[tuple[int, int, int, int, bytes]]:
        """Append ``data``; the complete frames so far as (stream, kind, arg, timeout_ms, body).

        With nothing held from earlier reads (a read of whole frames, the usual case) the bodies are
        cut from ``data`` itself, one copy each, and only a trailing partial frame is kept; else
        from the buffer, through a view (a bytearray's slice would be a second copy).
        """
        buf = self._buf
        held = bool(buf)
        if held:
            buf += data
        source = buf if held else data
        view = None if type(source) is bytes else memoryview(source)
        frames = []
        pos, size = 0, len(source)
        try:
            while size - pos >= HEADER.size:
                length, stream, kind, arg, _, timeout_ms = HEADER.unpack_from(source, pos)
                if length > self.max_body:
                    if view is not None:
                        view.release()
                    del buf[:]
                    raise ValueError(f"lane frame of {length} bytes exceeds the {self.max_body}-byte limit")
                end = pos + HEADER.size + length
                if end > size:
                    break
                body = cast(bytes, data)[pos + HEADER.size:end] if view is None else bytes(view[pos + HEADER.size:end])
                frames.append((stream, kind, arg, timeout_ms, body))
                pos = end
        finally:
            if view is not None:
                view.release()
        if held:
            if pos:
                del buf[:pos]
        elif pos < size:
            buf += data[pos:] if pos else data
        return frames


def _frame(stream: int, kind: int, arg: int = 0, body: bytes = b"", timeout_ms: int = 0) -> bytes:
    return HEADER.pack(len(body), stream, kind, arg, 0, timeout_ms) + body


@mypyc_attr(allow_interpreted_subclasses=True)  # the server's connection (server.py) subclasses it
class _Corked(asyncio.Protocol):
    """Frames written during one event-loop iteration leave in one ``send``: under load many calls
    share a system call (on loopback a send costs as much as the rest of a call)."""

    transport: asyncio.Transport | None

    def __init__(self) -> None:
        self.transport = None
        self._out: list[bytes] = []
        self.loop = asyncio.get_running_loop()  # the connection's: its calls' futures and timers use it

    def _send(self, data: bytes) -> None:
        if not self._out:
            self.loop.call_soon(self._flush)
        self._out.append(data)

    def _flush(self) -> None:
        out, self._out = self._out, []
        if out and self.transport is not None and not self.transport.is_closing():
            self.transport.write(out[0] if len(out) == 1 else b"".join(out))
