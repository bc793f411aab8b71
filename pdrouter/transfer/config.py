"""Transport configuration (one frozen object per worker) and process epochs."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from enum import StrEnum

from pdrouter.core.errors import ConfigError
from pdrouter.core.ids import Epoch

MiB = 1 << 20


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


@dataclass(frozen=True)
class TransferConfig:
    """Everything a sender or receiver needs besides the pool: identity, limits and timeouts.

    ``epoch`` is this process's incarnation (``new_epoch()`` once at start-up, also published to
    the registry); ``auth_token`` is shared by every worker of a deployment and never sent on the
    wire (the handshake proves it with an HMAC).
    """

    auth_token: str = field(repr=False)
    epoch: int
    backend: Backend = Backend.TCP
    connect_timeout_s: float = 5.0
    """Connect plus handshake (plus process-group set-up for gloo/NCCL)."""
    progress_timeout_s: float = 10.0
    """The longest a started frame, or bytes in flight, may go without progress."""
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
    checksums: bool = True
    """Per-frame xxh3-64 of the payload (CPU pools only; a CUDA pool's payload is not hashed)."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "backend", Backend(self.backend))
        if not self.auth_token:
            raise ConfigError("kvtransfer needs a non-empty auth token shared by all workers")
        if self.epoch <= 0:
            raise ConfigError(f"epoch must be > 0, got {self.epoch}")
        for name in ("connect_timeout_s", "progress_timeout_s", "abort_grace_s"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.max_frame_bytes < 4096:
            raise ConfigError(f"max_frame_bytes must be >= 4096, got {self.max_frame_bytes}")
        if self.max_inflight_bytes and self.max_inflight_bytes < 2 * self.max_frame_bytes:
            raise ConfigError("max_inflight_bytes must be 0 or >= 2 x max_frame_bytes (so acknowledgements "
                              f"keep flowing), got {self.max_inflight_bytes} and {self.max_frame_bytes}")
        if not 1 <= self.max_runs_per_frame <= 65536:
            raise ConfigError(f"max_runs_per_frame must be in [1, 65536], got {self.max_runs_per_frame}")
        if self.socket_buffer_bytes < 0:
            raise ConfigError(f"socket_buffer_bytes must be >= 0, got {self.socket_buffer_bytes}")

    @property
    def ack_every_bytes(self) -> int:
        """How often the receiver must acknowledge (0: never); announced in the handshake."""
        return self.max_inflight_bytes // 4


def new_epoch() -> Epoch:
    """A fresh epoch: nanoseconds since the Unix epoch.

    A restarted worker therefore has a larger epoch than its previous incarnation (two calls take
    longer than a nanosecond, so two incarnations never share one).
    """
    return Epoch(time.time_ns())
