"""Transport configuration (one frozen object per worker) and process epochs."""

from __future__ import annotations

import os
import socket
import time
from dataclasses import dataclass, field
from enum import StrEnum

from pdrouter.core.errors import ConfigError
from pdrouter.core.ids import Epoch
from pdrouter.core.tls import TlsFiles

MiB = 1 << 20
MIN_TOKEN_BYTES = 16
"""The shortest auth token accepted: anything shorter could be guessed from one recorded handshake."""
MAC_OFFLOAD_MIN_CORES = 4


def usable_cores() -> int:
    """The cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


class Backend(StrEnum):
    """How the payload bytes travel. Control always goes over the TCP connection."""

    TCP = "tcp"
    """Payload inline on the TCP connection (CPU pools)."""
    GLOO = "gloo"
    """torch.distributed point-to-point with the gloo backend (CPU pools)."""
    NCCL = "nccl"
    """torch.distributed point-to-point with the NCCL backend (CUDA pools)."""

    @property
    def is_distributed(self) -> bool:
        return self is not Backend.TCP


def _proc_list(name: str) -> str:
    try:
        with open(f"/proc/sys/net/ipv4/{name}") as f:
            return f.read().strip() or "none"
    except OSError:
        return "unknown"


def host_tcp_congestion() -> str:
    """This host's default TCP congestion control (``net.ipv4.tcp_congestion_control``; "unknown"
    where it cannot be read): what a KV connection gets without ``tcp_congestion``."""
    return _proc_list("tcp_congestion_control")


def describe_tcp_congestion(name: str | None) -> str:
    """What a worker logs at start: the KV connections' TCP congestion control, and where it came from."""
    if name is not None:
        return f"KV connections: TCP congestion control {name}"
    host = host_tcp_congestion()
    hint = "; BBR's pacing can slow KV transfers over short links" if host == "bbr" else ""
    return (f"KV connections: TCP congestion control {host}, the host's default "
            f"(--kv-tcp-congestion chooses another{hint})")


def check_tcp_congestion(name: str) -> str:
    """``name`` when this host's kernel lets this process set it as a socket's TCP congestion control
    (``TCP_CONGESTION``); ConfigError naming what is available, and what is allowed without
    CAP_NET_ADMIN, otherwise."""
    if not name or len(name) > 15 or not all(c.isalnum() or c in "_-" for c in name):
        raise ConfigError(f"the TCP congestion control must be an algorithm's name (cubic, reno, bbr, dctcp, ...), "
                          f"got {name!r}")
    option = getattr(socket, "TCP_CONGESTION", None)
    if option is None:  # pragma: no cover - Linux has it
        raise ConfigError("this platform cannot set a socket's TCP congestion control")
    probe = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        probe.setsockopt(socket.IPPROTO_TCP, option, name.encode())
    except OSError as exc:
        raise ConfigError(f"the kernel refused TCP congestion control {name!r} ({exc.strerror}): available here: "
                          f"{_proc_list('tcp_available_congestion_control')}; allowed without CAP_NET_ADMIN: "
                          f"{_proc_list('tcp_allowed_congestion_control')}") from None
    finally:
        probe.close()
    return name


def check_auth_token(token: str, *, what: str = "the KV transfer auth token") -> str:
    """``token`` when it is long enough to be a secret; ConfigError (naming ``what``, never the value) otherwise."""
    if not token:
        raise ConfigError(f"{what} is empty: every prefill and decode worker of a deployment shares one secret")
    if len(token.encode()) < MIN_TOKEN_BYTES:
        raise ConfigError(f"{what} must be at least {MIN_TOKEN_BYTES} bytes (make one with: "
                          f"python -c 'import secrets; print(secrets.token_hex(16))')")
    return token


@dataclass(frozen=True)
class TransferConfig:
    """Everything a sender or receiver needs besides the pool: identity, limits and timeouts.

    ``epoch`` is this process's incarnation (``new_epoch()`` once at start-up, also published to
    the registry); ``auth_token`` (at least ``MIN_TOKEN_BYTES``) is shared by every worker of a
    deployment and never sent on the wire: the handshake proves it (the connecting side first) and
    derives from it the per-connection keys of the MACs every later frame carries.
    """

    auth_token: str = field(repr=False)
    epoch: int
    backend: Backend = Backend.TCP
    tls: TlsFiles | None = None
    """TLS on the KV connection. The receiver presents ``cert``/``key`` and, when ``ca`` is set,
    requires a client certificate signed by it (mutual TLS); the sender verifies the receiver
    against ``ca`` (the host name checked is the one dialled) and presents its own ``cert``. The
    token handshake and the frame MACs run inside TLS as well."""
    connect_timeout_s: float = 5.0
    """Sender: connect, then TLS and the handshake (plus process-group set-up for gloo/NCCL)."""
    handshake_timeout_s: float = 5.0
    """Receiver: an accepted connection must finish TLS and the handshake within this, however
    its bytes trickle; it is closed otherwise."""
    progress_timeout_s: float = 10.0
    """The longest a started message, or bytes in flight, may go without progress."""
    message_timeout_s: float = 10.0
    message_min_bytes_per_s: float = 1_000_000.0
    """Once the first byte of a message arrived, all of it (header, body, payload on the socket)
    must arrive within ``max(message_timeout_s, size / message_min_bytes_per_s)``: a peer that
    trickles bytes cannot hold a connection (and the blocks a frame lands in) by staying just
    inside ``progress_timeout_s``."""
    max_connections: int = 128
    """Receiver: connections open at once (authenticated or not). One more closes the oldest that
    has not proved the token, or, when every open one has, is itself closed on arrival (counted in
    ``ReceiverStats.refused_connections``)."""
    max_unauthenticated_connections: int | None = None
    """Receiver: connections open that have not proved the token yet (None: a quarter of
    ``max_connections``); one more closes the oldest of them (``ReceiverStats.evicted_connections``),
    so peers without the token can never hold the connections the senders with it need."""
    max_preauth_bytes: int = 4096
    """The largest message body either side reads before the peer proved the token."""
    abort_grace_s: float = 2.0
    """How long an abort waits for a frame already landing in the blocks before cutting the link."""
    max_frame_bytes: int = 16 * MiB
    max_runs_per_frame: int = 1024
    max_inflight_bytes: int = 256 * MiB
    """Payload bytes per connection sent but not yet acknowledged (landed and verified, or dropped)
    by the receiver; the sender waits beyond this. It holds no memory (frames are read from the pool
    as they go out); it bounds how far a sender runs ahead of the receiver. The receiver
    acknowledges every quarter of it and whenever it goes idle; fewer acknowledgements cost less.
    0: none at all, and the socket buffers alone bound what is in flight."""
    socket_buffer_bytes: int = 4 * MiB
    """SO_SNDBUF / SO_RCVBUF; 0 keeps the kernel's autotuning."""
    tcp_congestion: str | None = None
    """The TCP congestion control of the KV connections (``TCP_CONGESTION``: ``cubic``, ``reno``,
    ``dctcp``, ...); None keeps the host's default (``net.ipv4.tcp_congestion_control``). BBR paces a
    connection at the bandwidth it has measured, and a KV transfer's bursts after idle gaps can keep
    that estimate far below what a short link carries (measured in ``docs/benchmarks.md``, "TCP
    congestion control"). Both ends set it on their sockets."""
    payload_macs: bool = True
    """Every payload on the socket carries a MAC (AES-GMAC under the connection's key). Off only
    with ``tls``, which then authenticates the payload bytes itself; headers and control messages
    carry MACs regardless."""
    mac_offload: bool | None = None
    """Hash large payloads on a helper thread while the socket moves the next piece (both release
    the GIL, so they overlap where a core is free); False: in the socket's thread; None: on a
    helper thread when the process may use at least ``MAC_OFFLOAD_MIN_CORES`` cores (with fewer,
    the sender, the receiver and the kernel already keep every core busy, and the hand-overs only
    add to it: measured on two cores, ``benchmarks/kv_transfer_bench.py``)."""
    checksums: bool = True
    """gloo payloads (which travel over the process group, not the socket): an xxh3-64 of each
    frame in its authenticated header. A CUDA pool's NCCL payload is not hashed."""

    @property
    def unauthenticated_budget(self) -> int:
        """Receiver: connections that may be open without having proved the token."""
        given = self.max_unauthenticated_connections
        return max(1, self.max_connections // 4) if given is None else given

    def __post_init__(self) -> None:
        object.__setattr__(self, "backend", Backend(self.backend))
        check_auth_token(self.auth_token)
        if self.epoch <= 0:
            raise ConfigError(f"epoch must be > 0, got {self.epoch}")
        for name in ("connect_timeout_s", "handshake_timeout_s", "progress_timeout_s", "message_timeout_s",
                     "message_min_bytes_per_s", "abort_grace_s"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.max_connections < 1:
            raise ConfigError(f"max_connections must be >= 1, got {self.max_connections}")
        budget = self.max_unauthenticated_connections
        if budget is not None and not 1 <= budget <= self.max_connections:
            raise ConfigError(f"max_unauthenticated_connections must be in [1, max_connections = "
                              f"{self.max_connections}], got {budget}")
        if not 512 <= self.max_preauth_bytes <= 1 * MiB:
            raise ConfigError(f"max_preauth_bytes must be in [512, 1 MiB], got {self.max_preauth_bytes}")
        if self.max_frame_bytes < 4096:
            raise ConfigError(f"max_frame_bytes must be >= 4096, got {self.max_frame_bytes}")
        if self.max_inflight_bytes and self.max_inflight_bytes < 2 * self.max_frame_bytes:
            raise ConfigError("max_inflight_bytes must be 0 or >= 2 x max_frame_bytes (so acknowledgements "
                              f"keep flowing), got {self.max_inflight_bytes} and {self.max_frame_bytes}")
        if not 1 <= self.max_runs_per_frame <= 65536:
            raise ConfigError(f"max_runs_per_frame must be in [1, 65536], got {self.max_runs_per_frame}")
        if self.socket_buffer_bytes < 0:
            raise ConfigError(f"socket_buffer_bytes must be >= 0, got {self.socket_buffer_bytes}")
        if self.tcp_congestion is not None:
            check_tcp_congestion(self.tcp_congestion)
        if not self.payload_macs and self.tls is None:
            raise ConfigError("payload_macs=False needs tls (TLS then authenticates the payload bytes)")

    @property
    def offload_macs(self) -> bool:
        """Whether payload MACs are computed on a helper thread (``mac_offload`` resolved)."""
        return self.mac_offload if self.mac_offload is not None else usable_cores() >= MAC_OFFLOAD_MIN_CORES

    @property
    def ack_every_bytes(self) -> int:
        """How often the receiver must acknowledge (0: never); announced in the handshake."""
        return self.max_inflight_bytes // 4

    def message_deadline_s(self, nbytes: int) -> float:
        """How long a message of ``nbytes`` may take to arrive once it started."""
        return max(self.message_timeout_s, nbytes / self.message_min_bytes_per_s)


def new_epoch() -> Epoch:
    """A fresh epoch: nanoseconds since the Unix epoch.

    A restarted worker therefore has a larger epoch than its previous incarnation (two calls take
    longer than a nanosecond, so two incarnations never share one).
    """
    return Epoch(time.time_ns())
