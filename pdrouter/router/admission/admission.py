"""Admission by KV capacity: book a decode worker's blocks before any work starts.

Each request needs ``ceil((prompt + max_tokens) / block_size)`` blocks. ``admit`` books them in
Redis (``pdrouter.state.reservations``: one atomic script, shared by every router replica) on a decode
worker with room, under a lease that this router renews while the request runs. When no worker
has room the request waits in a bounded queue (priority first, then FIFO) until blocks come back
or its queue deadline passes (CapacityError → RESOURCE_EXHAUSTED / HTTP 429 with Retry-After). A
request larger than every worker's whole pool is refused at once (RequestTooLargeError).

**Credit.** Booking every request on its own costs a Redis round trip before any work starts. So
while a decode worker is lightly booked, this router books *credit* on it ahead of need: chunks
of ``credit_fraction`` of its pool, under the same atomic script and leases, only while the
worker's bookings from every router stay within ``credit_limit`` of its pool. A request that fits
in this router's unused credit is admitted in memory, without a round trip; credit is topped up
in the background and given back once unused for ``credit_idle_s`` (or at once when a request of
this router waits for room). Every block a request uses is still booked in Redis before the
request starts, so routers sharing one Redis never book more than a worker has; near full, every
request is booked on its own, exactly as without credit.

A request that waits also tells the other routers (a Redis pub/sub message on the pool's
``credit-wanted`` channel, repeated while it waits): they give back their unused credit at once and
book no more for a while, so one router's spare credit does not hold another's requests back.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import heapq
import itertools
import logging
import time
import uuid
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from pdrouter.core.aio import cancel_and_wait
from pdrouter.core.errors import CapacityError, ConfigError
from pdrouter.core.ids import RequestId
from pdrouter.state.reservations import DecodeCapacity, KvReservations, Reservation

log = logging.getLogger(__name__)


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

    def __post_init__(self) -> None:
        if self.queue_limit < 0 or self.queue_timeout_s < 0 or self.lease_ms <= 0 or self.poll_interval_s <= 0:
            raise ConfigError("admission: queue_limit and queue_timeout_s must be >= 0, lease and poll > 0")
        if not (0.0 <= self.credit_fraction <= self.credit_limit <= 1.0) or self.credit_idle_s <= 0 \
                or self.credit_yield_s < 0:
            raise ConfigError("admission: need 0 <= credit_fraction <= credit_limit <= 1, credit_idle_s > 0 "
                              "and credit_yield_s >= 0")


@dataclass(order=True)
class _Waiter:
    priority: int
    seq: int
    wake: asyncio.Event = field(compare=False, default_factory=asyncio.Event)


class AdmissionStats:
    def __init__(self) -> None:
        self.admitted = 0
        self.admitted_on_credit = 0
        """Of ``admitted``: in memory, from credit this router had booked (no Redis round trip)."""
        self.rejections: Counter[str] = Counter()
        self.wait_seconds_total = 0.0
        self.max_queue = 0


class _Credit:
    """This router's credit on one decode worker incarnation: booked chunks, and what is in use."""

    __slots__ = ("chunks", "held", "idle_timer", "refused_until", "topping_up", "used", "worker")

    def __init__(self, worker: DecodeCapacity) -> None:
        self.worker = worker
        self.chunks: list[Reservation] = []
        self.held = 0
        self.used = 0
        self.topping_up = False
        self.refused_until = 0.0
        self.idle_timer: asyncio.TimerHandle | None = None

    @property
    def free(self) -> int:
        return self.held - self.used


class Admission:
    """KV admission for one pool (one model)."""

    def __init__(self, reservations: KvReservations, config: AdmissionConfig | None = None) -> None:
        self.reservations = reservations
        self.config = config or AdmissionConfig()
        self.stats = AdmissionStats()
        self._queue: list[_Waiter] = []
        self._seq = itertools.count()
        self._active: dict[RequestId, Reservation] = {}
        self._renewer: asyncio.Task[None] | None = None
        self._credits: dict[tuple[str, int], _Credit] = {}
        self._on_credit: dict[RequestId, _Credit] = {}
        self._credit_prefix = f"credit-{uuid.uuid4().hex[:12]}-"
        self._credit_seq = itertools.count()
        self._tasks: set[asyncio.Task[Any]] = set()
        self._listener: asyncio.Task[None] | None = None
        self._asked_at = 0.0           # when this router last asked the others for room
        self._others_wait_until = 0.0  # another router asked: no credit top-ups until then
        self.credit_requests_heard = 0
        """Times another router asked for room and this one gave its unused credit back."""

    @property
    def queue_length(self) -> int:
        return len(self._queue)

    @property
    def active(self) -> int:
        return len(self._active)

    @property
    def credit_blocks(self) -> int:
        """Blocks this router holds as credit now (booked in Redis), used or not."""
        return sum(c.held for c in self._credits.values())

    def start(self) -> None:
        self._renewer = asyncio.create_task(self._renew_loop(), name="admission-renew")
        if self.config.credit_fraction > 0:
            self._listener = asyncio.create_task(self._listen_for_waiters(), name="admission-credit-wanted")

    async def stop(self) -> None:
        await cancel_and_wait(self._listener)
        await cancel_and_wait(self._renewer)
        for task in list(self._tasks):
            task.cancel()
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)
        for credit in list(self._credits.values()):
            self._give_back(credit, keep=0, urgent=True)
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)
        await self.reservations.flush()  # releases still waiting to ride along go now

    async def admit(self, request_id: RequestId, blocks: int, candidates: Sequence[DecodeCapacity],
                    priority: int = 0, deadline: float | None = None) -> Reservation:
        """Book ``blocks`` on a candidate, waiting in the queue if none has room now."""
        cfg = self.config
        if not self._queue and cfg.credit_fraction > 0:
            credited = self._admit_on_credit(request_id, blocks, candidates)
            if credited is not None:
                return credited
        if not self._queue:
            try:
                return self._admitted(await self.reservations.reserve(request_id, blocks, candidates, cfg.lease_ms))
            except CapacityError as exc:
                if not exc.retryable:
                    self.stats.rejections["too_large"] += 1
                    raise
        if len(self._queue) >= cfg.queue_limit:
            self.stats.rejections["queue_full"] += 1
            raise _full(f"the admission queue is full ({cfg.queue_limit} waiting)", cfg.retry_after_s)
        waiter = _Waiter(-priority, next(self._seq))
        heapq.heappush(self._queue, waiter)
        self._give_back_unused()  # someone waits for room: this router's spare credit goes first
        self._ask_for_room()  # and the other routers' spare credit
        self.stats.max_queue = max(self.stats.max_queue, len(self._queue))
        start = time.monotonic()
        give_up = start + cfg.queue_timeout_s
        if deadline is not None:
            give_up = min(give_up, deadline)
        try:
            while True:
                if self._queue and self._queue[0] is waiter:
                    try:
                        res = await self.reservations.reserve(request_id, blocks, candidates, cfg.lease_ms)
                        self.stats.wait_seconds_total += time.monotonic() - start
                        return self._admitted(res)
                    except CapacityError as exc:
                        if not exc.retryable:
                            self.stats.rejections["too_large"] += 1
                            raise
                left = give_up - time.monotonic()
                if left <= 0:
                    self.stats.rejections["timeout"] += 1
                    raise _full(f"no decode worker had {blocks} free KV blocks within {cfg.queue_timeout_s:g}s",
                                cfg.retry_after_s)
                self._ask_for_room()
                waiter.wake.clear()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(waiter.wake.wait(), min(left, cfg.poll_interval_s))
        finally:
            if waiter in self._queue:
                self._queue.remove(waiter)
                heapq.heapify(self._queue)
            self._wake_head()

    def _admitted(self, res: Reservation) -> Reservation:
        self._active[res.request_id] = res
        self.stats.admitted += 1
        return res

    def _wake_head(self) -> None:
        if self._queue:
            self._queue[0].wake.set()

    def release_soon(self, reservation: Reservation) -> asyncio.Task[None] | None:
        """``release`` without waiting: credit comes back at once (no task); a booking of its own
        is released by a task, which is returned (it survives its caller's cancellation)."""
        if self._return_credit(reservation):
            return None
        task = asyncio.ensure_future(self.release(reservation))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    async def release(self, reservation: Reservation) -> None:
        """Give the blocks back (idempotent); wakes the next waiting request."""
        if self._return_credit(reservation):
            return
        self._active.pop(reservation.request_id, None)
        try:
            # With requests waiting for room the release goes at once, else with the next bookings.
            await self.reservations.release(reservation, urgent=bool(self._queue))
        finally:
            self._wake_head()

    def _return_credit(self, reservation: Reservation) -> bool:
        """Give back a request admitted on credit (in memory); False when it was booked alone."""
        credit = self._on_credit.pop(reservation.request_id, None)
        if credit is None:
            return False
        active = self._active.pop(reservation.request_id, None)
        credit.used -= (active or reservation).blocks
        self._after_release(credit)
        self._wake_head()
        return True

    async def shrink(self, reservation: Reservation, blocks: int) -> None:
        """The request needs fewer blocks now (it finished early or its remaining budget fell)."""
        credit = self._on_credit.get(reservation.request_id)
        if credit is not None:  # admitted on credit: the freed blocks return to the credit
            current = self._active.get(reservation.request_id, reservation)
            freed = max(0, current.blocks - max(0, blocks))
            credit.used -= freed
            self._active[reservation.request_id] = dataclasses.replace(current, blocks=current.blocks - freed)
            self._after_release(credit)
            self._wake_head()
            return
        if await self.reservations.shrink(reservation, blocks, urgent=bool(self._queue)):
            self._wake_head()

    async def _renew_loop(self) -> None:
        interval = self.config.lease_ms / 3000
        while True:
            await asyncio.sleep(interval)
            try:
                for res in list(self._active.values()):
                    if res.request_id not in self._on_credit:
                        await self.reservations.renew(res)
                for credit in list(self._credits.values()):
                    for chunk in list(credit.chunks):
                        if not await self.reservations.renew(chunk) and chunk in credit.chunks:
                            # Gone from Redis (expired, or Redis lost its data): stop counting it.
                            log.warning("credit %s on %s expired; no longer counted", chunk.request_id,
                                        chunk.worker_id)
                            credit.chunks.remove(chunk)
                            credit.held -= chunk.blocks
            except Exception as exc:  # Redis down: leases may lapse; the worker still guards its pool
                log.warning("lease renewal failed: %s", exc)

    # -- credit -------------------------------------------------------------------------------
    def _admit_on_credit(self, request_id: RequestId, blocks: int,
                         candidates: Sequence[DecodeCapacity]) -> Reservation | None:
        """Admit from this router's unused credit (no round trip), or None; tops credit up."""
        best: _Credit | None = None
        for cand in candidates:
            credit = self._credits.get((cand.worker_id, cand.epoch))
            if credit is None:
                credit = self._credits[(cand.worker_id, cand.epoch)] = _Credit(cand)
            if credit.free >= blocks and (best is None or credit.free > best.free):
                best = credit
            self._maybe_top_up(credit)
        if best is None:
            return None
        best.used += blocks
        if best.idle_timer is not None:
            best.idle_timer.cancel()
            best.idle_timer = None
        self._maybe_top_up(best)
        res = Reservation(request_id, best.worker.worker_id, best.worker.epoch, blocks, self.config.lease_ms)
        self._on_credit[request_id] = best
        self.stats.admitted_on_credit += 1
        return self._admitted(res)

    def _chunk_blocks(self, credit: _Credit) -> int:
        return max(1, int(credit.worker.capacity_blocks * self.config.credit_fraction))

    def _maybe_top_up(self, credit: _Credit) -> None:
        """Book another chunk when less than half a chunk is left unused (one booking at a time)."""
        if credit.topping_up or credit.free * 2 >= self._chunk_blocks(credit) or self._queue:
            return
        now = time.monotonic()
        if now < credit.refused_until or now < self._others_wait_until:
            return
        credit.topping_up = True
        self._spawn(self._top_up(credit))

    async def _top_up(self, credit: _Credit) -> None:
        cfg, worker = self.config, credit.worker
        chunk = self._chunk_blocks(credit)
        # The limit is the script's capacity check: the chunk is booked only if the worker's
        # bookings from every router stay within credit_limit of its pool.
        limit = DecodeCapacity(worker.worker_id, worker.epoch, int(worker.capacity_blocks * cfg.credit_limit))
        try:
            res = await self.reservations.reserve(RequestId(f"{self._credit_prefix}{next(self._credit_seq)}"),
                                                  chunk, [limit], cfg.lease_ms)
        except CapacityError:
            credit.refused_until = time.monotonic() + cfg.poll_interval_s * 5
            return
        except Exception as exc:  # Redis trouble: requests are booked on their own meanwhile
            log.debug("credit top-up on %s failed: %s", worker.worker_id, exc)
            credit.refused_until = time.monotonic() + cfg.poll_interval_s * 5
            return
        finally:
            credit.topping_up = False
        if self._credits.get((worker.worker_id, worker.epoch)) is not credit or self._queue \
                or time.monotonic() < self._others_wait_until:
            # Stopped or forgotten meanwhile, or a request (here or on another router) now waits
            # for room: the chunk goes straight back.
            self._spawn(self.reservations.release(res, urgent=True))
            return
        credit.chunks.append(res)
        credit.held += res.blocks
        if credit.used == 0:
            self._arm_idle(credit)

    def _after_release(self, credit: _Credit) -> None:
        chunk = self._chunk_blocks(credit)
        if credit.free > 2 * chunk:
            self._give_back(credit, keep=credit.used + chunk, urgent=False)
        if credit.used == 0:
            self._arm_idle(credit)

    def _arm_idle(self, credit: _Credit) -> None:
        if credit.idle_timer is None:
            credit.idle_timer = asyncio.get_running_loop().call_later(self.config.credit_idle_s, self._idle, credit)

    def _idle(self, credit: _Credit) -> None:
        credit.idle_timer = None
        if credit.used == 0:
            self._give_back(credit, keep=0, urgent=False)
            if not credit.chunks and not credit.topping_up:
                key = (credit.worker.worker_id, credit.worker.epoch)
                if self._credits.get(key) is credit:
                    del self._credits[key]

    def _give_back_unused(self) -> None:
        for credit in self._credits.values():
            self._give_back(credit, keep=credit.used, urgent=True)

    def _ask_for_room(self) -> None:
        """Tell the other routers a request waits (at most every ``credit_yield_s / 4``)."""
        now = time.monotonic()
        if self.config.credit_fraction <= 0 or now - self._asked_at < self.config.credit_yield_s / 4:
            return
        self._asked_at = now
        self._spawn(self._publish_wanted())

    async def _publish_wanted(self) -> None:
        try:
            await self.reservations.client.publish(self.reservations.keys.credit_wanted, self._credit_prefix)
        except Exception as exc:  # Redis trouble: the others' credit still goes back when idle
            log.debug("could not ask the other routers for room: %s", exc)

    async def _listen_for_waiters(self) -> None:
        """Give unused credit back when another router has a request waiting for room."""
        channel = self.reservations.keys.credit_wanted
        while True:
            pubsub = self.reservations.client.pubsub(ignore_subscribe_messages=True)
            try:
                await pubsub.subscribe(channel)
                async for message in pubsub.listen():
                    data = message.get("data")
                    if message.get("type") != "message" or data in (self._credit_prefix, self._credit_prefix.encode()):
                        continue  # our own request
                    self.credit_requests_heard += 1
                    self._others_wait_until = time.monotonic() + self.config.credit_yield_s
                    self._give_back_unused()
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # Redis gone: credit still goes back when idle; listen again soon
                log.debug("credit-wanted channel: %s", exc)
            finally:
                with contextlib.suppress(Exception):
                    await pubsub.aclose()
            await asyncio.sleep(1.0)

    def _give_back(self, credit: _Credit, keep: int, urgent: bool) -> None:
        """Release whole chunks (largest first) while at least ``keep`` blocks stay held."""
        for chunk in sorted(credit.chunks, key=lambda c: -c.blocks):
            if credit.held - chunk.blocks >= keep:
                credit.chunks.remove(chunk)
                credit.held -= chunk.blocks
                self._spawn(self.reservations.release(chunk, urgent=urgent))

    def _spawn(self, coro: Any) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        task.add_done_callback(_log_failure)


def _log_failure(task: asyncio.Task[Any]) -> None:
    if not task.cancelled() and task.exception() is not None:
        log.warning("credit booking change failed (its lease expires on its own): %s", task.exception())


def _full(message: str, retry_after_s: int) -> CapacityError:
    return CapacityError(message, retry_after_s=retry_after_s)
