"""The limits a ``LaneServer`` holds its peers to: :class:`LaneLimits` (``docs/limits.md``)."""

from __future__ import annotations

from dataclasses import dataclass

from pdrouter.core.errors import ConfigError
from pdrouter.wire.lane.frames import HEADER, MAX_BODY, PROOF_SIZE


@dataclass(frozen=True)
class LaneLimits:
    """What one lane connection may take of a worker.

    * ``handshake_timeout_s``: the greeting (and, with a token, the proof) must be done this long
      after the connection opened (with TLS: after the TLS handshake, which has as long again);
      else the connection is closed;
    * ``frame_timeout_s`` / ``frame_min_rate_bps``: a frame, from its first byte, must be complete
      within ``max(frame_timeout_s, frame size / frame_min_rate_bps)``; bytes trickling in do not
      move that deadline. Past it the connection is closed (its calls fail with UNAVAILABLE);
    * ``max_connections``: open connections; one more is refused (UNAVAILABLE, with a reason) unless
      one that has not proved the token can be closed for it;
    * ``max_unauthenticated_connections``: connections that have not proved the token yet (None: a
      quarter of ``max_connections``); past it the oldest of them is closed, so that connections
      without the token can never take all of ``max_connections``;
    * ``max_buffered_bytes``: bytes of an incomplete frame a connection may hold, so also the
      largest frame it may send (header included); ``max_preauth_bytes``: the same before the
      connection has proved the token (the proof is 48 bytes). A larger frame closes the connection.
    """

    handshake_timeout_s: float = 5.0
    frame_timeout_s: float = 10.0
    frame_min_rate_bps: int = 1 << 20
    max_connections: int = 256
    max_buffered_bytes: int = HEADER.size + MAX_BODY
    max_preauth_bytes: int = 4096
    max_unauthenticated_connections: int | None = None

    def __post_init__(self) -> None:
        for name in ("handshake_timeout_s", "frame_timeout_s"):
            value = getattr(self, name)
            if not value > 0:
                raise ConfigError(f"lane limit {name} must be > 0 seconds, got {value!r}")
        for name in ("frame_min_rate_bps", "max_connections", "max_buffered_bytes", "max_preauth_bytes"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ConfigError(f"lane limit {name} must be a whole number > 0, got {value!r}")
        budget = self.max_unauthenticated_connections
        if budget is not None and (not isinstance(budget, int) or not 1 <= budget <= self.max_connections):
            raise ConfigError(f"lane limit max_unauthenticated_connections must be a whole number in [1, "
                              f"max_connections = {self.max_connections}], got {budget!r}")
        least, most = HEADER.size + PROOF_SIZE, HEADER.size + MAX_BODY
        if not least <= self.max_preauth_bytes <= self.max_buffered_bytes <= most:
            raise ConfigError(f"lane limits need {least} <= max_preauth_bytes <= max_buffered_bytes <= {most}, "
                              f"got {self.max_preauth_bytes} and {self.max_buffered_bytes}")

    @property
    def unauthenticated_budget(self) -> int:
        """Connections that may be open without having proved the token."""
        given = self.max_unauthenticated_connections
        return max(1, self.max_connections // 4) if given is None else given

    @property
    def max_body(self) -> int:
        """The largest frame body an authenticated connection may send."""
        return self.max_buffered_bytes - HEADER.size

    @property
    def max_preauth_body(self) -> int:
        """The largest frame body before the proof."""
        return self.max_preauth_bytes - HEADER.size
