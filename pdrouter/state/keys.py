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
        """Set of the chained block hashes one worker incarnation holds (its own record in the prefix index)."""
        return f"{self.tag}:px:{worker_id}:{epoch}"

    @property
    def prefix_set_pattern(self) -> str:
        return f"{self.tag}:px:*"

    @property
    def prefix_set_prefix(self) -> str:
        """``prefix_set(w, e)`` is this followed by the incarnation name ``incarnation(w, e)``."""
        return f"{self.tag}:px:"

    @staticmethod
    def incarnation(worker_id: str, epoch: int) -> str:
        """The name of one worker incarnation in the prefix index: ``<worker_id>:<epoch>``."""
        return f"{worker_id}:{epoch}"

    @property
    def prefix_block_prefix(self) -> str:
        """The key of one block in the prefix index is this followed by the block's raw hash bytes."""
        return f"{self.tag}:pxb:"

    def prefix_block(self, block_hash: bytes) -> bytes:
        """Set of the member ids (integers, ``PrefixIndex.member_id``) of the incarnations holding the block."""
        return self.prefix_block_prefix.encode() + block_hash

    @property
    def prefix_live(self) -> str:
        """Sorted set ``<member id>:<incarnation>`` → liveness deadline (ms, Redis clock) of the
        incarnations in the prefix index, pushed on by every write and touch."""
        return f"{self.tag}:pxlive"

    def kv_bookings(self, worker_id: str, epoch: int) -> str:
        """Hash booking id (router-assigned) → booked blocks on one decode worker incarnation."""
        return f"{self.tag}:kv:book:{worker_id}:{epoch}"

    def kv_leases(self, worker_id: str, epoch: int) -> str:
        """Sorted set booking id → lease expiry (ms, Redis clock) for the same bookings."""
        return f"{self.tag}:kv:lease:{worker_id}:{epoch}"

    def kv_used(self, worker_id: str, epoch: int) -> str:
        """Integer: blocks booked on one decode worker incarnation (sum of the bookings hash)."""
        return f"{self.tag}:kv:used:{worker_id}:{epoch}"
