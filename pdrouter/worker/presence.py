"""A worker's presence in the registry: register at start, heartbeat its load, deregister at stop.

If Redis restarts (the record vanished) the next heartbeat re-registers. If a newer incarnation of
the same worker id registered, this one stops heartbeating and reports itself superseded.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from collections.abc import Awaitable, Callable

from redis.exceptions import RedisError

from pdrouter.core.aio import cancel_and_wait
from pdrouter.core.errors import StaleEpochError, UnavailableError
from pdrouter.core.redact import redact_url
from pdrouter.core.workers import DEFAULT_HEARTBEAT_INTERVAL_S, WorkerLoad, WorkerRecord
from pdrouter.state.client import RedisClient, redis_client
from pdrouter.state.registry import WorkerRegistry

log = logging.getLogger(__name__)

async def cancel_until_done(task: asyncio.Task[None] | None) -> None:
    """``cancel_and_wait`` (which cancels again until the task has ended), with an error the task
    ended with logged instead of raised: it is stopping anyway."""
    try:
        await cancel_and_wait(task)
    except Exception as exc:  # the loop's own failure, already past
        log.debug("task %s ended with %r while stopping", task.get_name() if task else "?", exc)


class Presence:
    """Keeps one worker record live in Redis while the worker runs."""

    def __init__(self, registry: WorkerRegistry, record: WorkerRecord, load: Callable[[], WorkerLoad],
                 interval_s: float = DEFAULT_HEARTBEAT_INTERVAL_S,
                 on_beat: Callable[[bool], Awaitable[None]] | None = None) -> None:
        """``on_beat(reregistered)`` runs after each successful heartbeat (e.g. refresh index TTLs)."""
        if interval_s * 1000 >= registry.heartbeat_ttl_ms:
            raise ValueError("heartbeat interval must be shorter than the heartbeat TTL")
        self.registry = registry
        self.record = record
        self._load = load
        self.interval_s = interval_s
        self._on_beat = on_beat
        self._task: asyncio.Task[None] | None = None
        self.superseded = False
        self.redis_ok = False

    async def start(self) -> None:
        await self.registry.register(self.record)
        self.redis_ok = True
        self._task = asyncio.create_task(self._run(), name=f"presence-{self.record.worker_id}")

    async def beat(self) -> None:
        """One heartbeat now (re-registering after a Redis restart)."""
        reregistered = False
        try:
            load = dataclasses.replace(self._load(), taken_at=time.time())  # routers' placement reads it
            await self.registry.heartbeat(self.record.worker_id, self.record.epoch, load)
        except StaleEpochError as exc:
            if "not registered" not in exc.message:
                raise
            log.warning("worker %s: registration lost (Redis restarted?); registering again",
                        self.record.worker_id)
            await self.registry.register(self.record)
            reregistered = True
        if self._on_beat is not None:
            await self._on_beat(reregistered or not self.redis_ok)

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            try:
                await self.beat()
                if not self.redis_ok:
                    log.info("worker %s: Redis reachable again", self.record.worker_id)
                self.redis_ok = True
            except StaleEpochError as exc:
                log.error("worker %s: %s; stopping heartbeats", self.record.worker_id, exc.message)
                self.superseded = True
                return
            except (RedisError, OSError) as exc:
                if self.redis_ok:
                    log.warning("worker %s: heartbeat failed: %s", self.record.worker_id, exc)
                self.redis_ok = False

    async def stop(self) -> None:
        await cancel_until_done(self._task)
        self._task = None
        try:
            await self.registry.deregister(self.record.worker_id, self.record.epoch)
        except (RedisError, OSError) as exc:
            log.warning("worker %s: could not deregister: %s", self.record.worker_id, exc)


WORKER_REDIS_CONNECTIONS = 16
"""The worker's Redis pool: heartbeats, block events, the registry view; callers wait for a free one."""


async def connect_redis(url: str, max_connections: int = WORKER_REDIS_CONNECTIONS) -> RedisClient:
    """An asyncio Redis client for ``url`` over a bounded, blocking pool of ``max_connections``
    (connection checked with PING). A process hosting many workers shares one (``pdrouter.worker.fleet``).

    UnavailableError, in one line naming the URL (its password hidden) and why, when Redis does not
    answer: a worker cannot register without it (the command exits with that line, no traceback).
    """
    client = redis_client(url, max_connections=max_connections, pool_timeout_s=5.0)
    try:
        await client.ping()
    except (RedisError, OSError) as exc:
        with contextlib.suppress(RedisError, OSError):
            await client.aclose()
        raise UnavailableError(f"cannot reach Redis at {redact_url(url)} ({exc}): start it, or point --redis "
                               f"at a running one") from None
    return client
