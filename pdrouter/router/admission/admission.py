"""Admission by KV capacity: book a decode worker's blocks before any work starts.

Each request needs ``ceil((prompt + max_tokens) / block_size)`` blocks. ``admit`` books them in
Redis (``pdrouter.state.reservations``: one atomic script, shared by every router replica) on a decode
worker with room, under a lease that this router renews while the request runs. When no worker
has room the request waits in a bounded queue (priority first, then FIFO) until blocks come back
or its queue deadline passes (CapacityError → RESOURCE_EXHAUSTED / HTTP 429 with Retry-After). A
request larger than every worker's whole pool is refused at once (RequestTooLargeError). Waiting
requests are admitted by priority class, then by their tenants' weighted fair shares of the KV
blocks, then in arrival order (``queue``); a request of one tenant alone waits in arrival order.

**Headroom.** While a tenant has a backlog here past its fair share by more than its burst credit
(more than ``fair_burst`` of its requests waiting, the last of them starting more than
``fair_burst`` of its requests after the queue's virtual time; or two or more waiting and one
turned away by a full queue in the last ``fair_window_s``) and another tenant of its priority
class has been active in the last ``fair_window_s``, the backlogged tenant books against each worker's pool less
``fair_headroom`` of it, or less room for ``fair_headroom_requests`` of the other active tenants'
requests where that is more (what keeps a tenant at its share from waiting is room for its next
requests: a number of requests, whatever the pool's size). The room it leaves goes to the tenants
of that class with at most one request waiting or within their credit of their share, which may
book it without being the queue's head (never before a head of a higher class: a
class alone is never held back). So a flood never fills the pools to the last block: a tenant
sending at its fair share is admitted on arrival instead of at the next request's end anywhere in
the pool. The cost is that headroom, idle while only the flood waits.
A tenant alone, and every request of a router without tenants, books whole pools, head first.

Every admission books under an id of its own (``book-<router>-<n>``, a :data:`BookingId`): the
client's request id is only passed along for logs. Two requests that share a client id (by
accident or not) hold two bookings, and neither can renew, shrink or release the other's.

``Admission`` wires the parts, one module each: the wait queue (``queue``), credit booked ahead
of need and admitted from in memory (``credit``), the ``credit-wanted`` channel on which a
waiting request asks the other routers for their spare credit (``signals``), and the renewal of
every booking's lease (``leases``).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import logging
import math
import time
import uuid
from collections.abc import Iterator, Sequence
from typing import cast

from pdrouter.core.aio import BackgroundTasks
from pdrouter.core.errors import CapacityError
from pdrouter.core.ids import RequestId, WorkerId
from pdrouter.router.admission.config import AdmissionConfig, AdmissionStats
from pdrouter.router.admission.credit import CreditBook
from pdrouter.router.admission.leases import LeaseRenewer
from pdrouter.router.admission.queue import WaitQueue
from pdrouter.router.admission.signals import CreditWanted
from pdrouter.state.reservations import BookingId, DecodeCapacity, KvReservations, Reservation

__all__ = ["Admission", "AdmissionConfig", "AdmissionStats"]

log = logging.getLogger(__name__)

BEHIND_POLL_S = 1.0
"""How often a waiting request that may not book now looks again of its own accord (it is woken when it
becomes the queue's head or is pushed out). Polling every ``poll_interval_s`` (20 ms), a full queue of
1,024 waiters woke the router's event loop about 50,000 times a second, so that under an overload the
head was admitted late, the queue drained far slower than the pool freed room and stayed full
(``docs/benchmarks.md``, "A full admission queue")."""


class Admission:
    """KV admission for one pool (one model)."""

    def __init__(self, reservations: KvReservations, config: AdmissionConfig | None = None) -> None:
        self.reservations = reservations
        self.config = cfg = config or AdmissionConfig()
        self.stats = AdmissionStats()
        self._active: dict[BookingId, Reservation] = {}
        self._queue = WaitQueue(cfg.queue_limit, cfg.fair_burst)
        self._changes = BackgroundTasks(log, "credit booking change failed (its lease expires on its own)")
        self._releases = BackgroundTasks(log, "release of a booking failed (its lease expires on its own)")
        self.owner = uuid.uuid4().hex[:12]
        """This router's part of every booking id it assigns."""
        self._booking_seq = itertools.count()
        self._seen: dict[tuple[int, str], tuple[float, int]] = {}
        """Per priority class and tenant, when it last asked for room and how many blocks (bounded by
        the tenants)."""
        self._refused: dict[tuple[int, str], float] = {}
        """Per priority class and tenant, when a request of it was last refused for want of room (the
        queue full, pushed out of it, or timed out): it asks for more than its share, whatever the
        tags of the requests still queued say."""
        tag = f"credit-{self.owner}-"
        self._credit = CreditBook(reservations, cfg, tag, self._changes, lambda: len(self._queue) > 0)
        self._signals = CreditWanted(reservations.client, reservations.keys.credit_wanted, tag,
                                     enabled=cfg.credit_fraction > 0, ask_every_s=cfg.credit_yield_s / 4,
                                     tasks=self._changes, on_wanted=self._credit.yield_to_others)
        self._leases = LeaseRenewer(reservations, cfg.lease_ms, self._own_bookings, self._credit.chunks,
                                    self._credit.lapsed)

    @property
    def queue_length(self) -> int:
        return len(self._queue)

    @property
    def active(self) -> int:
        return len(self._active)

    @property
    def credit_blocks(self) -> int:
        """Blocks this router holds as credit now (booked in Redis), used or not."""
        return self._credit.held_blocks

    @property
    def credit_requests_heard(self) -> int:
        """Times another router asked for room and this one gave its unused credit back."""
        return self._signals.heard

    def start(self) -> None:
        self._leases.start()
        self._signals.start()

    async def stop(self) -> None:
        await self._signals.stop()
        await self._leases.stop()
        await self._changes.cancel_all()
        await self._releases.cancel_all()
        self._credit.give_back_all()
        await self._changes.wait()
        await self._releases.wait()
        await self.reservations.flush()  # releases still waiting to ride along go now

    def new_booking_id(self) -> BookingId:
        """A booking id no other admission of any router has (this router's ``owner`` and a count)."""
        return BookingId(f"book-{self.owner}-{next(self._booking_seq)}")

    async def admit(self, request_id: RequestId, blocks: int, candidates: Sequence[DecodeCapacity],
                    priority: int = 0, deadline: float | None = None, prefer: WorkerId | None = None,
                    flow: str | None = None, weight: float = 1.0) -> Reservation:
        """Book ``blocks`` on a candidate, waiting in the queue if none has room now.

        The booking gets an id of its own (``Reservation.booking_id``); ``request_id`` is the
        client's, for logs only. Redis errors propagate (``redis.exceptions.RedisError``, ``OSError``).

        ``prefer``: a candidate to book on whenever it has room now (from this router's credit on it,
        else one booking call for it alone), e.g. the colocated worker holding the prompt's prefix;
        else, and for a request that has to wait, the candidates as usual. ``flow`` (the tenant,
        None: none) and ``weight`` place a waiting request among the others of its ``priority``
        (``queue``).
        """
        cfg, queue = self.config, self._queue
        booking_id = self.new_booking_id()
        if flow is not None:
            self._seen[(priority, flow)] = (time.monotonic(), blocks)
        preferred = [c for c in candidates if c.worker_id == prefer and c.capacity_blocks >= blocks]
        if not queue and preferred and len(candidates) > 1:
            if cfg.credit_fraction > 0:
                credited = self._credit.take(booking_id, blocks, preferred)
                if credited is not None:
                    self.stats.admitted_on_credit += 1
                    return self._admitted(credited)
            with contextlib.suppress(CapacityError):
                return self._admitted(await self.reservations.reserve(booking_id, blocks, preferred, cfg.lease_ms))
        if not queue and cfg.credit_fraction > 0:
            credited = self._credit.take(booking_id, blocks, candidates)
            if credited is not None:
                self.stats.admitted_on_credit += 1
                return self._admitted(credited)
        if not queue:
            try:
                return self._admitted(await self.reservations.reserve(booking_id, blocks, candidates, cfg.lease_ms))
            except CapacityError as exc:
                if not exc.retryable:
                    self.stats.rejections["too_large"] += 1
                    raise
        waiter = queue.join(priority, flow, weight, blocks)
        if waiter is None:
            self._refuse(flow, priority)
            self.stats.rejections["queue_full"] += 1
            raise _full(f"the admission queue is full ({cfg.queue_limit} waiting)", cfg.retry_after_s)
        log.debug("%s waits for %d KV blocks (booking %s)", request_id, blocks, booking_id)
        self._credit.give_back_unused()  # someone waits for room: this router's spare credit goes first
        self._signals.ask()  # and the other routers' spare credit
        self.stats.max_queue = max(self.stats.max_queue, len(queue))
        start = time.monotonic()
        give_up = start + cfg.queue_timeout_s
        if deadline is not None:
            give_up = min(give_up, deadline)
        served = False
        try:
            while True:
                if waiter.evicted:
                    self._refuse(flow, priority)
                    self.stats.rejections["queue_full"] += 1
                    raise _full(f"the admission queue is full ({cfg.queue_limit} waiting) and requests of other "
                                f"tenants or a higher priority came", cfg.retry_after_s)
                held = self._held_back(flow, priority)
                may_book = queue.is_head(waiter) or (flow is not None and not held and self._head_held_back(priority))
                if may_book:
                    try:
                        res = await self.reservations.reserve(
                            booking_id, blocks,
                            self._without_headroom(candidates, blocks, flow, priority) if held else candidates,
                            cfg.lease_ms)
                        self.stats.wait_seconds_total += time.monotonic() - start
                        served = True
                        return self._admitted(res)
                    except CapacityError as exc:
                        if not exc.retryable:
                            self.stats.rejections["too_large"] += 1
                            raise
                left = give_up - time.monotonic()
                if left <= 0:  # not a sign of a flood by itself (``_refuse``)
                    self.stats.rejections["timeout"] += 1
                    raise _full(f"no decode worker had {blocks} free KV blocks within {cfg.queue_timeout_s:g}s",
                                cfg.retry_after_s, "timeout")
                self._signals.ask()
                # Only a waiter that may book polls (room another router freed is not signalled), and the first
                # waiter of a tenant within its share (it may book the headroom once the head is held back);
                # the rest sleep until woken (the head now, pushed out, room back) or ``BEHIND_POLL_S``.
                looks = may_book or (flow is not None and not held and queue.leads_its_flow(waiter))
                await queue.wait(waiter, min(left, cfg.poll_interval_s if looks else BEHIND_POLL_S))
        finally:
            queue.leave(waiter, served)

    def _held_back(self, flow: str | None, priority: int) -> bool:
        """Whether ``flow``'s requests of class ``priority`` book without the headroom now (see the
        module docstring): only for another tenant of the same class, which alone may take it."""
        cfg = self.config
        if cfg.fair_headroom <= 0 and cfg.fair_headroom_requests <= 0:
            return False
        return self._past_share(flow, priority)

    def past_share(self, flow: str | None, priority: int) -> bool:
        """Whether ``flow``, one of whose requests of class ``priority`` was just admitted (and has
        left the queue), is past its fair share by more than its credit while another tenant of its
        class is active: the test the headroom is held back by, whatever the headroom. The
        dispatcher gives such a request a lower priority on the workers (``engine_priority``)."""
        return self._past_share(flow, priority, admitted=1)

    def _past_share(self, flow: str | None, priority: int, admitted: int = 0) -> bool:
        cfg = self.config
        if flow is None or self._queue.waiting(flow) + admitted < 2:
            return False
        since = time.monotonic() - cfg.fair_window_s
        if not self._queue.over_share(flow, priority, admitted) and self._refused.get((priority, flow), since) <= since:
            return False
        return any(other != flow and cls == priority and seen > since
                   for (cls, other), (seen, _) in self._seen.items())

    def _refuse(self, flow: str | None, priority: int) -> None:
        """``flow`` was turned away by a full queue: it asks for more than the queue holds, so it is
        past its share whatever its queued tags say (``_past_share``), for ``fair_window_s``. A
        request that timed out is not counted: a tenant at its share times out too when a burst
        of a higher class or a moment's surge takes the room for longer than the queue's timeout,
        and a flood that times out has a backlog past its credit anyway."""
        if flow is not None:
            self._refused[(priority, flow)] = time.monotonic()

    def _head_held_back(self, priority: int) -> bool:
        """Whether the queue's head is of class ``priority`` and held back from the headroom: then
        a request of its class with no backlog may book before it. A head of a higher class is
        never passed."""
        head = self._queue.head
        return head is not None and -head.priority == priority and self._held_back(head.flow, priority)  # type: ignore[arg-type]

    def _without_headroom(self, candidates: Sequence[DecodeCapacity], blocks: int, flow: str | None,
                          priority: int) -> list[DecodeCapacity]:
        """The candidates less their headroom: ``fair_headroom`` of each pool, or room for
        ``fair_headroom_requests`` requests of the largest last request of the other tenants of this
        class or a higher one active in the window, whichever is more (but never below the request: a
        request larger than a pool's rest books that pool whole, or it could never be admitted)."""
        cfg = self.config
        since = time.monotonic() - cfg.fair_window_s
        others = max((size for (cls, other), (seen, size) in self._seen.items()
                      if other != flow and cls >= priority and seen > since), default=0)
        kept = math.ceil(cfg.fair_headroom_requests * others)
        return [dataclasses.replace(c, capacity_blocks=max(blocks, c.capacity_blocks - max(
            kept, math.ceil(c.capacity_blocks * cfg.fair_headroom)))) for c in candidates]

    def _admitted(self, res: Reservation) -> Reservation:
        self._active[res.booking_id] = res
        self.stats.admitted += 1
        return res

    def release_soon(self, reservation: Reservation) -> asyncio.Task[None] | None:
        """``release`` without waiting: credit comes back at once (no task); a booking of its own
        is released by a task, which is returned (it survives its caller's cancellation)."""
        if self._return_credit(reservation):
            return None
        return cast("asyncio.Task[None]", self._releases.spawn(self.release(reservation)))  # a coroutine's task

    async def release(self, reservation: Reservation) -> None:
        """Give the blocks back (idempotent); wakes the next waiting request."""
        if self._return_credit(reservation):
            return
        self._active.pop(reservation.booking_id, None)
        try:
            # With requests waiting for room the release goes at once, else with the next bookings.
            await self.reservations.release(reservation, urgent=bool(self._queue))
        finally:
            self._queue.wake_head()

    def _return_credit(self, reservation: Reservation) -> bool:
        """Give back a request admitted on credit (in memory); False when it was booked alone."""
        if not self._credit.lends(reservation.booking_id):
            return False
        active = self._active.pop(reservation.booking_id, None)
        self._credit.settle(reservation.booking_id, (active or reservation).blocks)
        self._queue.wake_head()
        return True

    async def shrink(self, reservation: Reservation, blocks: int) -> None:
        """The request needs fewer blocks now (it finished early or its remaining budget fell)."""
        if self._credit.lends(reservation.booking_id):  # admitted on credit: the freed blocks return to the credit
            current = self._active.get(reservation.booking_id, reservation)
            freed = max(0, current.blocks - max(0, blocks))
            self._active[reservation.booking_id] = dataclasses.replace(current, blocks=current.blocks - freed)
            self._credit.repay(reservation.booking_id, freed)
            self._queue.wake_head()
            return
        if await self.reservations.shrink(reservation, blocks, urgent=bool(self._queue)):
            self._queue.wake_head()

    def _own_bookings(self) -> Iterator[Reservation]:
        """The requests booked on their own (those on credit live in the credit's chunks)."""
        for res in list(self._active.values()):
            if not self._credit.lends(res.booking_id):
                yield res


def _full(message: str, retry_after_s: int, reason: str = "queue_full") -> CapacityError:
    return CapacityError(message, retry_after_s=retry_after_s, reason=reason)
