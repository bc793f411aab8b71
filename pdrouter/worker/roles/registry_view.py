"""A worker's view of the workers of one role registered in its pool, for checking the peers callers name.

Callers name the peers a worker is to contact: a decode worker's ``Serve`` is given prefill routes
(``prefill_routes``), a prefill worker's ``Prefill`` the KV target of a decode worker
(``decode_targets``). Neither is taken on trust: a worker with a registry contacts a peer only when
it is registered in the pool with that role, at the addresses named. :class:`RegistryView` is
what both checks share: the registered records, read from Redis and kept in memory.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

from pdrouter.core.workers import WorkerRecord, WorkerRole
from pdrouter.state.registry import WorkerRegistry


class RegistryView:
    """The workers of ``role`` registered in ``registry``'s pool, kept in memory and read again when needed.

    ``find(worker_id, passes)`` gives the record of ``worker_id`` when it is registered with
    ``role`` and ``passes(record)``, else None. A known record that passes costs no Redis call; a
    view older than ``max_age_s`` is read again in the background when next used, so workers that
    left stop passing.

    An unknown id, or one whose record does not pass, waits for a read of the registry that began
    after it was asked about, so a worker that registered a moment ago is found. Reads are at least
    ``min_refresh_s`` apart and shared by every check waiting on them: a stream of bogus names costs
    a few reads a second and delays only its own requests. With Redis unreachable, known records
    that pass still pass, and ``find`` raises the Redis error (``RedisError``, ``OSError``) for the
    others. ``registry`` may be replaced; the next read uses the new one.
    """

    def __init__(self, registry: WorkerRegistry, role: WorkerRole, min_refresh_s: float = 0.2,
                 max_age_s: float = 5.0) -> None:
        self.registry = registry
        self.role = role
        self.min_refresh_s = min_refresh_s
        self.max_age_s = max_age_s
        self._known: dict[str, WorkerRecord] = {}
        self._read_at = -float("inf")
        """When the last read of the registry began (``time.monotonic()``)."""
        self._reading: asyncio.Future[None] | None = None

    def known(self, worker_id: str) -> WorkerRecord | None:
        """The record of ``worker_id`` in the last read (None: not registered with ``role`` then)."""
        return self._known.get(worker_id)

    async def find(self, worker_id: str, passes: Callable[[WorkerRecord], bool]) -> WorkerRecord | None:
        """The registered record of ``worker_id`` if it ``passes``, read afresh when it does not yet."""
        record = self._known.get(worker_id)
        if record is not None and passes(record):
            if self._reading is None and time.monotonic() - self._read_at > self.max_age_s:
                self._read()  # refresh the view in the background; this one passed on the last read
            return record
        asked = time.monotonic()
        while self._read_at < asked:
            await asyncio.shield(self._read())
            record = self._known.get(worker_id)
            if record is not None and passes(record):
                return record
        return None

    def _read(self) -> asyncio.Future[None]:
        """The read in progress, or a new one (begun once ``min_refresh_s`` has passed since the last)."""
        if self._reading is None:
            self._reading = asyncio.ensure_future(self._load(self._read_at + self.min_refresh_s - time.monotonic()))
            self._reading.add_done_callback(self._read_done)
        return self._reading

    async def _load(self, delay: float) -> None:
        if delay > 0:
            await asyncio.sleep(delay)
        self._read_at = time.monotonic()
        records = await self.registry.records()
        self._known = {r.worker_id: r for r in records if r.role is self.role}

    def _read_done(self, future: asyncio.Future[None]) -> None:
        self._reading = None
        if not future.cancelled():
            future.exception()  # retrieved here: every waiter may have gone
