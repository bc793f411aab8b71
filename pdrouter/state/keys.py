"""The Redis key layout, in one place.

Every key of a pool carries a hash tag, so each script and multi-key command touches one slot:

* ``<ns>:{<pool>}:…`` — the registry (``workers``, ``hb:*``, ``epoch``), the prefix index (``px:*``,
  ``pxb:*``, ``pxlive``, ``pxslots``, ``pxfree``) and the ``credit-wanted`` channel;
* the KV bookings (``kv:book:*``, ``kv:lease:*``, ``kv:used:*``): under the same tag on one Redis,
  and under a tag of their own, ``<ns>:{<pool>#kv}:kv:…``, with ``bookings_apart`` (what the state
  classes pick on a Redis Cluster), so a cluster can serve a pool's bookings and the rest of the
  pool from two shards.

What must stay in one slot: all bookings of a pool (one booking script drops expired leases on,
and picks among, every candidate decode worker of the pool at once), and the whole prefix index
(a lookup reads the per-block sets of every block of a prompt in one script, a write updates the
liveness set, the incarnation's own set and the block sets together). No script touches keys of
both, so the two can live apart. On one Redis the tag does nothing, and the bookings keep the
names they always had (routers of two versions sharing one Redis keep one ledger). See
docs/scale.md, "Redis Cluster".

Tenants' limits (``TenantKeys``, ``pdrouter.state.tenant_limits``) are per tenant, not per pool (a
tenant's budget is one across every model of the namespace): ``<ns>:tenant:{<tenant>}:…``, one
hash tag per tenant, so the one script a request runs touches one slot, and tenants spread over a
cluster's shards. Their names start ``<ns>:tenant:``, never ``<ns>:{``, so no pattern of a pool's
keys matches them (nor the reverse), whatever the names of pools and tenants.
"""

from __future__ import annotations

from dataclasses import dataclass

BOOKINGS_TAG_SUFFIX = "#kv"
"""Appended to the pool's name in the hash tag of its bookings when they live apart."""


@dataclass(frozen=True)
class PoolKeys:
    """Keys of one pool (one model). ``bookings_apart``: the bookings carry a hash tag of their own
    (``bookings_tag``); otherwise every key carries ``tag``."""

    namespace: str
    pool: str
    bookings_apart: bool = False

    @property
    def tag(self) -> str:
        """The prefix of the registry's, the prefix index's and the channel's names: ``<ns>:{<pool>}``."""
        return f"{self.namespace}:{{{self.pool}}}"

    @property
    def bookings_tag(self) -> str:
        """The prefix of the bookings' names: ``<ns>:{<pool>#kv}`` when apart, else ``tag``."""
        if self.bookings_apart:
            return f"{self.namespace}:{{{self.pool}{BOOKINGS_TAG_SUFFIX}}}"
        return self.tag

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
        """Bitmap of the slots (``prefix_slots``) of the incarnations holding the block: bit ``s``
        (``SETBIT``/``GETBIT`` offset) is set when slot ``s``'s incarnation holds it."""
        return self.prefix_block_prefix.encode() + block_hash

    @property
    def prefix_live(self) -> str:
        """Sorted set ``<incarnation>`` → liveness deadline (ms, Redis clock) of the incarnations in
        the prefix index, pushed on by every write and touch."""
        return f"{self.tag}:pxlive"

    @property
    def prefix_slots(self) -> str:
        """Hash of the index's slots: ``<incarnation>`` → slot, ``#<slot>`` → ``<version>:<incarnation>``
        (the version it was given at), ``~next`` (the next slot never used) and ``~ver`` (grows
        whenever a slot is given or freed)."""
        return f"{self.tag}:pxslots"

    @property
    def prefix_free(self) -> str:
        """Sorted set of the freed slots (score: the slot), given out again lowest first."""
        return f"{self.tag}:pxfree"

    def kv_bookings(self, worker_id: str, epoch: int) -> str:
        """Hash booking id (router-assigned) → booked blocks on one decode worker incarnation."""
        return f"{self.bookings_tag}:kv:book:{worker_id}:{epoch}"

    def kv_leases(self, worker_id: str, epoch: int) -> str:
        """Sorted set booking id → lease expiry (ms, Redis clock) for the same bookings."""
        return f"{self.bookings_tag}:kv:lease:{worker_id}:{epoch}"

    def kv_used(self, worker_id: str, epoch: int) -> str:
        """Integer: blocks booked on one decode worker incarnation (sum of the bookings hash)."""
        return f"{self.bookings_tag}:kv:used:{worker_id}:{epoch}"


@dataclass(frozen=True)
class TenantKeys:
    """Keys of one tenant's limits (``pdrouter.state.tenant_limits``), all under the tag ``{<tenant>}``."""

    namespace: str
    tenant: str

    @property
    def tag(self) -> str:
        """``<ns>:tenant:{<tenant>}``."""
        return f"{self.namespace}:tenant:{{{self.tenant}}}"

    @staticmethod
    def pattern(namespace: str) -> str:
        """Every tenant key of ``namespace`` (the ACL pattern of the router's user)."""
        return f"{namespace}:tenant:*"

    @property
    def window(self) -> str:
        """Sorted set: one member per request admitted in the last minute (``<booking>|<prompt
        tokens>|<output tokens>``), scored by its admission time (ms, Redis clock)."""
        return f"{self.tag}:window"

    @property
    def totals(self) -> str:
        """Hash of the window's token sums: ``p`` prompt tokens, ``o`` output tokens."""
        return f"{self.tag}:totals"

    @property
    def running(self) -> str:
        """Sorted set: the tenant's requests being served (booking → lease expiry, ms, Redis clock)."""
        return f"{self.tag}:running"
