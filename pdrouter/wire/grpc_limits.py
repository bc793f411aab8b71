"""The limits of every gRPC server (the router's door, every worker's port): :class:`GrpcLimits`.

Each limit is one of grpc's own server options (or, for the calls in flight, grpc.aio's
``maximum_concurrent_rpcs``), so grpc's transport enforces it before any Python code runs:

* **handshake deadline** (``handshake_timeout_s``, ``grpc.server_handshake_timeout_ms``, grpc's
  default 120 s): a connection must finish its TLS handshake and the HTTP/2 preface within this
  long of opening, however its bytes trickle; else it is closed;
* **idle deadline** (``idle_timeout_s``, ``grpc.max_connection_idle_ms``): a connection with no call
  for this long is sent a GOAWAY and closed (a client's channel reconnects on its next call);
* **connection age** (``max_connection_age_s`` and ``max_connection_age_grace_s``,
  ``grpc.max_connection_age_ms`` / ``_grace_ms``): a connection is sent a GOAWAY this long after it
  opened; its calls in progress get the grace to finish, then it is closed;
* **connections** (``max_connections``, ``grpc.max_allowed_incoming_connections``): a connection
  past the cap is closed as soon as it is accepted, before anything of it is read;
* **streams per connection** (``max_streams``, ``grpc.max_concurrent_streams``): announced in the
  server's HTTP/2 settings; a client's further calls wait in the client for a free stream;
* **calls in flight** (``max_inflight``, ``maximum_concurrent_rpcs``; None: no cap): a call past it
  ends RESOURCE_EXHAUSTED at once;
* **memory per call** (``max_message_bytes``, ``grpc.max_receive_message_length``;
  ``max_metadata_bytes``, ``grpc.max_metadata_size``): a larger request message ends
  RESOURCE_EXHAUSTED, larger headers end the call (INTERNAL) before any handler runs. A connection
  so holds at most ``max_streams`` calls of ``max_message_bytes`` and ``max_metadata_bytes`` each.

Credentials are checked on the headers, before any byte of a request message is read
(``pdrouter.wire.security.refusal``): a caller without them costs its headers and nothing more.
``docs/limits.md`` has the table of flags and defaults.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from pdrouter.core.errors import ConfigError

MiB = 1 << 20


@dataclass(frozen=True)
class GrpcLimits:
    """What one gRPC server lets each peer take (see the module docstring). The defaults are a
    worker port's; :meth:`for_door` gives the router's front door its own."""

    handshake_timeout_s: float = 5.0
    idle_timeout_s: float = 30.0
    max_connection_age_s: float = 3600.0
    max_connection_age_grace_s: float = 600.0
    max_connections: int = 1024
    max_streams: int = 1024
    max_inflight: int | None = None
    max_message_bytes: int = 64 * MiB
    max_metadata_bytes: int = 16 * 1024

    def __post_init__(self) -> None:
        for name in ("handshake_timeout_s", "idle_timeout_s", "max_connection_age_s", "max_connection_age_grace_s"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and value > 0 and value < 1e9):
                raise ConfigError(f"gRPC limit {name} must be > 0 seconds, got {value!r}")
        for name in ("max_connections", "max_streams", "max_message_bytes", "max_metadata_bytes"):
            value = getattr(self, name)
            if not isinstance(value, int) or not 0 < value < 1 << 31:
                raise ConfigError(f"gRPC limit {name} must be a whole number in [1, 2^31), got {value!r}")
        inflight = self.max_inflight
        if inflight is not None and (not isinstance(inflight, int) or inflight < 1):
            raise ConfigError(f"gRPC limit max_inflight must be a whole number >= 1 (or None), got {inflight!r}")
        if self.max_metadata_bytes < 1024:
            raise ConfigError(f"gRPC limit max_metadata_bytes must be at least 1024, got {self.max_metadata_bytes}")

    @classmethod
    def for_door(cls, max_message_bytes: int = 16 * MiB) -> GrpcLimits:
        """The router's front door: requests of at most ``max_message_bytes`` (the HTTP door's body
        limit), 256 streams per connection, 512 calls at once (as the HTTP door's requests)."""
        return cls(max_streams=256, max_inflight=512, max_message_bytes=max_message_bytes)

    def with_message_bytes(self, max_message_bytes: int) -> GrpcLimits:
        return replace(self, max_message_bytes=max_message_bytes)

    def options(self) -> list[tuple[str, Any]]:
        """grpc server options enforcing these limits (all but ``max_inflight``)."""
        return [
            ("grpc.server_handshake_timeout_ms", _ms(self.handshake_timeout_s)),
            ("grpc.max_connection_idle_ms", _ms(self.idle_timeout_s)),
            ("grpc.max_connection_age_ms", _ms(self.max_connection_age_s)),
            ("grpc.max_connection_age_grace_ms", _ms(self.max_connection_age_grace_s)),
            ("grpc.max_allowed_incoming_connections", self.max_connections),
            ("grpc.max_concurrent_streams", self.max_streams),
            ("grpc.max_receive_message_length", self.max_message_bytes),
            ("grpc.max_metadata_size", self.max_metadata_bytes),
            ("grpc.absolute_max_metadata_size", self.max_metadata_bytes),
        ]


def _ms(seconds: float) -> int:
    return max(1, round(seconds * 1000))
