"""One TCP connection that speaks the wire format: MACs, deadlines, gather-writes, scatter-reads, TLS."""

from __future__ import annotations

import contextlib
import math
import os
import socket
import ssl
import struct
import threading
import time
from collections.abc import Sequence
from typing import NamedTuple, TypeVar

from pdrouter.transfer import frames
from pdrouter.transfer.errors import PeerLostError, ProtocolError
from pdrouter.transfer.integrity import MacKey, PayloadMac
from pdrouter.transfer.tls_channel import TlsSession

_IOV_MAX = min(os.sysconf("SC_IOV_MAX") if hasattr(os, "sysconf") else 1024, 1024)
_READ_AHEAD_BYTES = 64 << 10
"""Reads smaller than this go through the read-ahead buffer (see ``FramedSocket._sys_recv``)."""
_DISCARD_CHUNK = 1 << 20
_TLS_READ_BYTES = 256 << 10
_QUANTUM_S = 0.25
Buffer = bytes | memoryview
"""What is written: bytes, or a flat memoryview of bytes (format ``B``)."""


class Sealed(NamedTuple):
    """A message just written: its number in this direction and its tag (what its payload MAC binds)."""

    seq: int
    tag: bytes


class FramedSocket:
    """A connected TCP socket carrying wire messages, optionally inside TLS.

    Any thread may ``send`` (whole messages are serialized by a lock, which also numbers them);
    one thread reads. Limits on every blocking call:

    - progress: a send or receive that makes no progress for ``progress_timeout`` seconds fails,
      except the wait for the first byte of a message, which may idle as long as the connection lives;
    - a message's deadline: once its first byte arrived, the whole message (prefix, body and a
      payload on this socket) must arrive within ``max(message_timeout, size / min_rate)``,
      however the bytes trickle;
    - ``set_deadline``: one deadline for everything (the handshake), idling included.

    Before ``install_keys`` messages carry an xxh3 tag and bodies are limited by ``max_body``; after
    it every message's tag is its MAC under the direction's key and number. Socket errors,
    end-of-stream and missed deadlines surface as ``PeerLostError``.
    """

    def __init__(self, sock: socket.socket, progress_timeout: float, buffer_bytes: int = 0, *,
                 message_timeout: float = 10.0, min_bytes_per_s: float = 1e6, congestion: str | None = None) -> None:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if congestion:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_CONGESTION, congestion.encode())
        if buffer_bytes:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, buffer_bytes)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, buffer_bytes)
        sock.settimeout(None)  # blocking; the kernel enforces the limits (SO_RCVTIMEO / SO_SNDTIMEO)
        self._sock = sock
        self._progress = progress_timeout
        self._message_timeout = message_timeout
        self._min_rate = min_bytes_per_s
        self._armed: dict[int, float] = {}
        self._deadline: float | None = None
        self._deadline_what = ""
        self._msg_deadline: float | None = None
        self._send_lock = threading.Lock()
        self._closed = False
        self._tls: TlsSession | None = None
        self._tls_buf = bytearray()
        self._send_key: MacKey | None = None
        self._recv_key: MacKey | None = None
        self._send_seq = 0
        self._recv_seq = 0
        host, port = sock.getpeername()[:2]
        self.peer = f"{host}:{port}"
        self.local_host: str = sock.getsockname()[0]
        self._prefix = bytearray(frames.PREFIX.size)
        self._scratch = bytearray(_DISCARD_CHUNK)
        self._ahead = bytearray(_READ_AHEAD_BYTES)
        self._pending = memoryview(b"")
        """Bytes read ahead of the reader (plaintext only): served before the socket is read again."""

    @classmethod
    def connect(cls, host: str, port: int, connect_timeout: float, progress_timeout: float,
                buffer_bytes: int = 0, congestion: str | None = None, **limits: float) -> FramedSocket:
        try:
            sock = socket.create_connection((host, port), timeout=connect_timeout)
        except OSError as exc:
            raise PeerLostError(f"cannot connect to {host}:{port}: {exc}") from exc
        try:
            return cls(sock, progress_timeout, buffer_bytes, congestion=congestion, **limits)
        except OSError as exc:
            sock.close()
            raise PeerLostError(f"connection to {host}:{port} failed: {exc}") from exc

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def congestion_control(self) -> str:
        """The connection's TCP congestion control, as the kernel reports it."""
        name = self._sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_CONGESTION, 16)
        return name.split(b"\0", 1)[0].decode()

    @property
    def authenticated(self) -> bool:
        """Whether messages carry MACs (the handshake installed the keys)."""
        return self._recv_key is not None

    @property
    def tls(self) -> bool:
        return self._tls is not None

    # -- limits ---------------------------------------------------------------------------------
    def set_timeout(self, seconds: float) -> None:
        """Give up on any send or receive that makes no progress for ``seconds``."""
        self._progress = seconds

    def set_deadline(self, seconds: float | None, what: str = "the handshake") -> None:
        """Everything (sends, receives, idle waits) must be done within ``seconds`` from now; None lifts it."""
        self._deadline = None if seconds is None else time.monotonic() + seconds
        self._deadline_what = what

    def _arm(self, option: int, *, message: bool) -> None:
        """Set the kernel's timeout for the next call: the progress timeout, cut to what is left of
        the deadlines (``message``: the current message's too); PeerLostError once one has passed.

        A cut timeout is rounded up to a multiple of ``_QUANTUM_S`` (a deadline may be overshot by
        that much): a system call costs microseconds, so the timeout is changed at most a few
        times a second, and never while deadlines are further away than the progress timeout.
        """
        limit = self._progress
        now = time.monotonic()
        if self._deadline is not None:
            if self._deadline <= now:
                raise self._expired(False)
            limit = min(limit, self._deadline - now)
        if message and self._msg_deadline is not None:
            if self._msg_deadline <= now:
                raise self._expired(True)
            limit = min(limit, self._msg_deadline - now)
        if limit < self._progress:
            limit = min(self._progress, math.ceil(limit / _QUANTUM_S) * _QUANTUM_S)
        if self._armed.get(option) != limit:
            whole = int(limit)
            self._sock.setsockopt(socket.SOL_SOCKET, option, struct.pack("ll", whole, int((limit - whole) * 1e6)))
            self._armed[option] = limit

    def _expired(self, message: bool) -> PeerLostError:
        if message:
            return self._lost("a message did not arrive within its deadline (the peer is too slow or trickling)")
        return self._lost(f"{self._deadline_what} did not finish within its deadline")

    def _timed_out(self, exc: BaseException, what: str, *, message: bool) -> PeerLostError:
        now = time.monotonic()
        if self._deadline is not None and now >= self._deadline:
            return self._expired(False)
        if message and self._msg_deadline is not None and now >= self._msg_deadline:
            return self._expired(True)
        return self._lost(what, exc)

    # -- keys and TLS -----------------------------------------------------------------------------
    def install_keys(self, send_key: bytes, recv_key: bytes) -> None:
        """From now on every message sent is MAC'd with ``send_key`` and every message received must
        verify under ``recv_key``, both numbered from 0 (call with no message in flight)."""
        with self._send_lock:
            self._send_key, self._send_seq = MacKey(send_key), 0
        self._recv_key, self._recv_seq = MacKey(recv_key), 0

    def start_tls(self, ctx: ssl.SSLContext, *, server_side: bool, server_hostname: str | None = None) -> None:
        """Run the TLS handshake (within the current deadline); everything after travels inside TLS."""
        if self._pending:
            raise ProtocolError(f"{self.peer} sent bytes before TLS started")
        session = TlsSession(ctx, server_side=server_side, server_hostname=server_hostname)
        try:
            while not session.handshake_step():
                self._send_raw([session.output()])
                self._feed_tls(session)
        except Exception:
            with contextlib.suppress(PeerLostError, OSError):
                self._send_raw([session.output()])  # the alert telling the peer why
            raise
        self._send_raw([session.output()])
        self._tls = session

    def _feed_tls(self, session: TlsSession) -> None:
        """Read whatever ciphertext arrives (at least one byte) into ``session``."""
        if len(self._tls_buf) < _TLS_READ_BYTES:
            self._tls_buf = bytearray(_TLS_READ_BYTES)
        view = memoryview(self._tls_buf)
        got = self._sys_recv([view], waitall=False, message=True)
        if got == 0:
            raise self._lost("connection closed by peer")
        session.feed(view[:got])

    # -- writing ----------------------------------------------------------------------------------
    def send(self, message: bytes) -> None:
        """Seal and write one whole ``frames.encode``d message (no other message interleaves)."""
        with self._send_lock:
            self.write_header(message)

    def send_many(self, messages: Sequence[bytes]) -> None:
        """``send`` each message, in order, in as few system calls as the kernel takes."""
        with self._send_lock:
            parts: list[Buffer] = []
            for message in messages:
                parts += self.seal(message)[0]
            self._write(parts)

    def exclusive(self) -> threading.Lock:
        """Hold the connection (``with``) for one message written in several steps (a header, its
        payload, its MAC): the send lock itself."""
        return self._send_lock

    def write_header(self, message: bytes) -> Sealed:
        """Seal and write ``message`` (prefix and body); only inside ``exclusive`` (or ``send``)."""
        parts, sealed = self.seal(message)
        self._write(parts)
        return sealed

    def seal(self, message: bytes) -> tuple[list[Buffer], Sealed]:
        """Seal ``message`` as the next one of this direction without writing it: the parts to write
        next, in order, before any other message (only inside ``exclusive``), and its seal."""
        key = self._send_key
        if key is None:
            prefix, tag = frames.seal(message, frames.plain_tag)
            seq = -1
        else:
            seq = self._send_seq
            self._send_seq += 1
            tag = key.header_tag(seq, message)  # frames.seal, without a closure per message
            prefix = message[:frames.TAG_OFFSET] + tag
        return [prefix, memoryview(message)[frames.PREFIX.size:]], Sealed(seq, tag)

    def prepare_send_payload_mac(self) -> None:
        """Make ahead of time the running MAC context of the next message's payload (``MacKey.prepare``),
        for a sender that knows a large one comes next; only inside ``exclusive``."""
        if self._send_key is not None:
            self._send_key.prepare(self._send_seq)

    def send_payload_mac(self, sealed: Sealed) -> PayloadMac:
        """The MAC of the payload following the message ``sealed`` (after the handshake only)."""
        if self._send_key is None:
            raise ProtocolError("a payload before the handshake")
        return self._send_key.payload_mac(sealed.seq, sealed.tag)

    def write_all(self, buf: Buffer) -> None:
        """Write one buffer completely; only inside ``exclusive`` (the hot path of payloads)."""
        if self._tls is not None:
            self._write([buf])
            return
        try:
            self._arm(socket.SO_SNDTIMEO, message=False)
            self._sock.sendall(buf)
        except (TimeoutError, BlockingIOError) as exc:
            raise self._timed_out(exc, "the peer accepted nothing within the timeout", message=False) from exc
        except OSError as exc:
            raise self._lost("send failed", exc) from exc

    def write_parts(self, parts: Sequence[Buffer]) -> None:
        """Write buffers completely and in order, gathered into as few system calls as the kernel
        takes; only inside ``exclusive``."""
        self._write(parts)

    def _write(self, parts: Sequence[Buffer]) -> None:
        if self._tls is None:
            self._send_raw(parts)
            return
        tls = self._tls
        self._send_raw([tls.encrypt(p) for p in parts if len(p)])

    def _send_raw(self, parts: Sequence[Buffer]) -> None:
        # Every part is bytes or a flat view of bytes (messages, MACs, ``PoolBytes`` ranges), so
        # len() counts bytes and the parts go to the kernel as they are.
        bufs = list(filter(len, parts))
        try:
            i = 0
            while i < len(bufs):
                self._arm(socket.SO_SNDTIMEO, message=False)
                batch = bufs[i:i + _IOV_MAX]
                sent = self._sock.sendmsg(batch)
                # all of it, as a blocking socket's call usually takes: no walk over the buffers
                i = i + len(batch) if sent == sum(map(len, batch)) else _advance(bufs, i, sent)
        except (TimeoutError, BlockingIOError) as exc:
            raise self._timed_out(exc, "the peer accepted nothing within the timeout", message=False) from exc
        except OSError as exc:
            raise self._lost("send failed", exc) from exc

    # -- reading ----------------------------------------------------------------------------------
    def recv_header(self, *, idle: bool = True, max_body: int | None = None) -> frames.Header:
        """The next message's verified header.

        With ``idle`` it waits as long as it takes for the message to start (within ``set_deadline``);
        ``max_body`` caps the body read before the peer proved anything. Once the header is in, its
        deadline is extended to cover a payload that follows on this socket.
        """
        self._msg_deadline = None
        if self._tls is None:
            if not self._pending:
                self._await_message(idle)
            header = self._header_from_pending()
            if header is not None:
                return header
        view = memoryview(self._prefix)
        got = 0
        while got == 0:
            try:
                got = self._sys_recv([view], waitall=False, message=False)
            except PeerLostError as exc:
                if idle and not self._closed and isinstance(exc.__cause__, (TimeoutError, BlockingIOError)) \
                        and self._deadline is None:
                    continue  # an idle connection; close() wakes this with end-of-stream
                raise
            if got == 0:
                raise self._lost("connection closed by peer")
        start = time.monotonic()
        self._msg_deadline = start + self._message_timeout
        self.recv_into([view[got:]])
        raw = bytes(self._prefix)
        p = frames.parse_prefix(raw)
        if not self.authenticated:
            limit = max_body if max_body is not None else frames.MAX_BODY_BYTES
            if p.body_len > limit:
                raise ProtocolError(f"{self.peer} sent a {p.body_len}-byte body before authenticating "
                                    f"(at most {limit})")
            if p.payload_len or p.kind not in _HANDSHAKE_KINDS:
                raise ProtocolError(f"{self.peer} sent a message of kind {p.kind} before authenticating")
        self._msg_deadline = start + self._deadline_for(frames.PREFIX.size + p.body_len)
        body = bytearray(p.body_len)
        self.recv_into([memoryview(body)])
        return self._with_payload_deadline(self._open(raw, bytes(body), p), start, p)

    def _header_from_pending(self) -> frames.Header | None:
        """The next header when its prefix and body are all in the bytes read ahead (the usual case
        once authenticated: no system call and no copy loop), else None with nothing consumed."""
        pending = self._pending
        size = frames.PREFIX.size
        if len(pending) < size or not self.authenticated:
            return None
        raw = bytes(pending[:size])
        p = frames.parse_prefix(raw)
        end = size + p.body_len
        if len(pending) < end:
            return None
        start = time.monotonic()
        header = self._open(raw, bytes(pending[size:end]), p)
        self._pending = pending[end:]
        return self._with_payload_deadline(header, start, p)

    def _with_payload_deadline(self, header: frames.Header, start: float, p: frames.Prefix) -> frames.Header:
        """``header``, once the deadline of its message covers a payload that follows on this socket."""
        if header.kind is frames.Kind.DATA and not header.flags & frames.OUT_OF_BAND:
            trailer = frames.TAG_BYTES if header.flags & frames.MAC_TRAILER else 0
            self._msg_deadline = start + self._deadline_for(frames.PREFIX.size + p.body_len + p.payload_len + trailer)
        else:
            self._msg_deadline = None
        return header

    def _await_message(self, idle: bool) -> None:
        """Read ahead (plaintext) the first bytes of the next message, waiting as long as the
        connection may idle (``idle``); end-of-stream is ``PeerLostError``."""
        while True:
            try:
                self._arm(socket.SO_RCVTIMEO, message=False)
                got = self._sock.recv_into(self._ahead)
            except (TimeoutError, BlockingIOError) as exc:
                if idle and not self._closed and self._deadline is None:
                    continue  # an idle connection; close() wakes this with end-of-stream
                raise self._timed_out(exc, "no progress within the timeout", message=False) from exc
            except OSError as exc:
                raise self._lost("receive failed", exc) from exc
            if got == 0:
                raise self._lost("connection closed by peer")
            self._pending = memoryview(self._ahead)[:got]
            return

    def _deadline_for(self, nbytes: int) -> float:
        return max(self._message_timeout, nbytes / self._min_rate)

    def _open(self, raw: bytes, body: bytes, parsed: frames.Prefix) -> frames.Header:
        key = self._recv_key
        if key is None:
            return frames.verify(raw, body, parsed=parsed)
        seq = self._recv_seq
        header = frames.verify(raw, body, lambda data: key.header_tag(seq, data), seq=seq, what="MAC", parsed=parsed)
        self._recv_seq += 1
        return header

    def prepare_payload_mac(self, ahead: int) -> None:
        """Make ahead of time the running MAC context of the payload expected ``ahead`` messages
        from now (``MacKey.prepare``); only before any is read ahead (the connection idles)."""
        if self._recv_key is not None and not self._pending:
            self._recv_key.prepare(self._recv_seq + ahead)

    def recv_payload_mac(self, header: frames.Header) -> PayloadMac:
        """The MAC the payload following ``header`` must match."""
        if self._recv_key is None or header.seq < 0:
            raise ProtocolError("a payload before the handshake")
        return self._recv_key.payload_mac(header.seq, header.tag)

    def read_exact_into(self, buffers: list[memoryview]) -> None:
        """Fill ``buffers`` completely with one scatter-read that waits for all of it (the payload
        hot path); falls back to more reads only when the kernel returns early."""
        total = sum(map(len, buffers))
        if self._pending and self._tls is None:
            # Bytes read ahead with the header first, then the rest in one read that waits for all
            # of it (not a read per arrival, each followed by a walk over the buffers).
            taken = self._take_pending(buffers)
            if taken == total:
                return
            buffers = list(buffers)
            buffers = buffers[_advance(buffers, 0, taken):]
            total -= taken
        got = self._sys_recv(buffers, waitall=True, message=True, nbytes=total)
        if got < total:
            if got == 0:
                raise self._lost("connection closed by peer mid-message (truncated stream)")
            rest = list(buffers)
            self.recv_into(rest[_advance(rest, 0, got):])

    def recv_into(self, buffers: Sequence[memoryview]) -> None:
        """Fill every buffer completely, in order (one scatter-read per batch when possible)."""
        bufs = list(filter(len, buffers))
        i = 0
        while i < len(bufs):
            received = self._sys_recv(bufs[i:i + _IOV_MAX], waitall=False, message=True)
            if received == 0:
                raise self._lost("connection closed by peer mid-message (truncated stream)")
            i = _advance(bufs, i, received)

    def _sys_recv(self, bufs: list[memoryview], *, waitall: bool, message: bool, nbytes: int = -1) -> int:
        """One read into ``bufs`` (plaintext: decrypted when TLS is on); 0 at end-of-stream.

        Plaintext reads of less than ``_READ_AHEAD_BYTES`` go through a buffer that takes whatever the
        socket holds, so the small messages of a transfer (a header, its body, a small payload, the
        next message) cost one system call between them, not one each; larger reads go straight
        into ``bufs``, after whatever was read ahead.
        """
        if self._tls is not None:
            return self._tls_recv(bufs[0], message=message)
        if self._pending:
            return self._take_pending(bufs)
        try:
            self._arm(socket.SO_RCVTIMEO, message=message)
            if (nbytes if nbytes >= 0 else sum(map(len, bufs))) < _READ_AHEAD_BYTES:
                got = self._sock.recv_into(self._ahead)
                self._pending = memoryview(self._ahead)[:got]
                return self._take_pending(bufs) if got else 0
            flags = socket.MSG_WAITALL if waitall else 0
            if len(bufs) == 1:
                return self._sock.recv_into(bufs[0], 0, flags)
            return self._sock.recvmsg_into(bufs, 0, flags)[0]
        except (TimeoutError, BlockingIOError) as exc:
            raise self._timed_out(exc, "no progress within the timeout", message=message) from exc
        except OSError as exc:
            raise self._lost("receive failed", exc) from exc

    def _take_pending(self, bufs: list[memoryview]) -> int:
        """Fill ``bufs`` in order from the bytes read ahead, as far as they go; how many were taken."""
        pending = self._pending
        avail = len(pending)
        taken = 0
        for buf in bufs:
            dst = buf if buf.format == "B" and buf.ndim == 1 else buf.cast("B")
            n = len(dst)
            if taken + n >= avail:
                dst[:avail - taken] = pending[taken:]
                taken = avail
                break
            dst[:] = pending[taken:taken + n]
            taken += n
        self._pending = pending[taken:]
        return taken

    def _tls_recv(self, buf: memoryview, *, message: bool) -> int:
        tls = self._tls
        assert tls is not None
        while True:
            got = tls.decrypt_into(buf)
            if got is not None:
                return got
            if len(self._tls_buf) < _TLS_READ_BYTES:
                self._tls_buf = bytearray(_TLS_READ_BYTES)
            raw = memoryview(self._tls_buf)
            try:
                self._arm(socket.SO_RCVTIMEO, message=message)
                n = self._sock.recv_into(raw)
            except (TimeoutError, BlockingIOError) as exc:
                raise self._timed_out(exc, "no progress within the timeout", message=message) from exc
            except OSError as exc:
                raise self._lost("receive failed", exc) from exc
            if n == 0:
                return 0
            tls.feed(raw[:n])

    def has_data(self) -> bool:
        """Whether bytes (or end-of-stream) are waiting to be read right now."""
        if self._pending or (self._tls is not None and self._tls.pending()):
            return True
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
        error = PeerLostError(f"connection to {self.peer}: {what}{detail}")
        error.__cause__ = exc
        return error


_HANDSHAKE_KINDS = frozenset(int(k) for k in frames.HANDSHAKE_KINDS)


_B = TypeVar("_B", bound=Buffer)


def _advance(bufs: list[_B], i: int, nbytes: int) -> int:
    """Consume ``nbytes`` from ``bufs[i:]`` in place; the index of the first unfinished buffer."""
    while nbytes > 0:
        length = len(bufs[i])
        if nbytes >= length:
            nbytes -= length
            i += 1
        else:
            bufs[i] = bufs[i][nbytes:]  # type: ignore[assignment]  # a slice is of the same type
            nbytes = 0
    return i
