"""Publishes a worker's block-stored / block-removed events to the Redis prefix index.

The engine calls the sink under its lock, often on the step thread; the sink only appends to a
thread-safe buffer and keeps a mirror of the hashes currently stored. An asyncio task flushes the
buffer in one pipeline per round. If Redis is unreachable the buffer is dropped and the index is
marked dirty; once Redis answers again (or after it restarted empty) the whole mirror is
republished, so hit rates come back without the engine's help.

About once a second (``maintenance_interval_s``) the task also refreshes the incarnation's
liveness in the index and sweeps the entries of lapsed incarnations (workers that died without
clearing theirs), so the index stays bounded while any worker of the pool runs. A write or
refresh that finds this incarnation unknown or lapsed in the index (swept after a long stall,
cleared by a router that saw it leave, lost with Redis) republishes the whole mirror too.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from collections.abc import Sequence

from redis.exceptions import RedisError

from pdrouter.core.ids import BlockHash
from pdrouter.state.prefix_index import PrefixIndex
from pdrouter.worker.presence import cancel_until_done

log = logging.getLogger(__name__)


class RedisBlockPublisher:
    """A ``BlockEventSink`` that feeds one worker incarnation's entries in the prefix index."""

    def __init__(self, index: PrefixIndex, worker_id: str, epoch: int,
                 flush_interval_s: float = 0.01, maintenance_interval_s: float = 1.0,
                 sweep_turn: tuple[int, int] = (0, 1)) -> None:
        """``sweep_turn`` ``(k, n)``: sweep on maintenance rounds ``k, k + n, k + 2n, ...`` only (the
        ``n`` workers of one process take turns, so the process sweeps about once a round)."""
        if not 0 <= sweep_turn[0] < sweep_turn[1]:
            raise ValueError(f"sweep_turn {sweep_turn}: want (k, n) with 0 <= k < n")
        self.index = index
        self.sweep_turn = sweep_turn
        self._rounds = 0
        self.worker_id = worker_id
        self.epoch = epoch
        self.flush_interval_s = flush_interval_s
        self.maintenance_interval_s = maintenance_interval_s
        self._lock = threading.Lock()
        self._pending: list[tuple[bool, tuple[BlockHash, ...]]] = []
        self._live: set[BlockHash] = set()
        self._dirty = True  # publish everything on the first flush
        self._task: asyncio.Task[None] | None = None
        self._wake = asyncio.Event()
        self._loop = asyncio.get_running_loop()
        self.published_events = 0
        self.republishes = 0
        """Full republishes after the first (Redis came back, or the index had lost this incarnation)."""
        self.swept_entries = 0
        """Entries of lapsed incarnations this publisher's sweeps removed."""

    # -- BlockEventSink (any thread) --------------------------------------------------------
    # The flushing task is woken by the first event after a flush took the buffer; the events that
    # follow it before the flush ride along without a wake-up (a write to the loop's wake-up pipe each).
    def blocks_stored(self, hashes: Sequence[BlockHash]) -> None:
        self._append(True, tuple(hashes))

    def blocks_removed(self, hashes: Sequence[BlockHash]) -> None:
        self._append(False, tuple(hashes))

    def _append(self, stored: bool, hashes: tuple[BlockHash, ...]) -> None:
        with self._lock:
            first = not self._pending
            self._pending.append((stored, hashes))
            if stored:
                self._live.update(hashes)
            else:
                self._live.difference_update(hashes)
        if first:
            self._loop.call_soon_threadsafe(self._wake.set)

    # -- publishing (event loop) ------------------------------------------------------------
    @property
    def num_live(self) -> int:
        with self._lock:
            return len(self._live)

    def mark_dirty(self) -> None:
        """Republish the whole mirror at the next flush (e.g. Redis came back empty)."""
        with self._lock:
            self._dirty = True
        self._wake.set()

    async def flush(self) -> None:
        with self._lock:
            dirty, self._dirty = self._dirty, False
            if dirty:
                events: list[tuple[bool, Sequence[bytes]]] = [(True, list(self._live))]
                self._pending.clear()
            else:
                events = list(self._pending)
                self._pending.clear()
        if not events:
            return
        try:
            if dirty:
                await self.index.clear(self.worker_id, self.epoch)
                await self.index.apply(self.worker_id, self.epoch, events)
                self.republishes += self.published_events > 0
            elif not await self.index.apply(self.worker_id, self.epoch, events):
                log.info("worker %s: the prefix index had lost this incarnation; republishing", self.worker_id)
                self.mark_dirty()
            self.published_events += len(events)
        except (RedisError, OSError) as exc:
            log.warning("worker %s: prefix index update failed (%s); will republish", self.worker_id, exc)
            self.mark_dirty()
            raise

    async def maintain(self) -> None:
        """Refresh this incarnation's liveness (republish if the index lost it) and sweep lapsed ones."""
        if not await self.index.touch(self.worker_id, self.epoch):
            with self._lock:
                dirty = self._dirty
            if not dirty:
                log.info("worker %s: the prefix index had lost this incarnation; republishing", self.worker_id)
                self.mark_dirty()
        turn, every = self.sweep_turn
        self._rounds += 1
        if (self._rounds - 1) % every == turn:
            self.swept_entries += await self.index.sweep()

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        next_maintenance = loop.time() + self.maintenance_interval_s
        while True:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(max(0.0, next_maintenance - loop.time())):
                    await self._wake.wait()
            self._wake.clear()
            try:
                await self.flush()
            except (RedisError, OSError):
                await asyncio.sleep(0.5)
                self._wake.set()
                continue
            if loop.time() >= next_maintenance:
                next_maintenance = loop.time() + self.maintenance_interval_s
                try:
                    await self.maintain()
                except (RedisError, OSError) as exc:  # the next flush finds out whether Redis is gone
                    log.debug("worker %s: prefix index maintenance failed: %s", self.worker_id, exc)
            await asyncio.sleep(self.flush_interval_s)

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name=f"block-publisher-{self.worker_id}")
        self._wake.set()

    async def stop(self, clear: bool = True) -> None:
        await cancel_until_done(self._task)  # one cancel can be lost in a shared Redis pool
        self._task = None
        if clear:
            with contextlib.suppress(RedisError, OSError):
                await self.index.clear(self.worker_id, self.epoch)
