"""Lease renewal: this router keeps its bookings alive in Redis while it uses them.

A booking's lease runs out ``lease_ms`` after its last renewal, so a crashed router's blocks come
back on their own; a live router renews every booking it holds three times per lease. A renewal
also extends the TTL of the worker's booking keys (``KvReservations.renew``), so a worker whose
requests all run longer than the keys' TTL keeps its bookings.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Iterable
from typing import Protocol

from pdrouter.core.aio import cancel_and_wait
from pdrouter.state.reservations import Reservation

log = logging.getLogger(__name__)


class Renews(Protocol):
    async def renew(self, reservation: Reservation) -> bool:
        """Extend the lease and the TTL of every key the booking lives in; False when it is gone."""
        ...


class LeaseRenewer:
    """Renews, every ``lease_ms / 3``, the leases of what ``bookings()`` and ``chunks()`` yield.

    ``bookings()`` gives the requests booked on their own and ``chunks()`` the credit chunks; both
    are called afresh on every round and read as the round goes. A chunk whose renewal finds it
    gone is passed to ``lapsed``; a request's booking that is gone is left to its owner. A round
    that fails (Redis down) is logged and the next one tries again: leases may lapse meanwhile,
    and the decode worker still guards its own pool.
    """

    def __init__(self, reservations: Renews, lease_ms: int, bookings: Callable[[], Iterable[Reservation]],
                 chunks: Callable[[], Iterable[Reservation]], lapsed: Callable[[Reservation], None]) -> None:
        self.reservations = reservations
        self.interval_s = lease_ms / 3000
        self._bookings = bookings
        self._chunks = chunks
        self._lapsed = lapsed
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._loop(), name="admission-renew")

    async def stop(self) -> None:
        await cancel_and_wait(self._task)

    async def renew_once(self) -> None:
        """One round: renew every booking, then every chunk (a failure ends the round)."""
        for res in self._bookings():
            await self.reservations.renew(res)
        for chunk in self._chunks():
            if not await self.reservations.renew(chunk):
                self._lapsed(chunk)

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            try:
                await self.renew_once()
            except Exception as exc:  # Redis down: leases may lapse; the worker still guards its pool
                log.warning("lease renewal failed: %s", exc)
