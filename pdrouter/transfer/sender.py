"""The prefill side: ``KvSender`` opens transfers to receivers over persistent, shared connections."""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING

from pdrouter.core.errors import IncompatibleError, StaleEpochError
from pdrouter.core.kv_layout import KvLayout
from pdrouter.transfer.config import TransferConfig
from pdrouter.transfer.data_plane import DataPlane, SocketPlane
from pdrouter.transfer.errors import PeerLostError
from pdrouter.transfer.framed_socket import FramedSocket
from pdrouter.transfer.handshake import PeerInfo, client_handshake
from pdrouter.transfer.outgoing import OutgoingTransfer
from pdrouter.transfer.pool_bytes import PoolBytes
from pdrouter.transfer.pools import check_backend, open_pool
from pdrouter.transfer.sender_connection import SenderConnection
from pdrouter.transfer.target import TransferTarget

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class SenderStats:
    connections: int
    transfers: int
    queued_messages: int
    inflight_bytes: int


class KvSender:
    """Sends requests' KV blocks from this worker's pool into receivers' reserved blocks.

    One per prefill worker (thread-safe). ``open_transfer`` checks the target against this pool
    and the receiver (auth token, compat hash, epochs) and returns an ``OutgoingTransfer`` to feed.
    The sender never writes anywhere but the target's ``dst_block_ids`` (after ``skip_blocks``),
    and only reads the source blocks it is given.
    """

    def __init__(self, pool: PoolBytes | torch.Tensor, layout: KvLayout, config: TransferConfig) -> None:
        self._view = open_pool(pool, layout)
        check_backend(config.backend, self._view)
        self._config = config
        self._compat = layout.compat_hash()
        self._lock = threading.Lock()
        self._connect_locks: dict[str, threading.Lock] = {}
        self._connections: dict[str, SenderConnection] = {}
        self._closed = False
        self._tls = config.tls.client_context() if config.tls is not None else None

    @property
    def epoch(self) -> int:
        return self._config.epoch

    def connect(self, peer: str) -> None:
        """Open (or reuse) the connection to ``peer`` ("host:port") ahead of the first transfer."""
        self._connection(peer)

    def peer_info(self, peer: str) -> PeerInfo:
        """What the handshake with ``peer`` established (connecting if needed)."""
        return self._connection(peer).peer

    def open_transfer(self, target: TransferTarget) -> OutgoingTransfer:
        """Start a transfer to ``target``; raises IncompatibleError, StaleEpochError, AuthError or
        PeerLostError when it cannot happen (telling the receiver when it is reachable)."""
        if target.backend != self._config.backend.value:
            raise IncompatibleError(f"transfer {target.transfer_id}: the receiver expects backend "
                                    f"{target.backend!r}, this sender uses {self._config.backend.value!r}")
        return self._open_on(self._connection(target.peer), target)

    def open_transfer_if_connected(self, target: TransferTarget) -> OutgoingTransfer | None:
        """``open_transfer`` when a live connection to the target's receiver exists (it does not
        block: an event loop may call it), else None (use ``open_transfer``, which may dial)."""
        with self._lock:
            conn = self._connections.get(target.peer)
            if self._closed or conn is None or not conn.alive:
                return None
        if target.backend != self._config.backend.value:
            return self.open_transfer(target)  # raises at once, without dialling
        return self._open_on(conn, target)

    def _open_on(self, conn: SenderConnection, target: TransferTarget) -> OutgoingTransfer:
        if conn.peer.epoch != target.epoch:
            raise StaleEpochError(f"transfer {target.transfer_id}: receiver at {target.peer} is now epoch "
                                  f"{conn.peer.epoch}, the target was issued by epoch {target.epoch} "
                                  f"(it restarted)")
        if not self._compat == target.compat_hash == conn.peer.compat_hash:
            error = IncompatibleError(f"transfer {target.transfer_id}: KV layouts differ (sender "
                                      f"{self._compat}, target {target.compat_hash}, receiver "
                                      f"{conn.peer.compat_hash})")
            conn.send_refusal(target.transfer_id, error)
            raise error
        transfer = OutgoingTransfer(target, self._view, conn, max_frame_bytes=self._config.max_frame_bytes,
                                    max_runs=self._config.max_runs_per_frame, on_finished=conn.forget)
        if transfer.state.terminal:
            return transfer  # nothing to send
        conn.register(transfer)  # its BEGIN held until its first frame (or announce)
        return transfer

    def stats(self) -> SenderStats:
        with self._lock:
            conns = list(self._connections.values())
        counts = [c.counts() for c in conns]
        return SenderStats(len(conns), sum(t for t, _ in counts), sum(q for _, q in counts),
                           sum(c.inflight_bytes for c in conns))

    def close(self) -> None:
        """Fail every transfer in progress, close every connection and stop the threads."""
        with self._lock:
            self._closed = True
            conns = list(self._connections.values())
        for conn in conns:
            conn.close()

    def __enter__(self) -> KvSender:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- connections ------------------------------------------------------------------------------
    def _connection(self, peer: str) -> SenderConnection:
        with self._lock:
            if self._closed:
                raise PeerLostError("the sender is closed")
            conn = self._connections.get(peer)
            if conn is not None and conn.alive:
                return conn
            lock = self._connect_locks.setdefault(peer, threading.Lock())
        with lock:
            with self._lock:
                conn = self._connections.get(peer)
                if conn is not None and conn.alive:
                    return conn
            conn = self._dial(peer)
            with self._lock:
                if self._closed:
                    conn.close()
                    raise PeerLostError("the sender is closed")
                self._connections[peer] = conn
            return conn

    def _dial(self, peer: str) -> SenderConnection:
        cfg = self._config
        host, _, port = peer.rpartition(":")
        fs = FramedSocket.connect(host, int(port), cfg.connect_timeout_s, cfg.progress_timeout_s,
                                  cfg.socket_buffer_bytes, cfg.tcp_congestion, message_timeout=cfg.message_timeout_s,
                                  min_bytes_per_s=cfg.message_min_bytes_per_s)
        try:
            fs.set_deadline(cfg.connect_timeout_s, f"the handshake with {peer}")
            if self._tls is not None:
                fs.start_tls(self._tls, server_side=False, server_hostname=host)
            info = client_handshake(fs, cfg, self._compat)
            fs.set_deadline(None)
            plane: DataPlane
            if cfg.backend.is_distributed:  # torch is loaded only for these backends
                from pdrouter.transfer.dist_plane import RECEIVER_RANK, DistPlane, join_pair_group
                from pdrouter.transfer.pool_view import PoolView

                assert isinstance(self._view, PoolView)  # check_backend made sure
                group = join_pair_group(cfg.backend, info.ready, 1 - RECEIVER_RANK, fs.local_host,
                                        cfg.connect_timeout_s, self._view.pool.device)
                plane = DistPlane(fs, self._view, group, RECEIVER_RANK, cfg.checksums, cfg.progress_timeout_s)
            else:
                plane = SocketPlane(fs, self._view, macs=cfg.payload_macs, offload=cfg.offload_macs)
        except BaseException:
            fs.close()
            raise
        return SenderConnection(fs, info, plane, cfg, self._compat,
                                lambda conn: self._forget_connection(peer, conn))

    def _forget_connection(self, peer: str, conn: SenderConnection) -> None:
        with self._lock:
            if self._connections.get(peer) is conn:
                del self._connections[peer]
