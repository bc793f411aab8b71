"""One TCP connection that speaks the wire format: gather-writes, scatter-reads, timeouts."""

from __future__ import annotations

import contextlib
import os
import socket
import struct
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

from pdrouter.transfer import wire
from pdrouter.transfer.errors import PeerLostError

_IOV_MAX = min(os.sysconf("SC_IOV_MAX") if hasattr(os, "sysconf") else 1024, 1024)
_DISCARD_CHUNK = 1 << 20
Buffer = bytes | memoryview


class FramedSocket:
    """A connected TCP socket carrying wire messages.

    Any thread may ``send`` (whole messages are serialized by a lock); one thread reads. Every
    blocking call gives up after ``progress_timeout`` seconds without progress, except the wait for
    the first byte of a message, which may idle for as long as the connection lives. Socket errors
    and end-of-stream surface as ``PeerLostError``.
    """

    def __init__(self, sock: socket.socket, progress_timeout: float, buffer_bytes: int = 0) -> None:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if buffer_bytes:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, buffer_bytes)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, buffer_bytes)
        self._sock = sock
        self.set_timeout(progress_timeout)
        self._send_lock = threading.Lock()
        self._closed = False
        host, port = sock.getpeername()[:2]
        self.peer = f"{host}:{port}"
        self.local_host: str = sock.getsockname()[0]
        self._prefix = bytearray(wire.PREFIX.size)
        self._scratch = bytearray(_DISCARD_CHUNK)

    @classmethod
    def connect(cls, host: str, port: int, connect_timeout: float, progress_timeout: float,
                buffer_bytes: int = 0) -> FramedSocket:
        try:
            sock = socket.create_connection((host, port), timeout=connect_timeout)
        except OSError as exc:
            raise PeerLostError(f"cannot connect to {host}:{port}: {exc}") from exc
        return cls(sock, progress_timeout, buffer_bytes)

    @property
    def closed(self) -> bool:
        return self._closed

    def set_timeout(self, seconds: float) -> None:
        """Give up on any send or receive that makes no progress for ``seconds``.

        The socket stays in blocking mode and the kernel enforces the limit (SO_RCVTIMEO /
        SO_SNDTIMEO): large transfers then cost one system call per buffer, not a poll per chunk.
        """
        self._sock.settimeout(None)
        whole = int(seconds)
        timeval = struct.pack("ll", whole, int((seconds - whole) * 1e6))
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, timeval)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, timeval)

    def send(self, parts: Sequence[Buffer]) -> None:
        """Write ``parts`` back to back as one message (no other message interleaves)."""
        with self.exclusive():
            self._write(parts)

    @contextmanager
    def exclusive(self) -> Iterator[None]:
        """Hold the connection for one message written in several ``write_all`` steps."""
        with self._send_lock:
            yield

    def write_all(self, buf: Buffer) -> None:
        """Write one buffer completely; only inside ``exclusive`` (the hot path of payloads)."""
        try:
            self._sock.sendall(buf)
        except (TimeoutError, BlockingIOError) as exc:
            raise self._lost("the peer accepted nothing within the timeout", exc) from exc
        except OSError as exc:
            raise self._lost("send failed", exc) from exc

    def read_exact_into(self, buffers: list[memoryview]) -> None:
        """Fill ``buffers`` completely with one scatter-read that waits for all of it (the payload
        hot path); falls back to more reads only when the kernel returns early."""
        try:
            if len(buffers) == 1:
                got = self._sock.recv_into(buffers[0], 0, socket.MSG_WAITALL)
            else:
                got = self._sock.recvmsg_into(buffers, 0, socket.MSG_WAITALL)[0]
        except (TimeoutError, BlockingIOError) as exc:
            raise self._lost("no progress within the timeout", exc) from exc
        except OSError as exc:
            raise self._lost("receive failed", exc) from exc
        if got < sum(len(b) for b in buffers):
            if got == 0:
                raise self._lost("connection closed by peer mid-message (truncated stream)")
            rest = list(buffers)
            self.recv_into(rest[_advance(rest, 0, got):])

    def _write(self, parts: Sequence[Buffer]) -> None:
        bufs = [memoryview(p).cast("B") for p in parts if len(p)]
        try:
            i = 0
            while i < len(bufs):
                sent = self._sock.sendmsg(bufs[i:i + _IOV_MAX])
                i = _advance(bufs, i, sent)
        except (TimeoutError, BlockingIOError) as exc:
            raise self._lost("the peer accepted nothing within the timeout", exc) from exc
        except OSError as exc:
            raise self._lost("send failed", exc) from exc

    def recv_header(self, *, idle: bool = True) -> wire.Header:
        """The next message's verified header; with ``idle`` it waits as long as it takes to start."""
        view = memoryview(self._prefix)
        got = 0
        while got == 0:
            try:
                got = self._sock.recv_into(view)
            except (TimeoutError, BlockingIOError) as exc:
                if idle and not self._closed:
                    continue  # an idle connection; close() wakes this with end-of-stream
                raise self._lost("no message within the timeout", exc) from exc
            except OSError as exc:
                raise self._lost("receive failed", exc) from exc
            if got == 0:
                raise self._lost("connection closed by peer")
        self.recv_into([view[got:]])
        raw = bytes(self._prefix)
        body_len = wire.parse_prefix(raw)[2]
        body = bytearray(body_len)
        self.recv_into([memoryview(body)])
        return wire.verify(raw, bytes(body))

    def recv_into(self, buffers: Sequence[memoryview]) -> None:
        """Fill every buffer completely, in order (one scatter-read per batch when possible)."""
        bufs = [b for b in buffers if len(b)]
        i = 0
        try:
            while i < len(bufs):
                received = self._sock.recvmsg_into(bufs[i:i + _IOV_MAX])[0]
                if received == 0:
                    raise self._lost("connection closed by peer mid-message (truncated stream)")
                i = _advance(bufs, i, received)
        except (TimeoutError, BlockingIOError) as exc:
            raise self._lost("no progress within the timeout", exc) from exc
        except OSError as exc:
            raise self._lost("receive failed", exc) from exc

    def has_data(self) -> bool:
        """Whether bytes (or end-of-stream) are waiting to be read right now."""
        try:
            self._sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT)
        except BlockingIOError:
            return False
        except OSError:
            return True  # let the next read report the problem
        return True

    def discard(self, nbytes: int) -> None:
        """Read and drop ``nbytes`` (a payload nobody may write anywhere)."""
        scratch = memoryview(self._scratch)
        while nbytes > 0:
            n = min(nbytes, len(scratch))
            self.recv_into([scratch[:n]])
            nbytes -= n

    def close(self) -> None:
        """Shut the connection down (wakes a blocked reader) and release the socket."""
        if self._closed:
            return
        self._closed = True
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)
        self._sock.close()

    def _lost(self, what: str, exc: BaseException | None = None) -> PeerLostError:
        detail = f": {exc}" if exc is not None and str(exc) else ""
        return PeerLostError(f"connection to {self.peer}: {what}{detail}")


def _advance(bufs: list[memoryview], i: int, nbytes: int) -> int:
    """Consume ``nbytes`` from ``bufs[i:]`` in place; the index of the first unfinished buffer."""
    while nbytes > 0:
        length = len(bufs[i])
        if nbytes >= length:
            nbytes -= length
            i += 1
        else:
            bufs[i] = bufs[i][nbytes:]
            nbytes = 0
    return i
