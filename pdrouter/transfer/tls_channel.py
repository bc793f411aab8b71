"""TLS for one KV connection, over memory BIOs.

A connection is read by one thread while others write (acknowledgements, errors, frames), and an
``ssl.SSLSocket`` may not be used by two threads at once (OpenSSL's SSL objects are not thread
safe, and CPython does not serialize them). So the TLS state lives in an ``ssl.SSLObject`` over
two ``ssl.MemoryBIO``: encrypting and decrypting happen under one short lock, never while waiting,
and the ciphertext goes through the plain socket (``FramedSocket``), which keeps its timeouts,
deadlines and gather-writes.
"""

from __future__ import annotations

import ssl
import threading

from pdrouter.core.errors import PdRouterError
from pdrouter.transfer.errors import AuthError, ChecksumError, PeerLostError, ProtocolError

Buffer = bytes | bytearray | memoryview


def server_context(ctx: ssl.SSLContext) -> ssl.SSLContext:
    """``ctx`` without session tickets: nothing is ever resumed, and no TLS message is sent after the
    handshake unless a frame is."""
    ctx.num_tickets = 0
    return ctx


class TlsSession:
    """The TLS state of one connection; every method is thread-safe and never blocks on the network."""

    def __init__(self, ctx: ssl.SSLContext, *, server_side: bool, server_hostname: str | None) -> None:
        self._incoming = ssl.MemoryBIO()
        self._outgoing = ssl.MemoryBIO()
        self._obj = ctx.wrap_bio(self._incoming, self._outgoing, server_side=server_side,
                                 server_hostname=None if server_side else server_hostname)
        self._lock = threading.Lock()

    def handshake_step(self) -> bool:
        """Advance the handshake with what was fed; True once it is complete."""
        with self._lock:
            try:
                self._obj.do_handshake()
            except ssl.SSLWantReadError:
                return False
            except ssl.SSLError as exc:
                raise tls_error(exc, "the TLS handshake failed") from None
            return True

    def output(self) -> bytes:
        """Ciphertext waiting to be sent (handshake records, alerts)."""
        with self._lock:
            return self._outgoing.read()

    def feed(self, data: Buffer) -> None:
        """Ciphertext that arrived."""
        with self._lock:
            self._incoming.write(data)

    def encrypt(self, data: Buffer) -> bytes:
        """The records carrying ``data`` (all of it)."""
        view = memoryview(data).cast("B")
        with self._lock:
            try:
                done = 0
                while done < len(view):
                    done += self._obj.write(view[done:])
            except ssl.SSLError as exc:
                raise tls_error(exc, "TLS write failed") from None
            return self._outgoing.read()

    def decrypt_into(self, buf: memoryview) -> int | None:
        """Plaintext into ``buf`` (one record's worth at most); None when more ciphertext is needed,
        0 when the peer closed the TLS session."""
        with self._lock:
            try:
                return int(self._obj.read(len(buf), buf))
            except ssl.SSLWantReadError:
                return None
            except ssl.SSLZeroReturnError:
                return 0
            except ssl.SSLError as exc:
                raise tls_error(exc, "TLS read failed") from None

    def pending(self) -> bool:
        """Whether plaintext or a whole record may be read without the network."""
        with self._lock:
            return bool(self._obj.pending() or self._incoming.pending)


def tls_error(exc: ssl.SSLError, what: str) -> PdRouterError:
    """An ``SSLError`` as the project error it means: a refused certificate is an AuthError, a record
    failing its integrity check a ChecksumError, plaintext where TLS was expected a ProtocolError."""
    reason = str(getattr(exc, "reason", "") or "")
    detail = f"{what}: {getattr(exc, 'verify_message', '') or reason or exc}"
    if isinstance(exc, ssl.SSLCertVerificationError) or "CERTIFICATE" in reason or "UNKNOWN_CA" in reason \
            or "BAD_CERT" in reason or "ACCESS_DENIED" in reason:
        return AuthError(f"{detail} (the peers' TLS certificates do not match)")
    if "BAD_RECORD_MAC" in reason or "DECRYPTION_FAILED" in reason or "DECRYPT_ERROR" in reason:
        return ChecksumError(f"{detail} (a TLS record was corrupted in transit)")
    if "WRONG_VERSION" in reason or "HTTP_REQUEST" in reason or "UNEXPECTED_RECORD" in reason \
            or "PACKET_LENGTH" in reason or "RECORD_LAYER" in reason:
        return ProtocolError(f"{detail} (the peer does not speak TLS)")
    return PeerLostError(detail)
