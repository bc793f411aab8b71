"""The decode side: ``KvReceiver`` accepts senders and lands their blocks where it was told to."""

from __future__ import annotations

import contextlib
import logging
import socket
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from pdrouter.core.kv_layout import KvLayout
from pdrouter.transfer import frames
from pdrouter.transfer.config import TransferConfig
from pdrouter.transfer.expectations import ExpectationBook
from pdrouter.transfer.incoming import IncomingTransfer
from pdrouter.transfer.pool_bytes import PoolBytes
from pdrouter.transfer.pools import check_backend, open_pool
from pdrouter.transfer.receiver_connection import ReceiverConnection
from pdrouter.transfer.tls_channel import server_context

if TYPE_CHECKING:
    import torch

    from pdrouter.transfer.dist_plane import StoreHost

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ReceiverStats:
    expectations: int
    connections: int
    deadlines: int = 0
    """Expectations' deadlines still pending (a finished transfer's is cancelled at once)."""
    refused_connections: int = 0
    """Connections closed on arrival because ``max_connections`` were open, all of them proved."""
    evicted_connections: int = 0
    """Connections that had not proved the token, closed to make room for newer ones."""
    unauthenticated: int = 0
    """Open connections that have not proved the token yet (counted in ``connections`` too)."""


class KvReceiver:
    """Listens for senders and writes their payloads into the blocks named by ``expect``.

    One per decode worker (thread-safe). Nothing lands anywhere an expectation did not name: a
    sender's frames are checked against the expectation's blocks and layers before a byte is read
    into the pool. The receiver owns expectations, never the blocks: when a transfer fails or is
    aborted, the caller frees its blocks.

    Limits (``TransferConfig``): at most ``max_connections`` open at once, of which at most
    ``unauthenticated_budget`` have not proved the token (a connection past either closes the oldest
    of those, so a flood of connections without the token never locks a sender out; only when every
    open connection has proved it is a new one closed on arrival); each must finish TLS and the
    handshake within ``handshake_timeout_s`` reading at most ``max_preauth_bytes`` per message before
    that; every message must then arrive within its deadline (``message_timeout_s``,
    ``message_min_bytes_per_s``).
    """

    def __init__(self, pool: PoolBytes | torch.Tensor, layout: KvLayout, config: TransferConfig, *,
                 host: str = "127.0.0.1", port: int = 0, advertise_host: str | None = None) -> None:
        self._view = open_pool(pool, layout)
        check_backend(config.backend, self._view)
        self._config = config
        self._compat = layout.compat_hash()
        self._lock = threading.Lock()
        self._connections: set[ReceiverConnection] = set()
        self._unproven: dict[ReceiverConnection, None] = {}
        """Connections that have not proved the token, oldest first."""
        self._closed = False
        self._refused = 0
        self._evicted = 0
        self._tls = server_context(config.tls.server_context()) if config.tls is not None else None
        self._listener = socket.create_server((host, port), backlog=128)
        try:
            self._store = (_store_host(host, advertise_host or host, config.connect_timeout_s)
                           if config.backend.is_distributed else None)
        except Exception:
            self._listener.close()
            raise
        self.address = f"{advertise_host or host}:{self._listener.getsockname()[1]}"
        self._book = ExpectationBook(layout, address=self.address, epoch=config.epoch,
                                     backend=config.backend.value, abort_grace_s=config.abort_grace_s)
        self._acceptor = threading.Thread(target=self._accept_loop, name=f"kvt-accept-{self.address}",
                                          daemon=True)
        self._acceptor.start()

    @property
    def epoch(self) -> int:
        return self._config.epoch

    @property
    def compat_hash(self) -> str:
        return self._compat

    def expect(self, transfer_id: str, dst_block_ids: Sequence[int], *, skip_blocks: int = 0,
               layers: range | None = None, sender_epoch: int = 0,
               timeout_s: float | None = None) -> IncomingTransfer:
        """Invite one transfer into ``dst_block_ids``; send ``handle.target`` to the sender.

        ``dst_block_ids`` are the prompt's blocks in order, of which the first ``skip_blocks`` are
        already filled here (prefix cache) and will not be sent. ``layers`` defaults to every
        layer of the pool; ``sender_epoch`` (0: any) is the epoch the sender must have; after
        ``timeout_s`` the transfer fails with ``DeadlineExceededError``.
        """
        return self._book.expect(transfer_id, dst_block_ids, skip_blocks=skip_blocks, layers=layers,
                                 sender_epoch=sender_epoch, timeout_s=timeout_s)

    def stats(self) -> ReceiverStats:
        with self._lock:
            return ReceiverStats(len(self._book), len(self._connections), self._book.deadlines(), self._refused,
                                 self._evicted, len(self._unproven))

    def close(self) -> None:
        """Abort every expectation (telling the senders), close every connection, stop the threads."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        with contextlib.suppress(OSError):
            self._listener.shutdown(socket.SHUT_RDWR)
        self._listener.close()
        self._acceptor.join()
        self._book.close("the receiver is shutting down")
        with self._lock:
            conns = list(self._connections)
        for conn in conns:
            conn.close()
        if self._store is not None:
            self._store.close()

    def __enter__(self) -> KvReceiver:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _accept_loop(self) -> None:
        while True:
            try:
                sock, _ = self._listener.accept()
            except OSError:
                return  # the listener closed
            evicted: list[ReceiverConnection] = []
            with self._lock:
                if self._closed:
                    sock.close()
                    return
                if len(self._unproven) >= self._config.unauthenticated_budget:
                    evicted.append(self._evict_oldest())
                if len(self._connections) >= self._config.max_connections:
                    if self._unproven:
                        evicted.append(self._evict_oldest())
                    else:
                        self._refused += 1
                        first = self._refused == 1
                        sock.close()
                        if first:
                            log.warning("KV transfer receiver at %s: %d connections open, refusing more "
                                        "(max_connections; counted in ReceiverStats.refused_connections, logged once)",
                                        self.address, len(self._connections))
                        continue
                try:
                    conn = ReceiverConnection(sock, self._view, self._config, self._compat, self._book,
                                              self._rendezvous, self._connection_closed, tls=self._tls,
                                              on_proven=self._connection_proven)
                except OSError:  # the peer hung up before we got to it
                    sock.close()
                    conn = None
                if conn is not None:
                    self._connections.add(conn)
                    self._unproven[conn] = None
            for old in evicted:
                old.fs.close()  # its thread sees the connection gone, and ends

    def _rendezvous(self) -> frames.Ready:
        return self._store.new_rendezvous() if self._store is not None else frames.Ready()

    def _evict_oldest(self) -> ReceiverConnection:
        """Forget the oldest connection that has not proved the token (the caller closes it); under the lock."""
        oldest = next(iter(self._unproven))
        del self._unproven[oldest]
        self._connections.discard(oldest)
        self._evicted += 1
        if self._evicted == 1:
            log.warning("KV transfer receiver at %s: closing the oldest connections that have not proved the token to "
                        "make room (max_unauthenticated_connections %d; counted in "
                        "ReceiverStats.evicted_connections, logged once)", self.address,
                        self._config.unauthenticated_budget)
        return oldest

    def _connection_proven(self, conn: ReceiverConnection) -> None:
        with self._lock:
            self._unproven.pop(conn, None)

    def _connection_closed(self, conn: ReceiverConnection) -> None:
        with self._lock:
            self._connections.discard(conn)
            self._unproven.pop(conn, None)


def _store_host(host: str, advertise_host: str, timeout_s: float) -> StoreHost:
    """The rendezvous store of gloo/NCCL connections (torch is loaded only for those backends)."""
    from pdrouter.transfer.dist_plane import StoreHost

    return StoreHost(host, advertise_host, timeout_s)
