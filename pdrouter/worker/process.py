"""One worker process: engine + gRPC services + presence in Redis, with a clean shutdown.

The engine is whichever the configuration names (the project's, through its driver, or vLLM),
behind the engine contract (``pdrouter.worker.engine_contract``); the process registers the KV pool
the engine reports it really allocated, and what runs it (``EngineIdentity``).

Start-up order: Redis (epoch, index) → engine (loads weights, sizes the KV pool) → the role (its
KV transport and services, see ``pdrouter.worker.role``) → gRPC server and worker lane →
registration (only now can the router route to it) → heartbeats.
Shutdown runs the other way and lets in-flight requests finish within ``drain_grace_s``.

If the engine fails (the engine contract's ``on_failure``: a model step of the project's engine
raised, or vLLM's engine core is gone) the worker stays up but says so at once: its gRPC
health turns NOT_SERVING for every service (what Kubernetes' probes read), and a heartbeat goes
out with ``WorkerLoad.engine_failed`` (what routers read: they place nothing there), as will every
later one. Restarting the process brings it back as a new incarnation.

The prefix index is fed by the workers that prefill: prefill and colocated workers publish their
engine's block events (``RedisBlockPublisher``); a decode worker does not, since only prefill (and
colocated) placement reads the index, and its events were most of the index's writes in a
disaggregated fleet (``docs/benchmarks.md``).

Every request RPC is served twice: over gRPC (the contract, for any client) and over the worker
lane (``pdrouter.wire.lane``, the same messages; the router's fast path) unless ``lane_port`` is None.

Several workers may share one process (``pdrouter.worker.fleet``): each is its own
``WorkerProcess`` (identity, ports, record, heartbeats, block events), and they may share one
Redis client, which then belongs to the fleet, not to any of them.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from pdrouter.core.aio import BackgroundTasks
from pdrouter.core.ids import Epoch, WorkerId
from pdrouter.core.kv_layout import model_compat_hash
from pdrouter.core.model_spec import ModelSpec
from pdrouter.core.tracing import Tracing
from pdrouter.core.workers import WorkerLoad, WorkerRecord, WorkerRole
from pdrouter.engine.sim.config import SimEngineConfig
from pdrouter.engine.vllm.config import VllmEngineConfig
from pdrouter.state.client import RedisClient
from pdrouter.state.pipelined import PipelinedRedis
from pdrouter.state.prefix_index import PrefixIndex
from pdrouter.state.registry import WorkerRegistry
from pdrouter.transfer.vllm.host import ConnectorHost
from pdrouter.wire.grpc_util import GrpcServer
from pdrouter.wire.lane import LaneServer, serve_servicer
from pdrouter.wire.v1 import common_pb2, worker_pb2_grpc
from pdrouter.worker.backend import TransferPacing, start_engine
from pdrouter.worker.block_publisher import RedisBlockPublisher
from pdrouter.worker.config import WorkerConfig
from pdrouter.worker.driver import EngineDriver
from pdrouter.worker.engine_contract import ServingEngine
from pdrouter.worker.info_service import WorkerInfoServicer
from pdrouter.worker.kv_connector import READY_S, engine_with_connector, start_connector
from pdrouter.worker.presence import Presence, connect_redis
from pdrouter.worker.role import Role, RoleContext, RoleFactory
from pdrouter.worker.transfer_tally import TransferTally

log = logging.getLogger(__name__)


class WorkerProcess:
    """Owns every part of one worker; ``start`` then ``serve_forever`` or ``stop``.

    ``build_role`` makes the role's part once the engine is up (``pdrouter.worker.roles.build_role``
    picks it from ``config.role``). ``redis``: a client of ``config.redis_url`` shared with other
    workers of this process; it is used instead of connecting one, and left open by ``stop`` (its
    owner closes it). Without ``config.redis_url`` it is ignored. ``tracing``: the process's tracer
    (``pdrouter.core.tracing``; None: off), handed to the role and shut down (flushed) by ``stop``
    unless ``shared_tracing`` (the workers of a fleet share one; the fleet shuts it down).
    """

    def __init__(self, config: WorkerConfig, build_role: RoleFactory, redis: RedisClient | None = None,
                 sweep_turn: tuple[int, int] = (0, 1), tracing: Tracing | None = None,
                 shared_tracing: bool = False, pipelined: PipelinedRedis | None = None) -> None:
        self.config = config
        self._shared_pipelined = pipelined
        self._pipelined: PipelinedRedis | None = None
        self.tracing = tracing
        self._shared_tracing = shared_tracing
        self.build_role = build_role
        self._shared_redis = redis
        self._sweep_turn = sweep_turn
        self.redis: RedisClient | None = None
        self.registry: WorkerRegistry | None = None
        self.index: PrefixIndex | None = None
        self.publisher: RedisBlockPublisher | None = None
        self.presence: Presence | None = None
        self.engine: ServingEngine | None = None
        self.connector: ConnectorHost | None = None
        """The side channel of a vLLM prefill or decode engine's KV connector (``pdrouter.worker.kv_connector``)."""
        self.transfers = TransferTally()
        """The role's KV transfers so far (the heartbeats carry the totals)."""
        self.server: GrpcServer | None = None
        self.lane: LaneServer | None = None
        self.role: Role | None = None
        self.epoch = Epoch(0)
        self.model_compat_hash = ""
        self.record: WorkerRecord | None = None
        self._stopped = asyncio.Event()
        self._reports = BackgroundTasks(log, "reporting the engine's failure failed")

    @property
    def address(self) -> str:
        assert self.server is not None
        return f"{self.config.public_host}:{self.server.port}"

    def load(self) -> WorkerLoad:
        assert self.engine is not None
        return self.transfers.onto(self.engine.load())

    async def start(self) -> None:
        cfg = self.config
        spec_name = cfg.model_name or _model_name(cfg)
        pool_name = cfg.pool or spec_name
        if cfg.redis_url:
            shared = self._shared_redis
            self.redis = shared if shared is not None else await connect_redis(cfg.redis_url)
            self.registry = WorkerRegistry(self.redis, pool_name, heartbeat_ttl_ms=cfg.heartbeat_ttl_ms)
            self.epoch = await self.registry.new_epoch()
            if cfg.role is not WorkerRole.DECODE:  # (see the module docstring)
                # The block publisher's writes go over one pipelined connection (half the CPU of redis-py's
                # pipeline per flush, ``docs/benchmarks.md``); a fleet's workers share the fleet's.
                if shared is None:
                    self._pipelined = PipelinedRedis.of(self.redis)
                self.index = PrefixIndex(self.redis, pool_name, ttl_ms=max(10_000, 3 * cfg.heartbeat_ttl_ms),
                                         pipelined=self._pipelined if shared is None else self._shared_pipelined)
                self.publisher = RedisBlockPublisher(self.index, cfg.worker_id, self.epoch,
                                                     sweep_turn=self._sweep_turn)
        else:
            self.epoch = Epoch(time.time_ns())
        engine_config = cfg.engine
        self.connector = await start_connector(cfg, self.epoch)
        if self.connector is not None:  # vLLM moves this worker's KV: its connector dials the host while vLLM starts
            assert isinstance(engine_config, VllmEngineConfig)
            engine_config = engine_with_connector(engine_config, self.connector)
        try:
            self.engine = await start_engine(engine_config, self.publisher, cfg.engine_fault)
            if self.connector is not None:
                await self.connector.wait_ready(READY_S)
        except BaseException:
            if self.connector is not None:
                await self.connector.close()
            raise
        self.engine.on_failure(self._engine_failed)
        security = cfg.security
        self.server = GrpcServer(cfg.host, cfg.port, interceptors=security.server_interceptors(),
                                 credentials=security.server_credentials(), limits=cfg.grpc_limits,
                                 advertise_host=cfg.public_host)
        if cfg.lane_port is not None:
            self.lane = LaneServer(cfg.host, cfg.lane_port, token=security.lane_token, ssl=security.lane_server_ssl(),
                                   limits=cfg.lane_limits, advertise_host=cfg.public_host)
        spec = self.engine.spec
        layout = self.engine.kv_layout
        compat = self.model_compat_hash = model_compat_hash(spec, layout.block_size, layout.dtype)
        pacing = TransferPacing.for_engine(self.engine.engine) if isinstance(self.engine, EngineDriver) else None
        self.role = await self.build_role(RoleContext(
            config=cfg, engine=self.engine, epoch=self.epoch, model_compat_hash=compat, registry=self.registry,
            pacing=pacing, tracing=self.tracing, connector=self.connector, transfers=self.transfers))
        for service in self.role.services():
            self.serve(service.add_to_server, service.servicer, service.name)
        self.record = WorkerRecord(
            worker_id=WorkerId(cfg.worker_id), role=cfg.role, address="", epoch=self.epoch,
            model=spec_name, model_compat_hash=compat, kv_compat_hash=layout.compat_hash(),
            block_size=layout.block_size, capacity_blocks=layout.num_blocks,
            kv_address=self.role.kv_address, device=self.engine.identity.device,
            kv_backends=(cfg.kv_backend,) if cfg.role is not WorkerRole.COLOCATED else (),
            engine=self.engine.identity.name, engine_version=self.engine.identity.version)
        if self.lane is not None:
            await self.lane.start()
        geometry = common_pb2.ModelGeometry(
            name=spec_name, num_layers=spec.num_layers, hidden_size=spec.hidden_size,
            num_heads=spec.num_heads, num_kv_heads=spec.num_kv_heads, head_dim=spec.head_dim,
            intermediate_size=spec.intermediate_size, vocab_size=spec.vocab_size,
            max_context=spec.max_context, dtype=spec.dtype)
        kv_pb = common_pb2.KvLayout(num_layers=layout.num_layers, num_kv_heads=layout.num_kv_heads,
                                    head_dim=layout.head_dim, block_size=layout.block_size,
                                    num_blocks=layout.num_blocks, dtype=layout.dtype,
                                    compat_hash=layout.compat_hash())
        self.server.add(worker_pb2_grpc.add_WorkerInfoServiceServicer_to_server,
                        WorkerInfoServicer(lambda: self._record(), self.load, geometry, kv_pb),
                        "pdrouter.v1.WorkerInfoService")
        await self.server.start()
        if self.engine.failure is not None:  # it failed while the rest started
            await self.server.not_serving()
        self.record = self._record()
        if self.registry is not None:
            self.presence = Presence(self.registry, self.record, self.load, cfg.heartbeat_interval_s,
                                     on_beat=self._on_beat)
            await self.presence.start()
        if self.publisher is not None:
            self.publisher.start()
        sim = f", time scale {cfg.engine.time_scale:g}" if isinstance(cfg.engine, SimEngineConfig) else ""
        identity = self.engine.identity
        log.info("%s worker %s (epoch %s) serving %s at %s on %s with %s %s%s", cfg.role.value, cfg.worker_id,
                 self.epoch, spec_name, self.address, self.record.device, identity.name, identity.version, sim)

    def _record(self) -> WorkerRecord:
        assert self.record is not None
        if self.record.address:
            return self.record
        lane = f"{self.config.public_host}:{self.lane.port}" if self.lane is not None else ""
        return replace(self.record, address=self.address, lane_address=lane)

    def serve(self, add_fn: Callable[[Any, Any], None], servicer: object, service_name: str) -> None:
        """Serve ``servicer`` over gRPC (``add_XServicer_to_server``) and over the worker lane."""
        assert self.server is not None
        self.server.add(add_fn, servicer, service_name)
        if self.lane is not None:
            serve_servicer(self.lane, servicer)

    def _engine_failed(self, failure: str) -> None:
        """The engine stopped: NOT_SERVING now (before any caller hears of it), then a heartbeat saying so."""
        log.error("%s worker %s: the engine failed (%s); serving no more requests, health NOT_SERVING "
                  "until the process is restarted", self.config.role.value, self.config.worker_id, failure)
        self._reports.spawn(self._report_failure(), name=f"engine-failed-{self.config.worker_id}")

    async def _report_failure(self) -> None:
        if self.server is not None:
            await self.server.not_serving()
        if self.presence is not None:
            await self.presence.beat()

    async def _on_beat(self, reregistered: bool) -> None:
        if self.index is None:
            return
        if reregistered and self.publisher is not None:
            self.publisher.mark_dirty()
        await self.index.touch(self.config.worker_id, self.epoch)

    async def serve_forever(self) -> None:
        await self._stopped.wait()

    @property
    def stopped(self) -> bool:
        """Whether ``stop`` has run to its end."""
        return self._stopped.is_set()

    async def stop(self) -> None:
        """Deregister, drain in-flight requests, then tear everything down."""
        cfg = self.config
        await self._reports.cancel_all()
        if self.presence is not None:
            await self.presence.stop()
        drains = [part.stop(cfg.drain_grace_s) for part in (self.server, self.lane) if part is not None]
        await asyncio.gather(*drains)
        if self.role is not None:
            await self.role.close()
        if self.publisher is not None:
            await self.publisher.stop(clear=True)
        if self.connector is not None:
            self.connector.stopping()
        if self.engine is not None:
            await self.engine.close()
        if self.connector is not None:
            await self.connector.close()
        if self._pipelined is not None:
            await self._pipelined.aclose()
        if self.redis is not None and self.redis is not self._shared_redis:
            with contextlib.suppress(Exception):
                await self.redis.aclose()
        if self.tracing is not None and not self._shared_tracing:
            await asyncio.to_thread(self.tracing.shutdown)  # the spans still buffered go out
        self._stopped.set()


def _model_name(cfg: WorkerConfig) -> str:
    folder = cfg.engine.model_dir
    if folder is None:  # a simulated worker on a preset's geometry
        assert isinstance(cfg.engine, SimEngineConfig)
        return cfg.engine.spec.name
    return ModelSpec.from_pretrained_dir(folder).name
