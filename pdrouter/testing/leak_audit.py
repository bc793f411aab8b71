"""The leak audit: what dead worker incarnations of one pool left behind, counted (the churn test
and benchmark).

Each count must reach zero once the leases and the index's liveness deadlines have passed: the
booking entries, leases and booked blocks of dead decode incarnations, their prefix-index entries
(own sets, liveness members, slots and their bits in the block bitmaps), work still running or blocks
still allocated on the live workers, and blocks booked anywhere. Every count is read through the
module that owns the keys (``KvReservations.holdings``, ``PrefixIndex.footprint``,
``WorkerRegistry.live_workers``); the audit writes nothing.
"""

from __future__ import annotations

from collections.abc import Sequence

from pdrouter.core.workers import WorkerRole
from pdrouter.state.client import RedisClient
from pdrouter.state.prefix_index import PrefixIndex
from pdrouter.state.registry import WorkerRegistry
from pdrouter.state.reservations import BookingHoldings, KvReservations

Incarnation = tuple[str, int]
"""(worker id, epoch)."""


class LeakAudit:
    """Counts, in one pool's state, what the given dead incarnations left behind."""

    def __init__(self, client: RedisClient, pool: str, namespace: str = "pdr") -> None:
        self.reservations = KvReservations(client, pool, namespace)
        self.index = PrefixIndex(client, pool, namespace)
        self.registry = WorkerRegistry(client, pool, namespace)

    async def booking_parts(self, dead: Sequence[Incarnation]) -> BookingHoldings:
        """(booking entries, leases, booked blocks) left on the dead decode incarnations."""
        held = [await self.reservations.holdings(worker, epoch) for worker, epoch in dead]
        return BookingHoldings(*(sum(column) for column in zip(*held, strict=True))) if held \
            else BookingHoldings(0, 0, 0)

    async def dead_bookings(self, dead: Sequence[Incarnation]) -> int:
        """Everything of the dead decode incarnations' bookings: entries, leases and booked blocks together."""
        return sum(await self.booking_parts(dead))

    async def dead_index_entries(self, dead: Sequence[Incarnation]) -> int:
        """Entries of the dead incarnations anywhere in the prefix index."""
        return await self.index.footprint(dead)

    async def count_leftovers(self, dead: Sequence[Incarnation], dead_decode: Sequence[Incarnation]) -> dict[str, int]:
        """``leaked_bookings``, ``dead_index_entries``, ``stranded_work`` (requests running and blocks
        allocated on the live workers) and ``bookings`` (blocks booked on any decode incarnation)."""
        live = await self.registry.live_workers()
        incarnations = [*dead_decode, *((w.record.worker_id, int(w.record.epoch)) for w in live
                                        if w.record.role is WorkerRole.DECODE)]
        return {"leaked_bookings": await self.dead_bookings(dead_decode),
                "dead_index_entries": await self.dead_index_entries(dead),
                "stranded_work": sum(w.load.running + w.load.allocated_blocks for w in live),
                "bookings": sum([(await self.reservations.holdings(w, e)).blocks for w, e in incarnations])}
