"""Credit: decode-worker blocks this router books in chunks ahead of need, to admit in memory.

Booking every request on its own costs a Redis round trip before any work starts. So while a
decode worker is lightly booked, this router books *credit* on it ahead of need: chunks of
``credit_fraction`` of its pool, under the same atomic script and leases as any booking, only
while the worker's bookings from every router stay within ``credit_limit`` of its pool. A request
that fits in this router's unused credit is admitted in memory, without a round trip; credit is
topped up in the background and given back once unused for ``credit_idle_s``, at once when a
request waits for room, and books no more for ``credit_yield_s`` after another router asked for
room. Every block a request uses is still booked in Redis before the request starts, so routers
sharing one Redis never book more than a worker has; near full, the chunks are refused and every
request is booked on its own.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections.abc import Callable, Iterator, Sequence

from pdrouter.core.aio import BackgroundTasks
from pdrouter.core.errors import CapacityError
from pdrouter.router.admission.config import AdmissionConfig
from pdrouter.state.reservations import BookingId, DecodeCapacity, KvReservations, Reservation

log = logging.getLogger(__name__)


class WorkerCredit:
    """This router's credit on one decode worker incarnation: booked chunks, and what is in use."""

    __slots__ = ("chunk_blocks", "chunks", "held", "idle_timer", "refused_until", "topping_up", "used", "worker")

    def __init__(self, worker: DecodeCapacity, chunk_blocks: int) -> None:
        self.worker = worker
        self.chunk_blocks = chunk_blocks  # one chunk of credit on this worker: credit_fraction of its pool
        self.chunks: list[Reservation] = []
        self.held = 0
        self.used = 0
        self.topping_up = False
        self.refused_until = 0.0
        self.idle_timer: asyncio.TimerHandle | None = None

    @property
    def free(self) -> int:
        return self.held - self.used


class CreditBook:
    """This router's credit on every decode worker it was offered, and the requests admitted from it.

    ``take`` admits a request from unused credit in memory (or says None: book it on its own) and
    tops credit up in the background when less than half a chunk is left; ``repay`` gives back the
    blocks a running request no longer needs, ``settle`` those of a request that ended. Credit
    over two chunks beyond what is in use goes back as soon as requests end; all unused credit on
    a worker goes back once nothing has used it for ``credit_idle_s``; ``give_back_unused`` sends
    it back at once, ``yield_to_others`` too and books none for ``credit_yield_s``. No chunk is
    booked while ``someone_waits()`` (a request of this router waits for room), and one that lands
    then goes straight back. Bookings and releases run as tasks of ``tasks``; a chunk booked
    carries a booking id starting with ``owner``; a request lent credit is known by the booking id
``Admission`` gave it. ``chunks`` and ``lapsed`` let the lease
    renewer keep the chunks alive and forget one Redis no longer holds.
    """

    def __init__(self, reservations: KvReservations, config: AdmissionConfig, owner: str, tasks: BackgroundTasks,
                 someone_waits: Callable[[], bool]) -> None:
        self.reservations = reservations
        self.config = config
        self.owner = owner
        self._tasks = tasks
        self._someone_waits = someone_waits
        self._credits: dict[tuple[str, int], WorkerCredit] = {}
        self._lent: dict[BookingId, WorkerCredit] = {}
        self._seq = itertools.count()
        self._paused_until = 0.0  # another router asked for room: no top-ups until then

    @property
    def held_blocks(self) -> int:
        """Blocks held as credit now (booked in Redis), used or not."""
        return sum(c.held for c in self._credits.values())

    def lends(self, booking_id: BookingId) -> bool:
        """Whether ``booking_id`` was admitted on credit and has not been settled."""
        return booking_id in self._lent

    def take(self, booking_id: BookingId, blocks: int, candidates: Sequence[DecodeCapacity]) -> Reservation | None:
        """Admit from this router's unused credit (no round trip), or None; tops credit up."""
        best: WorkerCredit | None = None
        best_free = 0
        credits = self._credits
        for cand in candidates:
            credit = credits.get((cand.worker_id, cand.epoch))
            if credit is None:
                credit = credits[(cand.worker_id, cand.epoch)] = WorkerCredit(cand, self._chunk_of(cand))
            free = credit.held - credit.used
            if free >= blocks and (best is None or free > best_free):
                best, best_free = credit, free
            if free * 2 < credit.chunk_blocks and not credit.topping_up:  # else ``_maybe_top_up`` books none
                self._maybe_top_up(credit)
        if best is None:
            return None
        best.used += blocks
        if best.idle_timer is not None:
            best.idle_timer.cancel()
            best.idle_timer = None
        if (best_free - blocks) * 2 < best.chunk_blocks and not best.topping_up:
            self._maybe_top_up(best)
        res = Reservation(booking_id, best.worker.worker_id, best.worker.epoch, blocks, self.config.lease_ms)
        self._lent[booking_id] = best
        return res

    def repay(self, booking_id: BookingId, blocks: int) -> None:
        """A request on credit (``lends``) needs ``blocks`` fewer now; they return to the credit."""
        credit = self._lent[booking_id]
        credit.used -= blocks
        self._after_release(credit)

    def settle(self, booking_id: BookingId, blocks: int) -> None:
        """A request on credit (``lends``) ended; the ``blocks`` it still used return to the credit."""
        credit = self._lent.pop(booking_id)
        credit.used -= blocks
        self._after_release(credit)

    def give_back_unused(self) -> None:
        """Send back every chunk not needed for what is in use, at once (someone waits for room)."""
        for credit in self._credits.values():
            self._give_back(credit, keep=credit.used, urgent=True)

    def yield_to_others(self) -> None:
        """Another router's request waits for room: give unused credit back, book none for a while."""
        self._paused_until = time.monotonic() + self.config.credit_yield_s
        self.give_back_unused()

    def give_back_all(self) -> None:
        """Send back every chunk, used or not, at once (shutdown)."""
        for credit in list(self._credits.values()):
            self._give_back(credit, keep=0, urgent=True)

    def chunks(self) -> Iterator[Reservation]:
        """Every chunk held, for lease renewal (each worker's chunks read as it is reached)."""
        for credit in list(self._credits.values()):
            yield from list(credit.chunks)

    def lapsed(self, chunk: Reservation) -> None:
        """Redis no longer holds ``chunk`` (expired, or Redis lost its data): stop counting it."""
        credit = self._credits.get((chunk.worker_id, chunk.epoch))
        if credit is not None and chunk in credit.chunks:
            log.warning("credit %s on %s expired; no longer counted", chunk.booking_id, chunk.worker_id)
            credit.chunks.remove(chunk)
            credit.held -= chunk.blocks

    def _chunk_of(self, worker: DecodeCapacity) -> int:
        return max(1, int(worker.capacity_blocks * self.config.credit_fraction))

    def _maybe_top_up(self, credit: WorkerCredit) -> None:
        """Book another chunk when less than half a chunk is left unused (one booking at a time)."""
        if credit.topping_up or credit.free * 2 >= credit.chunk_blocks or self._someone_waits():
            return
        now = time.monotonic()
        if now < credit.refused_until or now < self._paused_until:
            return
        credit.topping_up = True
        self._tasks.spawn(self._top_up(credit))

    async def _top_up(self, credit: WorkerCredit) -> None:
        cfg, worker = self.config, credit.worker
        chunk = credit.chunk_blocks
        # The limit is the script's capacity check: the chunk is booked only if the worker's
        # bookings from every router stay within credit_limit of its pool.
        limit = DecodeCapacity(worker.worker_id, worker.epoch, int(worker.capacity_blocks * cfg.credit_limit))
        try:
            res = await self.reservations.reserve(BookingId(f"{self.owner}{next(self._seq)}"), chunk, [limit],
                                                  cfg.lease_ms)
        except CapacityError:
            credit.refused_until = time.monotonic() + cfg.poll_interval_s * 5
            return
        except Exception as exc:  # Redis trouble: requests are booked on their own meanwhile
            log.debug("credit top-up on %s failed: %s", worker.worker_id, exc)
            credit.refused_until = time.monotonic() + cfg.poll_interval_s * 5
            return
        finally:
            credit.topping_up = False
        if self._credits.get((worker.worker_id, worker.epoch)) is not credit or self._someone_waits() \
                or time.monotonic() < self._paused_until:
            # Stopped or forgotten meanwhile, or a request (here or on another router) now waits
            # for room: the chunk goes straight back.
            self._tasks.spawn(self.reservations.release(res, urgent=True))
            return
        credit.chunks.append(res)
        credit.held += res.blocks
        if credit.used == 0:
            self._arm_idle(credit)

    def _after_release(self, credit: WorkerCredit) -> None:
        chunk = credit.chunk_blocks
        if credit.free > 2 * chunk:
            self._give_back(credit, keep=credit.used + chunk, urgent=False)
        if credit.used == 0:
            self._arm_idle(credit)

    def _arm_idle(self, credit: WorkerCredit) -> None:
        if credit.idle_timer is None:
            credit.idle_timer = asyncio.get_running_loop().call_later(self.config.credit_idle_s, self._idle, credit)

    def _idle(self, credit: WorkerCredit) -> None:
        credit.idle_timer = None
        if credit.used == 0:
            self._give_back(credit, keep=0, urgent=False)
            if not credit.chunks and not credit.topping_up:
                key = (credit.worker.worker_id, credit.worker.epoch)
                if self._credits.get(key) is credit:
                    del self._credits[key]

    def _give_back(self, credit: WorkerCredit, keep: int, urgent: bool) -> None:
        """Release whole chunks (largest first) while at least ``keep`` blocks stay held."""
        for chunk in sorted(credit.chunks, key=lambda c: -c.blocks):
            if credit.held - chunk.blocks >= keep:
                credit.chunks.remove(chunk)
                credit.held -= chunk.blocks
                self._tasks.spawn(self.reservations.release(chunk, urgent=urgent))
