"""One receiver-side connection: handshake, then BEGIN / DATA / END / ERROR from one sender.

A single thread reads the connection. Until the sender proved the token nothing but the
handshake is read (small bodies, one deadline for all of it); then every message carries a MAC.
DATA lands only in blocks that the bound expectation invited (checked before a byte is read into
the pool) and counts only once its payload MAC verifies. Every DATA, landed or dropped, counts
toward the credit returned to the sender (in ACKs every quarter of its window, and whenever the
connection goes idle). When the connection breaks, every transfer bound to it fails.
"""

from __future__ import annotations

import contextlib
import logging
import socket
import ssl
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Protocol

from pdrouter.core.errors import PdRouterError
from pdrouter.transfer import frames
from pdrouter.transfer.config import TransferConfig
from pdrouter.transfer.data_plane import DataPlane, SocketPlane
from pdrouter.transfer.errors import PeerLostError, ProtocolError, code_for_error, error_for_code
from pdrouter.transfer.framed_socket import FramedSocket
from pdrouter.transfer.handshake import PeerInfo, server_handshake
from pdrouter.transfer.incoming import IncomingTransfer
from pdrouter.transfer.integrity import ONE_SHOT_BYTES
from pdrouter.transfer.lifecycle import TransferState
from pdrouter.transfer.pool_bytes import PoolBytes

log = logging.getLogger(__name__)


class Expectations(Protocol):
    """The receiver's registry, as a connection sees it."""

    def lookup(self, transfer_id: str) -> IncomingTransfer | None: ...

    def why_gone(self, transfer_id: str) -> PdRouterError: ...


@contextmanager
def _refused() -> Iterator[bool]:
    yield False


class ReceiverConnection:
    """Serves one accepted socket on its own thread until it closes."""

    def __init__(self, sock: socket.socket, view: PoolBytes, config: TransferConfig, compat_hash: str,
                 expectations: Expectations, make_ready: Callable[[], frames.Ready],
                 on_closed: Callable[[ReceiverConnection], None], *, tls: ssl.SSLContext | None = None,
                 on_proven: Callable[[ReceiverConnection], None] | None = None) -> None:
        """``on_closed`` runs once the connection is gone, ``on_proven`` once its peer proved the token
        (both on the connection's thread)."""
        self.fs = FramedSocket(sock, config.progress_timeout_s, config.socket_buffer_bytes,
                               message_timeout=config.message_timeout_s,
                               min_bytes_per_s=config.message_min_bytes_per_s, congestion=config.tcp_congestion)
        self._tls = tls
        self._view = view
        self._config = config
        self._compat = compat_hash
        self._expectations = expectations
        self._make_ready = make_ready
        self._on_closed = on_closed
        self._on_proven = on_proven
        self._bound: dict[str, IncomingTransfer] = {}
        self._unacked = 0
        self._plane: DataPlane | None = None
        self._peer: PeerInfo | None = None
        self._macs_on_socket = not config.backend.is_distributed and config.payload_macs
        self._large_payloads = False
        """Whether the last DATA had a payload large enough for a running MAC context (see ``_serve``)."""
        self._payload_ahead = 1
        """How many messages from now the next payload is expected: 0 within a transfer (another
        DATA), 1 after its END (a BEGIN first), 2 once its last DATA landed (its END, a BEGIN)."""
        self._thread = threading.Thread(target=self._run, name=f"kvt-recv-{self.fs.peer}", daemon=True)
        self._thread.start()

    def close(self) -> None:
        self.fs.close()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=self._config.progress_timeout_s + 1)

    # -- the loop ---------------------------------------------------------------------------------
    def _run(self) -> None:
        failure: PdRouterError = PeerLostError("connection closed")
        try:
            self._serve()
        except PdRouterError as exc:
            failure = exc.with_traceback(None)  # no frames (and what they hold) kept alive by the error
            if self._plane is not None and not isinstance(exc, PeerLostError):
                self._send(frames.encode_control(frames.ErrorMsg("", int(code_for_error(exc)), exc.message)))
        except Exception as exc:  # a bug must not leave the bound transfers hanging
            log.exception("KV transfer receiver connection from %s crashed", self.fs.peer)
            failure = ProtocolError(f"receiver crashed: {exc!r}")
        finally:
            self._shutdown(failure)

    def _serve(self) -> None:
        cfg = self._config
        self.fs.set_deadline(cfg.handshake_timeout_s)  # TLS and the handshake, however the bytes trickle
        try:
            if self._tls is not None:
                self.fs.start_tls(self._tls, server_side=True)
            self._peer = server_handshake(self.fs, cfg, self._compat, self._make_ready)
        except PdRouterError as exc:
            _log_refusal(self.fs.peer, exc)
            raise
        self.fs.set_deadline(None)
        if self._on_proven is not None:
            self._on_proven(self)
        self._plane = self._open_plane(self._peer)
        while True:
            if self._unacked and not self.fs.has_data():
                self._acknowledge(0, flush=True)  # going idle: return all credit now
            if self._large_payloads:
                # This sender moves large payloads: the next one's MAC context is made while the
                # connection waits.
                self.fs.prepare_payload_mac(self._payload_ahead)
            self._handle(self.fs.recv_header())

    def _open_plane(self, peer: PeerInfo) -> DataPlane:
        cfg = self._config
        if not cfg.backend.is_distributed:
            return SocketPlane(self.fs, self._view, macs=cfg.payload_macs, offload=cfg.offload_macs)
        from pdrouter.transfer.dist_plane import RECEIVER_RANK, DistPlane, join_pair_group  # torch: gloo/NCCL only
        from pdrouter.transfer.pool_view import PoolView

        assert isinstance(self._view, PoolView)  # the receiver's check_backend made sure
        group = join_pair_group(cfg.backend, peer.ready, RECEIVER_RANK, self.fs.local_host,
                                cfg.connect_timeout_s, self._view.pool.device)
        return DistPlane(self.fs, self._view, group, 1 - RECEIVER_RANK, cfg.checksums, cfg.progress_timeout_s)

    def _handle(self, header: frames.Header) -> None:
        if header.kind is frames.Kind.DATA:
            self._large_payloads = self._macs_on_socket and header.payload_len > ONE_SHOT_BYTES
            self._payload_ahead = 0
            self._on_data(header)
            return
        self._payload_ahead = 0 if header.kind is frames.Kind.BEGIN else 1
        msg = frames.decode_control(header)
        if isinstance(msg, frames.Begin):
            self._on_begin(msg)
        elif isinstance(msg, frames.End):
            incoming = self._bound.get(msg.transfer_id)
            if incoming is not None:
                incoming.end_of_stream()
        elif isinstance(msg, frames.ErrorMsg) and msg.transfer_id:
            self._on_sender_error(msg)
        elif isinstance(msg, frames.ErrorMsg):
            raise PeerLostError(f"sender at {self.fs.peer} closed the connection: {msg.message}")
        else:
            raise ProtocolError(f"unexpected {header.kind.name} from sender at {self.fs.peer}")

    def _on_begin(self, msg: frames.Begin) -> None:
        assert self._peer is not None and self._plane is not None
        self._bound = {tid: t for tid, t in self._bound.items() if not t.state.terminal}
        incoming = self._expectations.lookup(msg.transfer_id)
        if incoming is None:
            self._send_error(msg.transfer_id, self._expectations.why_gone(msg.transfer_id))
            return
        tid = msg.transfer_id
        interrupt = self.fs.close if self._plane.can_interrupt else _nothing
        try:
            incoming.bind(msg, self._peer.epoch, self._peer.compat_hash, self._compat,
                          lambda error: self._send_error(tid, error), interrupt)
        except PdRouterError as exc:
            self._send_error(tid, exc)
            return
        self._bound[tid] = incoming

    def _on_data(self, header: frames.Header) -> None:
        assert self._plane is not None
        data = frames.decode_data(header)
        span = data.span
        try:
            self._view.check_span(span)
        except PdRouterError as exc:
            raise ProtocolError(f"DATA frame outside the pool: {exc.message}") from None
        if header.payload_len != self._view.nbytes(span):
            raise ProtocolError(f"DATA frame says {header.payload_len} bytes, its runs hold "
                                f"{self._view.nbytes(span)}")
        if bool(header.flags & frames.OUT_OF_BAND) != self._plane.out_of_band:
            raise ProtocolError("DATA frame on the wrong data plane")
        incoming = self._bound.get(data.transfer_id)
        positions = None
        if incoming is not None and incoming.state is TransferState.TRANSFERRING:
            try:
                positions = incoming.positions_of(span.layer_start, span.layer_end, span.runs)
            except ProtocolError as exc:
                incoming.fail(exc)
        guard = incoming.write_guard if incoming is not None else _refused
        verified = self._plane.recv_frame(header, span, positions is not None, guard)
        self._acknowledge(header.payload_len)
        if incoming is None or positions is None:
            return
        if verified is False:
            incoming.checksum_failed(data.seq)
            return
        incoming.mark_landed(span.layer_start, span.layer_end, positions, header.payload_len,
                             on_done=lambda: self._send_done(incoming.done_message))
        if incoming.state is TransferState.DONE:
            del self._bound[data.transfer_id]
            self._payload_ahead = 2

    def _send_done(self, done: bytes) -> None:
        """DONE (encoded), with the credit still owed ahead of it in the same write (the sender reads
        both at once); sent before the transfer's own waiters here are woken."""
        if self._unacked:
            ack, self._unacked = frames.encode_ack(self._unacked), 0
            self._send_many([ack, done])
        else:
            self._send(done)

    def _on_sender_error(self, msg: frames.ErrorMsg) -> None:
        assert self._peer is not None
        incoming = self._bound.get(msg.transfer_id)
        if incoming is None:
            candidate = self._expectations.lookup(msg.transfer_id)
            wanted = candidate.target.sender_epoch if candidate is not None else 0
            if candidate is not None and wanted in (0, self._peer.epoch):
                incoming = candidate
        if incoming is not None:
            incoming.fail(error_for_code(msg.code, f"sender at {self.fs.peer}: {msg.message}"), tell_peer=False)

    # -- helpers ----------------------------------------------------------------------------------
    def _acknowledge(self, nbytes: int, *, flush: bool = False) -> None:
        """Return the sender's credit (landed or dropped alike): once per ``ack_every`` bytes, and
        whenever the connection goes idle, so that no credit stays stranded."""
        assert self._peer is not None
        if self._peer.ack_every:
            self._unacked += nbytes
            if self._unacked and (flush or self._unacked >= self._peer.ack_every):
                self._send(frames.encode_ack(self._unacked))
                self._unacked = 0

    def _send(self, message: bytes) -> None:
        self._send_many([message])

    def _send_many(self, messages: list[bytes]) -> None:
        with contextlib.suppress(PeerLostError):  # the read loop notices a dead connection itself
            self.fs.send_many(messages)

    def _send_error(self, transfer_id: str, error: PdRouterError) -> None:
        self._send(frames.encode_control(frames.ErrorMsg(transfer_id, int(code_for_error(error)), error.message)))

    def _shutdown(self, failure: PdRouterError) -> None:
        if self._plane is not None:
            self._plane.close()
        self.fs.close()
        for tid, incoming in self._bound.items():
            cls = type(failure) if isinstance(failure, PdRouterError) else PeerLostError
            incoming.fail(cls(f"transfer {tid}: connection from sender {self.fs.peer} failed: "
                              f"{failure.message}"), tell_peer=False)
        self._bound.clear()
        self._on_closed(self)


def _nothing() -> None:
    return None


_REFUSALS_LOGGED: set[str] = set()


def _log_refusal(peer: str, exc: PdRouterError) -> None:
    """A refused handshake: the first of each kind at WARNING (a wrong token is usually a
    misconfiguration), the rest at DEBUG (anyone may open connections to make more)."""
    kind = type(exc).__name__
    first = kind not in _REFUSALS_LOGGED
    _REFUSALS_LOGGED.add(kind)
    log.log(logging.WARNING if first else logging.DEBUG, "KV transfer: refused a connection from %s: %s%s", peer,
            exc.message, " (further refusals of this kind are logged at DEBUG)" if first else "")
