"""What the handshake derives from the token, and the MACs every message carries after it.

Key schedule (HKDF-SHA256, RFC 5869, from the token and the transcript of the two hellos)::

    transcript = SHA-256(label | len+CLIENT_HELLO body | len+SERVER_HELLO body)
                 (both nonces, both epochs, compat hashes, backends, the sender's ack window)
    prk        = HKDF-Extract(salt=transcript, ikm=token)
    client proof, server proof, key client→server, key server→client
               = HKDF-Expand(prk, "<label>", 32) each

A proof is only ever sent after the other side's hello, so each is fresh; the connecting side sends
its proof first and the receiver answers with its own only once that verified (a client without
the token learns nothing derived from it). Each direction has its own 256-bit key.

Frame MACs are AES-GMAC (AES-GCM over associated data only, no plaintext): chosen by measurement
as the fastest keyed MAC at hand (AES-NI and carry-less multiplication, wider still with VAES;
``cryptography`` releases the GIL while it hashes, so it overlaps with socket I/O on another
thread); keyed BLAKE2b, BLAKE3 and Poly1305 were slower (figures: ``docs/benchmarks.md``).
Message ``n`` of a direction (counted from 0 once the keys are installed) is authenticated with
the nonce ``(n, 0)`` for its prefix and body and ``(n, 1)`` for its payload, which also covers the
header's tag: a frame replayed, reordered, dropped or moved to another connection fails its MAC.
Nonces never repeat under a key (a key lives for one connection; ``n`` only grows).
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import struct
import threading
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from pdrouter.transfer.errors import ProtocolError

TAG_BYTES = 16
PROOF_BYTES = 32
_NONCE = struct.Struct("<QI")
_LABEL = b"pdrouter kvtransfer v2"
"""Bound into every derived key and proof: part of the protocol, so it keeps the package's former name
(another label would change every key, and peers of earlier builds could no longer prove the token)."""
_HEADER, _PAYLOAD = 0, 1

Buffer = bytes | bytearray | memoryview


@dataclass(frozen=True)
class SessionSecrets:
    """Everything one connection derives from the token and the hellos (never logged or sent, but the proofs)."""

    client_proof: bytes = field(repr=False)
    server_proof: bytes = field(repr=False)
    client_to_server: bytes = field(repr=False)
    server_to_client: bytes = field(repr=False)


def derive_session(token: str, client_hello: bytes, server_hello: bytes) -> SessionSecrets:
    """The proofs and direction keys of one connection, from the token and the two hello bodies as sent."""
    transcript = hashlib.sha256(_framed(_LABEL + b" transcript") + _framed(client_hello)
                                + _framed(server_hello)).digest()
    prk = hmac.new(transcript, token.encode(), hashlib.sha256).digest()
    return SessionSecrets(*(_expand(prk, label) for label in (
        b"client proof", b"server proof", b"key client->server", b"key server->client")))


def proof_matches(presented: object, expected: bytes) -> bool:
    """Constant-time check of a hex proof from the wire; anything malformed (not a string, not hex,
    not ASCII, a lone surrogate, the wrong length) is simply a wrong proof."""
    try:
        got = bytes.fromhex(presented) if isinstance(presented, str) else b""
    except ValueError:
        got = b""
    return hmac.compare_digest(got, expected)


def _expand(prk: bytes, label: bytes) -> bytes:
    """HKDF-Expand for one SHA-256 block (32 bytes)."""
    return hmac.new(prk, _LABEL + b" " + label + b"\x01", hashlib.sha256).digest()


def _framed(data: bytes) -> bytes:
    return struct.pack("<Q", len(data)) + data


class MacKey:
    """One direction's key: tags for that direction's message ``seq``."""

    def __init__(self, key: bytes) -> None:
        if len(key) != 32:
            raise ValueError("a MAC key has 32 bytes")
        self._aead = AESGCM(key)
        self._aes = algorithms.AES(key)
        self._scratch = bytearray()  # one direction's messages are sealed or opened one at a time
        self._spare: tuple[int, object] | None = None

    def header_tag(self, seq: int, data: Buffer) -> bytes:
        """The tag of a message's prefix (tag field zero) and body."""
        return self._aead.encrypt(_NONCE.pack(seq, _HEADER), b"", bytes(data))

    def payload_mac(self, seq: int, header_tag: bytes) -> PayloadMac:
        """A running MAC of message ``seq``'s payload, bound to its header's tag."""
        return PayloadMac(self, seq, header_tag)

    def prepare(self, seq: int) -> None:
        """Make the running MAC context of message ``seq``'s payload ahead of time (while its
        connection waits for it): on a cold cache a context costs tens of microseconds, which would
        otherwise fall between a large payload's first bytes and its last."""
        if self._spare is None or self._spare[0] != seq:
            self._spare = (seq, self._new_context(seq))

    def _context(self, seq: int) -> object:
        spare = self._spare
        if spare is not None and spare[0] == seq:
            self._spare = None
            return spare[1]
        return self._new_context(seq)

    def _new_context(self, seq: int) -> object:
        return Cipher(self._aes, modes.GCM(_NONCE.pack(seq, _PAYLOAD))).encryptor()

    def _one_shot(self, seq: int, pieces: Sequence[Buffer], nbytes: int) -> bytes:
        """The tag of ``pieces`` concatenated, in one call (joined, or for larger payloads, copied into
        this key's scratch buffer: no allocation of that size each time)."""
        if nbytes <= _JOIN_BYTES:
            return self._aead.encrypt(_NONCE.pack(seq, _PAYLOAD), b"", b"".join(pieces))
        if len(self._scratch) < nbytes:
            self._scratch = bytearray(max(nbytes, ONE_SHOT_BYTES + TAG_BYTES))
        scratch = memoryview(self._scratch)
        at = 0
        for piece in pieces:
            n = len(piece)
            scratch[at:at + n] = piece
            at += n
        return self._aead.encrypt(_NONCE.pack(seq, _PAYLOAD), b"", scratch[:nbytes])


_JOIN_BYTES = 64 << 10
ONE_SHOT_BYTES = 256 << 10
"""Payloads up to this size are gathered and hashed in one call when their tag is asked for (still in
the CPU cache): an incremental GCM context costs about ten times a one-shot call to set up, which
dominated frames of a few blocks. Larger payloads are hashed piece by piece as they move."""


class PayloadMac:
    """A payload's MAC, fed in order (one thread at a time), then ``tag()`` once.

    The tag is AES-GMAC of the header's tag followed by the payload, however it is cut: pieces of a
    small payload are only referenced until ``tag()`` (they must stay unchanged until then), a
    larger one goes through an incremental context from the first piece that passes
    ``ONE_SHOT_BYTES``.
    """

    def __init__(self, key: MacKey, seq: int, header_tag: bytes) -> None:
        self._key = key
        self._seq = seq
        self._ctx: object | None = None
        self._pending: list[Buffer] = [header_tag]
        self._pending_bytes = len(header_tag)

    def update_all(self, pieces: Sequence[Buffer]) -> None:
        """``update`` with each piece in turn (one call for a batch: the per-piece Python is the cost)."""
        ctx = self._ctx
        if ctx is None:
            nbytes = sum(map(len, pieces))
            if self._pending_bytes + nbytes <= ONE_SHOT_BYTES + TAG_BYTES:
                self._pending += pieces
                self._pending_bytes += nbytes
                return
            for piece in pieces:
                self.update(piece)
            return
        add = ctx.authenticate_additional_data  # type: ignore[attr-defined]
        for piece in pieces:
            add(piece)

    def update(self, data: Buffer) -> None:
        ctx = self._ctx
        if ctx is None:
            if self._pending_bytes + len(data) <= ONE_SHOT_BYTES + TAG_BYTES:
                self._pending.append(data)
                self._pending_bytes += len(data)
                return
            ctx = self._ctx = self._key._context(self._seq)
            for piece in self._pending:
                ctx.authenticate_additional_data(piece)  # type: ignore[attr-defined]
            self._pending = []
        ctx.authenticate_additional_data(data)  # type: ignore[attr-defined]

    def tag(self) -> bytes:
        ctx = self._ctx
        if ctx is None:
            return self._key._one_shot(self._seq, self._pending, self._pending_bytes)
        ctx.finalize()  # type: ignore[attr-defined]
        return bytes(ctx.tag)  # type: ignore[attr-defined]


class MacHelper:
    """A thread that feeds payload pieces to their MACs in the order given, so that the socket's
    thread moves the next piece meanwhile (socket calls and AES-GMAC both release the GIL).

    One user at a time (the connection's reader, or its writer under the send lock). ``wait``
    returns once every piece handed over has been hashed (no piece of pool memory is read after it).
    """

    def __init__(self, name: str) -> None:
        self._name = name
        self._cv = threading.Condition()
        self._jobs: deque[tuple[PayloadMac, Sequence[Buffer]]] = deque()
        self._error: BaseException | None = None
        self._closed = False
        self._thread: threading.Thread | None = None

    def submit(self, mac: PayloadMac, pieces: Sequence[Buffer]) -> None:
        with self._cv:
            if self._closed:
                raise ProtocolError("the MAC helper is closed")
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
                self._thread.start()
            self._jobs.append((mac, pieces))
            self._cv.notify_all()

    def wait(self) -> None:
        """Until every piece submitted so far is hashed; re-raises what the helper hit."""
        with self._cv:
            self._cv.wait_for(lambda: not self._jobs)
            error, self._error = self._error, None
        if error is not None:
            raise ProtocolError(f"payload MAC failed: {error!r}")

    def close(self) -> None:
        with self._cv:
            self._closed = True
            self._cv.notify_all()
            thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join()

    def _run(self) -> None:
        while True:
            with self._cv:
                self._cv.wait_for(lambda: self._jobs or self._closed)
                if not self._jobs:
                    return
                mac, pieces = self._jobs[0]
            try:
                for piece in pieces:
                    mac.update(piece)
            except BaseException as exc:  # handed to the waiting side, which fails the frame
                with self._cv:
                    self._error = exc
            with self._cv:
                self._jobs.popleft()
                self._cv.notify_all()


class MacFeed:
    """The pieces of one payload on their way to its MAC: batched to a helper thread, or inline."""

    def __init__(self, mac: PayloadMac, helper: MacHelper | None, batch_bytes: int) -> None:
        self._mac = mac
        self._helper = helper
        self._batch_bytes = batch_bytes
        self._batch: list[Buffer] = []
        self._size = 0

    def add(self, piece: Buffer) -> None:
        if self._helper is None:
            self._mac.update(piece)
            return
        self._batch.append(piece)
        self._size += len(piece)
        if self._size >= self._batch_bytes:
            self._flush()

    def add_all(self, pieces: Sequence[Buffer]) -> None:
        if self._helper is None:
            self._mac.update_all(pieces)
            return
        for piece in pieces:
            self.add(piece)

    def finish(self) -> bytes:
        """The payload's tag (every piece added so far)."""
        if self._helper is not None:
            self._flush()
            self._helper.wait()
        return self._mac.tag()

    def settle(self) -> None:
        """Wait until no piece is being read any more (after a failure midway; the tag is dropped)."""
        if self._helper is not None:
            self._batch = []
            with contextlib.suppress(ProtocolError):
                self._helper.wait()

    def _flush(self) -> None:
        if self._batch:
            assert self._helper is not None
            self._helper.submit(self._mac, self._batch)
            self._batch, self._size = [], 0
