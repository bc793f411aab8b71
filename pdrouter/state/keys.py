"""The Redis key layout, in one place."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class PoolKeys:
    """Keys of one pool (one model); all carry the same hash tag."""

    namespace: str
    pool: str

    @property
    def tag(self) -> str:
        return f"{self.namespace}:{{{self.pool}}}"

    @property
    def workers(self) -> str:
        """Hash worker_id → WorkerRecord JSON."""
        return f"{self.tag}:workers"

    def heartbeat(self, worker_id: str) -> str:
        """String with a TTL: ``<epoch> <load JSON>``; absent = the worker is not live."""
        return f"{self.tag}:hb:{worker_id}"

    @property
    def credit_wanted(self) -> str:
        """Pub/sub channel: a router has a request waiting for KV room (routers holding credit
        give back what they do not use)."""
        return f"{self.tag}:credit-wanted"

    @property
    def epoch_counter(self) -> str:
        """INCR counter handing out strictly increasing worker epochs."""
        return f"{self.tag}:epoch"

    def prefix_set(self, worker_id: str, epoch: int) -> str:
        """Set of the chained block hashes one worker incarnation holds (expires unless refreshed)."""
        return f"{self.tag}:px:{worker_id}:{epoch}"

    @property
    def prefix_set_pattern(self) -> str:
        return f"{self.tag}:px:*"

    def kv_bookings(self, worker_id: str, epoch: int) -> str:
        """Hash booking id (router-assigned) → booked blocks on one decode worker incarnation."""
        return f"{self.tag}:kv:book:{worker_id}:{epoch}"

    def kv_leases(self, worker_id: str, epoch: int) -> str:
        """Sorted set booking id → lease expiry (ms, Redis clock) for the same bookings."""
        return f"{self.tag}:kv:lease:{worker_id}:{epoch}"

    def kv_used(self, worker_id: str, epoch: int) -> str:
        """Integer: blocks booked on one decode worker incarnation (sum of the bookings hash)."""
        return f"{self.tag}:kv:used:{worker_id}:{epoch}"
