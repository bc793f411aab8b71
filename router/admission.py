"""Admission by KV capacity: book a decode worker's blocks before any work starts.

Each request needs ``ceil((prompt + max_tokens) / block_size)`` blocks. ``admit`` books them in
Redis (``pdstate.reservations``: one atomic script, shared by every router replica) on a decode
worker with room, under a lease that this router renews while the request runs. When no worker
has room the request waits in a bounded queue (priority first, then FIFO) until blocks come back
or its queue deadline passes (CapacityError → RESOURCE_EXHAUSTED / HTTP 429 with Retry-After). A
request larger than every worker's whole pool is refused at once (RequestTooLargeError).
"""

from __future__ import annotations

import asyncio
import contextlib
import heapq
import itertools
import logging
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field

from pdcommon.errors import CapacityError, ConfigError
from pdcommon.ids import RequestId
from pdrouter.aio import cancel_and_wait
from pdstate.reservations import DecodeCapacity, KvReservations, Reservation

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

    def __post_init__(self) -> None:
        if self.queue_limit < 0 or self.queue_timeout_s < 0 or self.lease_ms <= 0 or self.poll_interval_s <= 0:
            raise ConfigError("admission: queue_limit and queue_timeout_s must be >= 0, lease and poll > 0")


@dataclass(order=True)
class _Waiter:
    priority: int
    seq: int
    wake: asyncio.Event = field(compare=False, default_factory=asyncio.Event)


class AdmissionStats:
    def __init__(self) -> None:
        self.admitted = 0
        self.rejections: Counter[str] = Counter()
        self.wait_seconds_total = 0.0
        self.max_queue = 0


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

    @property
    def queue_length(self) -> int:
        return len(self._queue)

    @property
    def active(self) -> int:
        return len(self._active)

    def start(self) -> None:
        self._renewer = asyncio.create_task(self._renew_loop(), name="admission-renew")

    async def stop(self) -> None:
        await cancel_and_wait(self._renewer)
        await self.reservations.flush()  # releases still waiting to ride along go now

    async def admit(self, request_id: RequestId, blocks: int, candidates: Sequence[DecodeCapacity],
                    priority: int = 0, deadline: float | None = None) -> Reservation:
        """Book ``blocks`` on a candidate, waiting in the queue if none has room now."""
        cfg = self.config
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

    async def release(self, reservation: Reservation) -> None:
        """Give the blocks back (idempotent); wakes the next waiting request."""
        self._active.pop(reservation.request_id, None)
        try:
            # With requests waiting for room the release goes at once, else with the next bookings.
            await self.reservations.release(reservation, urgent=bool(self._queue))
        finally:
            self._wake_head()

    async def shrink(self, reservation: Reservation, blocks: int) -> None:
        """The request needs fewer blocks now (it finished early or its remaining budget fell)."""
        if await self.reservations.shrink(reservation, blocks, urgent=bool(self._queue)):
            self._wake_head()

    async def _renew_loop(self) -> None:
        interval = self.config.lease_ms / 3000
        while True:
            await asyncio.sleep(interval)
            for res in list(self._active.values()):
                try:
                    await self.reservations.renew(res)
                except Exception as exc:  # Redis down: leases may lapse; the worker still guards its pool
                    log.warning("lease renewal failed: %s", exc)
                    break


def _full(message: str, retry_after_s: int) -> CapacityError:
    return CapacityError(message, retry_after_s=retry_after_s)
