"""Admission settings and counters, shared by the parts of ``pdrouter.router.admission``."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Literal

from pdrouter.core.errors import ConfigError


@dataclass(frozen=True)
class AdmissionConfig:
    queue_limit: int = 1024
    """Requests that may wait for KV room at once; beyond it they are refused immediately."""
    queue_timeout_s: float = 10.0
    """Longest wait for room before RESOURCE_EXHAUSTED."""
    lease_ms: int = 30_000
    """Bookings expire this long after their last renewal (a crashed router's come back)."""
    poll_interval_s: float = 0.02
    """How often a waiting request retries (other routers' releases are not signalled)."""
    retry_after_s: int = 1
    credit_fraction: float = 0.05
    """Size of one credit chunk as a fraction of a decode worker's pool (0: book every request alone)."""
    credit_limit: float = 0.5
    """Credit is booked only while a worker's bookings (all routers) stay within this fraction of it."""
    credit_idle_s: float = 1.0
    """Unused credit on a worker whose requests all ended this long ago goes back."""
    credit_yield_s: float = 1.0
    """After another router asked for room, this router books no credit for this long."""
    fair_headroom: float = 0.05
    """With tenants: the fraction of each decode worker's pool that a tenant with a backlog past its
    share by more than its burst credit (more than ``fair_burst`` of its requests waiting here, or
    one turned away by a full queue in the window) may not book while another tenant has been
    active in the last ``fair_window_s``. So a tenant sending at its fair share
    beside a flood finds room at once, not at the next request's end (0: no headroom). A tenant
    alone books the whole pool."""
    fair_headroom_requests: float = 0.0
    """With tenants: the headroom counted in requests instead: room for this many requests (each the
    largest of the other active tenants' last requests, of its class or a higher one) is held back
    the same way, when that is more than ``fair_headroom`` (0: the fraction alone)."""
    fair_window_s: float = 10.0
    fair_burst: float = 8.0
    """With tenants: how many of its requests a tenant that has been asking for less than its fair
    share may have admitted ahead of the others' backlogs (see ``queue``)."""
    on_redis_error: Literal["fail", "local"] = "fail"
    """When a booking fails because Redis cannot be reached: ``fail`` refuses the request
    (UNAVAILABLE / HTTP 503); ``local`` places it by load alone, without shared admission (each
    decode worker still guards its own pool)."""

    def __post_init__(self) -> None:
        if self.queue_limit < 0 or self.queue_timeout_s < 0 or self.lease_ms <= 0 or self.poll_interval_s <= 0:
            raise ConfigError("admission: queue_limit and queue_timeout_s must be >= 0, lease and poll > 0")
        if not (0.0 <= self.credit_fraction <= self.credit_limit <= 1.0) or self.credit_idle_s <= 0 \
                or self.credit_yield_s < 0:
            raise ConfigError("admission: need 0 <= credit_fraction <= credit_limit <= 1, credit_idle_s > 0 "
                              "and credit_yield_s >= 0")
        if not 0.0 <= self.fair_headroom < 1.0 or self.fair_headroom_requests < 0 or self.fair_window_s <= 0:
            raise ConfigError(f"admission: fair_headroom must be in [0, 1), fair_headroom_requests >= 0 and "
                              f"fair_window_s > 0, got {self.fair_headroom:g}, {self.fair_headroom_requests:g} "
                              f"and {self.fair_window_s:g}")
        if self.fair_burst < 0:
            raise ConfigError(f"admission: fair_burst must be >= 0, got {self.fair_burst:g}")
        if self.on_redis_error not in ("fail", "local"):
            raise ConfigError(f"admission: on_redis_error must be fail or local, got {self.on_redis_error!r}")


class AdmissionStats:
    def __init__(self) -> None:
        self.admitted = 0
        self.admitted_on_credit = 0
        """Of ``admitted``: in memory, from credit this router had booked (no Redis round trip)."""
        self.rejections: Counter[str] = Counter()
        self.wait_seconds_total = 0.0
        self.max_queue = 0
