"""Which prefill routes a decode worker may call (``DecodeWorker.Serve`` calls them itself).

A route comes from the caller, so before calling it a decode worker with a registry checks it
(:class:`RegisteredPrefillWorkers`): it must name a prefill worker registered in the decode
worker's pool, at the addresses that worker registered. Whoever can reach a decode worker's port
cannot make it open connections (and send KV targets) to arbitrary addresses. The connections
themselves are ``pdrouter.wire.prefill_links.PrefillLinks``.
"""

from __future__ import annotations

import asyncio
import time

from redis.exceptions import RedisError

from pdrouter.core.workers import WorkerRecord, WorkerRole
from pdrouter.state.registry import WorkerRegistry
from pdrouter.wire.prefill_links import RouteAddress


class RegisteredPrefillWorkers:
    """Which prefill routes a decode worker may call: those of prefill workers registered in its pool.

    A route passes when its worker id is registered with the prefill role and each address it
    names (gRPC, lane) is the one that worker registered. The registered prefill workers are kept
    in memory, so a known route costs no Redis call; a view older than ``max_age_s`` is read again
    in the background when next used, so workers that left stop passing.

    An unknown or changed route waits for a read of the registry that began after it was asked
    about, so a worker that registered a moment ago is found. Reads are at least ``min_refresh_s``
    apart and shared by every check waiting on them: a stream of bogus routes costs a few reads a
    second and delays only its own requests. With Redis unreachable, known routes still pass and
    others are refused.
    """

    def __init__(self, registry: WorkerRegistry, min_refresh_s: float = 0.2, max_age_s: float = 5.0) -> None:
        self.registry = registry
        self.min_refresh_s = min_refresh_s
        self.max_age_s = max_age_s
        self._known: dict[str, WorkerRecord] = {}
        self._read_at = -float("inf")
        """When the last read of the registry began (``time.monotonic()``)."""
        self._reading: asyncio.Future[None] | None = None

    def _passes(self, route: RouteAddress) -> bool:
        record = self._known.get(route.worker_id)
        return (record is not None and (not route.address or route.address == record.address)
                and (not route.lane_address or route.lane_address == record.lane_address))

    async def refusal(self, route: RouteAddress) -> str | None:
        """None when ``route`` may be called, else why not (for the report and the log)."""
        if self._passes(route):
            if self._reading is None and time.monotonic() - self._read_at > self.max_age_s:
                self._read()  # refresh the view in the background; this route passed on the last one
            return None
        asked = time.monotonic()
        while self._read_at < asked:
            try:
                await asyncio.shield(self._read())
            except (RedisError, OSError) as exc:
                return f"cannot check prefill worker {route.worker_id!r} against the registry ({exc})"
            if self._passes(route):
                return None
        record = self._known.get(route.worker_id)
        if record is None:
            return (f"{route.worker_id!r} is not a prefill worker registered in pool "
                    f"{self.registry.keys.pool!r}")
        return (f"prefill worker {route.worker_id!r} registered address {record.address!r} and lane "
                f"{record.lane_address or 'none'!r}, not {route.address!r} and {route.lane_address!r}")

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
        self._known = {r.worker_id: r for r in records if r.role is WorkerRole.PREFILL}

    def _read_done(self, future: asyncio.Future[None]) -> None:
        self._reading = None
        if not future.cancelled():
            future.exception()  # retrieved here: every waiter may have gone
