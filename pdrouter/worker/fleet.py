"""Many workers of one role in one process and one event loop: a simulated fleet on a small machine.

``pdrouter prefill|decode|worker --backend sim --count N`` runs N workers here instead of N
processes. Each is a whole ``WorkerProcess`` of its own: its worker id (``<prefix>-<i>``), its
ports (gRPC, lane, KV receiver), its registry record and epoch, its heartbeats, its block events
and prefix index entries, its engine, step thread and KV transport. What they share is what one
process has once: the interpreter and its imports, the event loop, the frozen engine configuration
(model geometry, GPU, calibration), and one Redis client over one bounded connection pool
(:func:`fleet_redis_connections`) instead of one pool per worker. Workers hold no Prometheus
registry or other per-process global state that could collide.

Failures stay per worker once the fleet serves: ``stop_worker`` stops one (it deregisters and
clears its index entries) while the others keep serving; a worker whose ``stop`` fails is logged
and the others still stop. Start-up is all or nothing: if any worker cannot start (a port taken,
Redis unreachable) the ones started are stopped again and the error is raised, so a fleet never
comes up short without saying so. ``stop`` (SIGTERM, SIGINT) stops every worker at once, each
deregistering itself.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace

from pdrouter.core.errors import ConfigError
from pdrouter.core.tracing import Tracing
from pdrouter.state.client import RedisClient
from pdrouter.state.pipelined import PipelinedRedis
from pdrouter.worker.config import WorkerConfig
from pdrouter.worker.presence import WORKER_REDIS_CONNECTIONS, connect_redis
from pdrouter.worker.process import WorkerProcess
from pdrouter.worker.role import RoleFactory

log = logging.getLogger(__name__)

MAX_FLEET_REDIS_CONNECTIONS = 64
"""The most Redis connections one fleet process opens, whatever its size."""

STOP_MARGIN_S = 20.0
"""How long past its drain grace one worker's ``stop`` may take before the fleet moves on without it."""

START_CONCURRENCY = 8
"""Workers starting at once (each builds its engine and KV transport in a thread)."""


def fleet_redis_connections(count: int) -> int:
    """The fleet's one Redis pool: two connections per worker (a heartbeat and a block-event flush
    can be in flight together), at least a single worker's pool, at most
    ``MAX_FLEET_REDIS_CONNECTIONS``; callers wait for a free connection when all are busy."""
    return max(WORKER_REDIS_CONNECTIONS, min(MAX_FLEET_REDIS_CONNECTIONS, 2 * count))


def fleet_executor_threads(count: int) -> int:
    """Threads of the fleet loop's default executor: workers hand it blocking work (building an
    engine, dialling a KV peer, joining a step thread), so asyncio's default of a few per core
    would make the workers of a large fleet queue behind each other."""
    return min(64, 4 + 2 * count)


def fleet_worker_id(prefix: str, index: int) -> str:
    """The worker id of worker ``index`` of a fleet: ``<prefix>-<index>``."""
    return f"{prefix}-{index}"


def fleet_configs(base: WorkerConfig, count: int, *, id_prefix: str, first_index: int = 0) -> list[WorkerConfig]:
    """``count`` configurations made from ``base``, one per worker of a fleet.

    Worker ``i`` (0-based) gets the id ``<id_prefix>-<first_index + i>`` and, for each of ``base``'s
    gRPC, lane and KV ports that is not 0 (any free port), that port plus ``i``; a lane port of None
    (gRPC only) stays None. ConfigError for a count below 1, a negative first index, port ranges
    that run past 65535 or overlap each other, or an id that ``WorkerConfig`` refuses.
    """
    if count < 1:
        raise ConfigError(f"--count must be >= 1, got {count}")
    if first_index < 0:
        raise ConfigError(f"--first-index must be >= 0, got {first_index}")
    ranges = [(flag, port) for flag, port in (("--port", base.port), ("--lane-port", base.lane_port or 0),
                                              ("--kv-port", base.kv_port))
              if port]
    for flag, port in ranges:
        if port + count - 1 > 65535:
            raise ConfigError(f"{flag} {port} with --count {count} needs ports up to {port + count - 1}, "
                              f"past 65535: choose a lower {flag}")
    for i, (flag_a, a) in enumerate(ranges):
        for flag_b, b in ranges[i + 1:]:
            if a < b + count and b < a + count:
                raise ConfigError(f"{flag_a} {a} and {flag_b} {b} with --count {count} give overlapping port "
                                  f"ranges: put them at least {count} apart")
    configs = []
    for i in range(count):
        configs.append(replace(
            base, worker_id=fleet_worker_id(id_prefix, first_index + i),
            port=base.port + i if base.port else 0,
            lane_port=None if base.lane_port is None else (base.lane_port + i if base.lane_port else 0),
            kv_port=base.kv_port + i if base.kv_port else 0))
    return configs


class Fleet:
    """Workers sharing one process and event loop; ``start``, then ``serve_forever`` or ``stop``.

    ``configs``: one per worker (:func:`fleet_configs`), all on the same Redis URL (or none). The
    fleet opens one Redis client for all of them (``redis_connections``, default
    :func:`fleet_redis_connections`) and closes it after the last worker stopped.
    ``executor_threads``: when given, ``start`` gives the running loop a default executor of that
    many threads (the CLI does; an embedding caller may keep its own). ``tracing``: the process's
    tracer (``pdrouter.core.tracing``; None: off), shared by every worker and shut down (flushed)
    by ``stop`` after the last of them.
    """

    def __init__(self, configs: Sequence[WorkerConfig], build_role: RoleFactory, *,
                 redis_connections: int | None = None, executor_threads: int | None = None,
                 start_concurrency: int = START_CONCURRENCY, tracing: Tracing | None = None) -> None:
        if not configs:
            raise ConfigError("a fleet needs at least one worker")
        urls = {c.redis_url for c in configs}
        if len(urls) != 1:
            raise ConfigError("the workers of one fleet share one Redis (or none)")
        ids = [c.worker_id for c in configs]
        if len(set(ids)) != len(ids):
            raise ConfigError("the workers of one fleet need distinct worker ids")
        self.configs = list(configs)
        self.build_role = build_role
        self.redis_url = next(iter(urls))
        self.redis_connections = redis_connections or fleet_redis_connections(len(configs))
        self.executor_threads = executor_threads
        self.start_concurrency = max(1, start_concurrency)
        self.tracing = tracing
        self.redis: RedisClient | None = None
        self.pipelined: PipelinedRedis | None = None
        self.workers: list[WorkerProcess] = []
        self._stopping: dict[str, asyncio.Future[None]] = {}
        self._stopped = asyncio.Event()

    # -- state ------------------------------------------------------------------------------
    def worker(self, worker_id: str) -> WorkerProcess:
        """The worker with this id (KeyError if the fleet has none)."""
        for w in self.workers:
            if w.config.worker_id == worker_id:
                return w
        raise KeyError(worker_id)

    @property
    def running(self) -> list[WorkerProcess]:
        """The workers started and not stopped (nor stopping)."""
        return [w for w in self.workers if w.record is not None and w.config.worker_id not in self._stopping]

    # -- lifecycle --------------------------------------------------------------------------
    async def start(self) -> None:
        """Start every worker (``start_concurrency`` at a time); all or nothing (see the module)."""
        began = time.perf_counter()
        if self.executor_threads:
            asyncio.get_running_loop().set_default_executor(
                ThreadPoolExecutor(max_workers=self.executor_threads, thread_name_prefix="fleet"))
        if self.redis_url:
            self.redis = await connect_redis(self.redis_url, max_connections=self.redis_connections)
            self.pipelined = PipelinedRedis.of(self.redis)  # the block publishers' writes, shared
        n = len(self.configs)  # the workers take turns sweeping the index: about one sweep a second
        self.workers = [WorkerProcess(c, self.build_role, redis=self.redis, sweep_turn=(i, n), tracing=self.tracing,
                                      shared_tracing=True, pipelined=self.pipelined)
                        for i, c in enumerate(self.configs)]
        gate = asyncio.Semaphore(self.start_concurrency)

        async def start_one(worker: WorkerProcess) -> None:
            async with gate:
                await worker.start()

        results = await asyncio.gather(*(start_one(w) for w in self.workers), return_exceptions=True)
        failures = [(w, r) for w, r in zip(self.workers, results, strict=True) if isinstance(r, BaseException)]
        if failures:
            worker, error = failures[0]
            log.error("fleet: %d of %d workers failed to start (first: %s: %r); stopping the others",
                      len(failures), len(self.workers), worker.config.worker_id, error)
            await self.stop()
            raise error
        log.info("fleet: %d %s workers started in %.1f s (one Redis pool of %d connections)", len(self.workers),
                 self.configs[0].role.value, time.perf_counter() - began, self.redis_connections)

    async def serve_forever(self) -> None:
        await self._stopped.wait()

    async def stop_worker(self, worker_id: str) -> None:
        """Stop one worker (deregister, drain, tear down); the others keep serving. Idempotent."""
        worker = self.worker(worker_id)
        pending = self._stopping.get(worker_id)
        if pending is None:
            pending = self._stopping[worker_id] = asyncio.ensure_future(self._stop_one(worker))
        await asyncio.shield(pending)

    async def _stop_one(self, worker: WorkerProcess) -> None:
        limit = worker.config.drain_grace_s + STOP_MARGIN_S
        try:
            await asyncio.wait_for(worker.stop(), limit)
        except TimeoutError:  # a stuck part of one worker does not keep the process from exiting
            log.error("fleet: worker %s did not stop within %.0f s; leaving it", worker.config.worker_id, limit)
        except Exception:  # one worker's failure to stop is its own; the others still stop
            log.exception("fleet: worker %s did not stop cleanly", worker.config.worker_id)

    async def stop(self) -> None:
        """Stop every worker at once (each deregisters), then close the shared Redis client."""
        await asyncio.gather(*(self.stop_worker(w.config.worker_id) for w in self.workers))
        if self.pipelined is not None:
            await self.pipelined.aclose()
            self.pipelined = None
        if self.redis is not None:
            with contextlib.suppress(Exception):
                await self.redis.aclose()
            self.redis = None
        if self.tracing is not None:
            await asyncio.to_thread(self.tracing.shutdown)  # the spans still buffered go out
            self.tracing = None
        self._stopped.set()
