"""Slow-client and overload limits of the router's HTTP doors (the API door and the metrics listener).

:class:`HttpLimits` is one frozen value, carried by ``RouterConfig.http_limits`` and handed to
``pdrouter.router.frontdoor.http_server.make_server``; ``docs/limits.md`` lists every limit with its flag,
its default and what a client sees when it is reached. The server enforces them so:

* **header read timeout** (``header_timeout_s``): a request's head (request line and headers) must
  be complete this long after the connection opened, or after the first byte of a request on a
  kept-alive connection. Bytes arriving slowly do not extend it. Past it: ``408`` when part of a
  request had come, else the connection is simply closed;
* **body read timeout** (``body_timeout_s``, ``body_min_rate_bps``): a body of S bytes must have
  arrived ``max(body_timeout_s, S / body_min_rate_bps)`` seconds after its head completed
  (S: the bytes received so far, so a body keeps its time only by arriving at the minimum rate on
  average). Past it: ``408`` (before any response) and the connection is closed, dropping what
  was buffered;
* **keep-alive idle timeout** (``idle_timeout_s``, uvicorn's ``timeout_keep_alive``): a kept-alive
  connection with no request for this long is closed;
* **header size cap** (``max_header_bytes``): a head larger than this is answered ``431``;
* **connection cap** (``max_connections``): a connection past it is answered ``503`` with
  ``Retry-After`` at once, without reading its request, and closed;
* **in-flight cap** (``max_inflight``): a request arriving while this many are being served (from
  their head to the end of their response) is answered ``503`` with ``Retry-After``, and its
  connection is closed;
* **budget of unauthenticated connections** (``max_unauthenticated_connections``, default half the
  connection cap): connections that have not yet sent a request with an accepted API key (on a door
  without keys: no request yet). Past it, and when the connection cap is reached, the oldest of them
  is closed (``503`` if it had begun a request) to make room, so that clients with a key always
  get in: idle or trickling connections without one cannot fill the door.

Every error answer has an OpenAI-shaped JSON body (``{"error": {"message", "type", "param",
"code"}}``) and ``connection: close``.
"""

from __future__ import annotations

from dataclasses import dataclass

from pdrouter.core.errors import ConfigError


@dataclass(frozen=True)
class HttpLimits:
    """The limits of one HTTP door (see the module docstring for what each one does)."""

    header_timeout_s: float = 10.0
    """A request's head must be complete within this long of the connection's (or request's) start."""
    body_timeout_s: float = 30.0
    """A request body has at least this long to arrive, measured from the end of its head."""
    body_min_rate_bps: int = 256 * 1024
    """Past ``body_timeout_s``, a body keeps going only while it has averaged this many bytes a second."""
    idle_timeout_s: float = 5.0
    """A kept-alive connection with no request for this long is closed."""
    max_header_bytes: int = 64 * 1024
    """The largest request head (request target and header lines) accepted; larger ones get 431."""
    max_connections: int = 1024
    """Open connections of the door; one more is answered 503 and closed."""
    max_inflight: int = 512
    """Requests being served at once by the door; one more is answered 503 and its connection closed."""
    retry_after_s: int = 1
    """The ``Retry-After`` of the 503 answers."""
    unauthenticated_connections: int | None = None
    """Connections that have not proved their client; past it the oldest is closed (None: half of
    ``max_connections``, at least 1)."""

    @property
    def max_unauthenticated_connections(self) -> int:
        given = self.unauthenticated_connections
        return max(1, self.max_connections // 2) if given is None else given

    def __post_init__(self) -> None:
        for name in ("header_timeout_s", "body_timeout_s", "idle_timeout_s"):
            value = getattr(self, name)
            if not value > 0:
                raise ConfigError(f"HTTP limit {name} must be > 0 seconds, got {value!r}")
        for name in ("body_min_rate_bps", "max_header_bytes", "max_connections", "max_inflight"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ConfigError(f"HTTP limit {name} must be a whole number > 0, got {value!r}")
        if self.max_header_bytes < 1024:
            raise ConfigError(f"HTTP limit max_header_bytes must be at least 1024, got {self.max_header_bytes}")
        given = self.unauthenticated_connections
        if given is not None and (not isinstance(given, int) or not 1 <= given <= self.max_connections):
            raise ConfigError(f"HTTP limit unauthenticated_connections must be a whole number in [1, max_connections "
                              f"= {self.max_connections}], got {given!r}")
        if not isinstance(self.retry_after_s, int) or self.retry_after_s < 0:
            raise ConfigError(f"HTTP limit retry_after_s must be a whole number >= 0, got {self.retry_after_s!r}")
