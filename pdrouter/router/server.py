"""One router process: worker pool, dispatcher, HTTP and gRPC front doors, metrics.

Start-up: Redis (registry, prefix index, reservations) → worker pool (first refresh) → front
doors (and the metrics listener, with ``metrics_port``). Without Redis the router runs on its
static worker list, placing by load alone and without shared admission. Shutdown: stop
accepting, drain in-flight requests, release every reservation.

With API keys both doors ask for one (``pdrouter.router.frontdoor.auth``); without, a router bound
to an address other than loopback says at start, once, that its doors are open. With tenants
(``RouterConfig.tenants``) the doors call the tenants' gate (``pdrouter.router.tenancy``) over the
dispatcher; with tracing (``tracing``, from the OTEL_* variables) requests are traced end to end.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable
from typing import Any

from redis.exceptions import RedisError

from pdrouter.core import build
from pdrouter.core.aio import cancel_and_wait
from pdrouter.core.model_spec import ModelSpec
from pdrouter.core.net import is_loopback, raise_open_file_limit
from pdrouter.core.redact import redact_url
from pdrouter.core.tls import TlsFiles
from pdrouter.core.tokenizer import load_tokenizer
from pdrouter.core.tracing import Tracing
from pdrouter.core.workers import WorkerRecord, WorkerRole
from pdrouter.router.admission import Admission
from pdrouter.router.config import RouterConfig
from pdrouter.router.dispatch import PoolDispatcher
from pdrouter.router.frontdoor import grpc_api
from pdrouter.router.frontdoor.grpc_api import RouterServicer
from pdrouter.router.frontdoor.http_api import create_app, metrics_app
from pdrouter.router.frontdoor.http_server import bind_socket, make_server
from pdrouter.router.frontdoor.limits import HttpLimits
from pdrouter.router.metrics import RouterMetrics
from pdrouter.router.placement.policies import make_policy
from pdrouter.router.placement.worker_pool import WorkerPool
from pdrouter.router.request import Dispatcher, ModelInfo
from pdrouter.router.state_metrics import StateMetrics
from pdrouter.router.tenancy import TenantGate
from pdrouter.state.client import RedisClient, redis_client
from pdrouter.state.pipelined import PipelinedRedis
from pdrouter.state.prefix_index import PrefixIndex
from pdrouter.state.registry import WorkerRegistry
from pdrouter.state.reservations import KvReservations
from pdrouter.state.tenant_limits import TenantLimiter
from pdrouter.wire.grpc_util import GrpcServer
from pdrouter.wire.h2_grpc import H2GrpcServer

log = logging.getLogger(__name__)


class RouterProcess:
    """Owns every part of one router; ``start`` then ``stop``. ``tracing``: the process's tracer
    (None: off), flushed by ``stop``."""

    def __init__(self, config: RouterConfig, tracing: Tracing | None = None) -> None:
        self.config = config
        self.tracing = tracing
        self.gate: TenantGate | None = None
        spec = ModelSpec.from_pretrained_dir(config.model_dir)
        self.model_name = config.model_name or spec.name
        self.model = ModelInfo(name=self.model_name, max_context=spec.max_context, vocab_size=spec.vocab_size,
                               block_size=config.block_size)
        self.tokenizer = load_tokenizer(config.model_dir)
        self.metrics = RouterMetrics()
        self.redis: RedisClient | None = None
        self._pipe: PipelinedRedis | None = None
        self.pool: WorkerPool | None = None
        self.admission: Admission | None = None
        self.dispatcher: PoolDispatcher | None = None
        self.grpc: GrpcServer | H2GrpcServer | None = None
        self._http_server: object | None = None
        self._http_task: asyncio.Task[None] | None = None
        self._metrics_server: object | None = None
        self._metrics_server_task: asyncio.Task[None] | None = None
        self._metrics_task: asyncio.Task[None] | None = None
        self.http_port = 0
        self.metrics_port: int | None = None
        """The metrics listener's port once started (None: ``/metrics`` is on the HTTP port)."""

    async def start(self) -> None:
        cfg = self.config
        registry = index = None
        if cfg.redis_url:
            self.redis = redis_client(cfg.redis_url, max_connections=cfg.redis_max_connections,
                                      pool_timeout_s=cfg.redis_pool_timeout_s)
            try:
                await self.redis.ping()
            except (RedisError, OSError) as exc:
                if not cfg.static_workers:
                    raise
                log.warning("Redis at %s unreachable (%s): serving the static workers by load alone",
                            redact_url(cfg.redis_url), exc)
            registry = WorkerRegistry(self.redis, self.model_name)
            # The calls each request makes (lookup, booking, tenant limits) share a pipelined connection
            # where one can be; it connects at its first call.
            self._pipe = PipelinedRedis.of(self.redis)
            if cfg.cache_aware:
                index = PrefixIndex(self.redis, self.model_name, pipelined=self._pipe)
            if cfg.admission:
                self.admission = Admission(KvReservations(self.redis, self.model_name, pipelined=self._pipe),
                                           cfg.admission_config)
                self.admission.start()
        self.pool = WorkerPool(self.model_name, registry, cfg.static_workers, cfg.refresh_interval_s,
                               use_lane=cfg.worker_transport == "lane", security=cfg.worker_security,
                               on_leave=self._forget_worker if index is not None else None,
                               block_size=cfg.block_size)
        self._index = index
        await self.pool.start()
        policy = make_policy(cfg.placement_policy, cfg.placement)
        self.dispatcher = PoolDispatcher(self.pool, self.model, cfg.dispatch, policy, index,
                                     self.admission, cfg.hash_seed, metrics=self.metrics, tracing=self.tracing)
        self.state_metrics = StateMetrics(self.dispatcher)
        self.metrics.registry.register(self.state_metrics)
        tokenizers = {self.model_name: self.tokenizer}
        doors: Dispatcher = self.dispatcher
        if cfg.tenants is not None:
            self.metrics.enable_tenants(cfg.tenants.names)
            limiter = None
            if self.redis is not None:
                limiter = TenantLimiter(self.redis, lease_ms=cfg.admission_config.lease_ms, pipelined=self._pipe)
            elif any(cfg.tenants.get(name).limits.limited for name in cfg.tenants.names):
                log.warning("tenants' limits need Redis (--redis): without it they are not enforced")
            self.gate = TenantGate(self.dispatcher, limiter, self.metrics, cfg.admission_config.on_redis_error)
            self.gate.start()
            doors = self.gate
        keys = cfg.api_keys
        self.grpc = grpc_api.door_server(cfg.grpc_server, cfg.host, cfg.grpc_port, tls=cfg.tls, limits=cfg.grpc_limits,
                                         keys=keys)
        grpc_api.add_to_server(self.grpc, RouterServicer(doors, tokenizers, metrics=self.metrics,
                                                         config=cfg.frontdoor, tenants=cfg.tenants,
                                                         tracing=self.tracing))
        await self.grpc.start()
        # Each HTTP connection the door admits is a descriptor; a soft limit of 1,024 (common) would refuse
        # them far below the door's own cap. (Workers, Redis and the gRPC door take a few hundred more.)
        raise_open_file_limit(cfg.http_limits.max_connections + 512)
        app = create_app(doors, tokenizers, metrics=self.metrics, config=cfg.frontdoor, api_keys=keys,
                         serve_metrics=cfg.metrics_port is None, tenants=cfg.tenants, tracing=self.tracing)
        self._http_server, self._http_task, self.http_port = await _serve(app, cfg.host, cfg.http_port, "router-http",
                                                                        cfg.tls, cfg.http_limits)
        if cfg.metrics_port is not None:
            self._metrics_server, self._metrics_server_task, self.metrics_port = await _serve(
                metrics_app(self.metrics), cfg.metrics_host or cfg.host, cfg.metrics_port, "router-metrics-http",
                cfg.tls, cfg.http_limits)
        self._metrics_task = asyncio.create_task(self._publish_metrics(), name="router-metrics")
        log.info("router for %s (%s) on %s://%s:%d and grpc%s %s%s; API keys: %s; tenants: %s; %s modules compiled",
                 self.model_name, cfg.mode, "http" if cfg.tls is None else "https", cfg.host, self.http_port,
                 "" if cfg.tls is None else " (TLS)", self.grpc.address,
                 "" if self.metrics_port is None else f", metrics on port {self.metrics_port}",
                 len(keys) if keys.enabled else "none", "none" if cfg.tenants is None else len(cfg.tenants),
                 build.compiled_modules() or "no")
        if not keys.enabled and not is_loopback(cfg.host):
            log.warning("no API keys: the HTTP and gRPC front doors on %s are open to anyone who reaches them "
                        "(give --api-key-file or PDROUTER_API_KEYS)", cfg.host)

    async def _forget_worker(self, record: WorkerRecord) -> None:
        """A worker incarnation left the pool: its prefix index entries go with it."""
        if self._index is not None and record.role is WorkerRole.PREFILL:
            try:
                await self._index.clear(record.worker_id, record.epoch)
            except (RedisError, OSError) as exc:  # they expire on their own anyway
                log.debug("could not clear index entries of %s: %s", record.worker_id, exc)

    @property
    def grpc_address(self) -> str:
        assert self.grpc is not None
        return self.grpc.address

    async def _publish_metrics(self) -> None:
        known: set[tuple[str, str]] = set()
        while True:
            await asyncio.sleep(1.0)
            assert self.pool is not None
            seen: set[tuple[str, str]] = set()
            for h in self.pool.workers():
                key = (h.worker_id, h.role.value)
                seen.add(key)
                load = h.reported  # as the worker reported it
                self.metrics.set_worker_load(h.worker_id, h.role.value, running=load.running,
                                             queued_prefill_tokens=load.queued_prefill_tokens,
                                             free_blocks=load.free_blocks, device=h.record.device,
                                             sim_modeled_s=load.sim_modeled_s, sim_late_s=load.sim_late_s,
                                             waiting=load.waiting, kv_usage=load.kv_usage,
                                             engine=h.record.engine, engine_version=h.record.engine_version,
                                             kv_sent_bytes=load.kv_sent_bytes,
                                             kv_received_bytes=load.kv_received_bytes,
                                             kv_transfer_s=load.kv_transfer_s,
                                             kv_transfer_failures=load.kv_transfer_failures)
            for worker, role in known - seen:
                self.metrics.remove_worker(worker, role)
            known = seen
            await self.state_metrics.refresh()

    async def stop(self, grace: float = 10.0) -> None:
        """Stop accepting, let in-flight requests finish within ``grace``, then release everything.

        Every step is bounded: a step that overruns is abandoned with a warning naming it, so a
        stuck dependency can delay shutdown but never hang it.
        """
        if self._http_server is not None:
            # Open HTTP connections get ``grace`` to finish, then uvicorn closes them.
            self._http_server.config.timeout_graceful_shutdown = grace  # type: ignore[attr-defined]
            self._http_server.should_exit = True  # type: ignore[attr-defined]
        if self._metrics_server is not None:
            self._metrics_server.config.timeout_graceful_shutdown = 1.0  # type: ignore[attr-defined]
            self._metrics_server.should_exit = True  # type: ignore[attr-defined]
        bound = grace + 5.0
        if self.grpc is not None:
            await _bounded("gRPC front door stop", self.grpc.stop(grace), bound)
        if self._http_task is not None:
            await _bounded("HTTP front door stop", asyncio.shield(self._http_task), bound)
            await cancel_and_wait(self._http_task)
        if self._metrics_server_task is not None:
            await _bounded("metrics listener stop", asyncio.shield(self._metrics_server_task), bound)
            await cancel_and_wait(self._metrics_server_task)
        await cancel_and_wait(self._metrics_task)
        if self.dispatcher is not None:
            await self.dispatcher.drain(bound)
        if self.gate is not None:
            await _bounded("tenants' gate stop", self.gate.stop(), bound)
        if self.admission is not None:
            await _bounded("admission stop", self.admission.stop(), bound)
        if self.pool is not None:
            await _bounded("worker pool stop", self.pool.stop(), bound)
        if self._pipe is not None:
            await _bounded("Redis lookup connection close", self._pipe.aclose(), bound)
        if self.redis is not None:
            await _bounded("Redis client close", self.redis.aclose(), bound)
        if self.tracing is not None:
            await _bounded("trace export", asyncio.to_thread(self.tracing.shutdown), bound)


async def _serve(app: Any, host: str, port: int, name: str, tls: TlsFiles | None = None,
                 limits: HttpLimits | None = None) -> tuple[object, asyncio.Task[None], int]:
    """Serve ``app`` with the router's HTTP server on ``host:port`` (0: any free port; HTTPS with
    ``tls``; ``limits``: its slow-client and overload limits) once it listens: ``(server, its task, the port)``."""
    sock = bind_socket(host, port)  # IPPROTO_TCP: asyncio then sets TCP_NODELAY
    sock.listen(1024)
    sock.setblocking(False)
    bound_port = sock.getsockname()[1]
    server = make_server(app, host, bound_port, tls=tls, limits=limits)
    task = asyncio.create_task(server.serve(sockets=[sock]), name=name)
    while not server.started:
        if task.done():
            await task
            raise OSError(f"{name}: the HTTP server on {host}:{bound_port} stopped before it started")
        await asyncio.sleep(0.01)
    return server, task, bound_port


async def _bounded(what: str, aw: Awaitable[object], timeout: float) -> None:
    """Await ``aw`` for at most ``timeout`` seconds; log (never raise) an overrun or a failure.

    An overrunning step is cancelled but not waited for, so even one that ignores cancellation
    cannot hold shutdown up.
    """
    task = asyncio.ensure_future(aw)
    done, _ = await asyncio.wait({task}, timeout=timeout)
    if not done:
        log.warning("shutdown: %s did not finish within %.1fs; abandoned", what, timeout)
        task.cancel()
    elif not task.cancelled() and task.exception() is not None:
        log.warning("shutdown: %s failed: %s", what, task.exception())
