"""What a worker role adds to the common worker process, and what the process hands it.

The process (``pdrouter.worker.process``) owns what every worker has: Redis presence, the engine
(behind the engine contract, ``pdrouter.worker.engine_contract``), the gRPC server and the worker
lane. A role (prefill, decode, colocated; built by ``pdrouter.worker.roles.build_role``) is given a
``RoleContext`` once the engine is up and returns a ``Role``: the services it serves (the process
serves each over gRPC and over the lane), the address its KV receiver listens on (decode workers)
and ``close``. The process knows nothing else of a role, and a role nothing of the process.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from pdrouter.core.errors import ConfigError
from pdrouter.core.ids import Epoch
from pdrouter.core.tracing import Tracing
from pdrouter.state.registry import WorkerRegistry
from pdrouter.transfer.config import Backend, TransferConfig, describe_tcp_congestion
from pdrouter.transfer.pool_bytes import PoolBytes
from pdrouter.transfer.vllm.host import ConnectorHost
from pdrouter.worker.backend import TransferPacing, kv_pool
from pdrouter.worker.config import WorkerConfig
from pdrouter.worker.driver import EngineDriver
from pdrouter.worker.engine_contract import DisaggregatedEngine, ServingEngine
from pdrouter.worker.transfer_tally import TransferTally

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RoleContext:
    """The parts of a started worker process that a role builds on."""

    config: WorkerConfig
    engine: ServingEngine
    """The worker's engine, behind the engine contract."""
    epoch: Epoch
    model_compat_hash: str
    registry: WorkerRegistry | None = None
    """The pool's registry (None without ``--redis``)."""
    pacing: TransferPacing | None = None
    """A simulated worker's modeled KV-transfer time (None: a real engine, transfers take what they take)."""
    tracing: Tracing | None = None
    """The process's tracer (None: tracing off); a role's servicers continue their callers' traces."""
    transfers: TransferTally = field(default_factory=TransferTally)
    """Where the role records its KV transfers (the worker's heartbeats carry the totals)."""
    connector: ConnectorHost | None = None
    """A vLLM prefill or decode worker's KV connector (``pdrouter.worker.kv_connector``): its engine moves
    the KV itself; None for every other worker."""

    def disaggregated(self) -> DisaggregatedEngine:
        """The engine as prefill and decode roles need it (its KV moves); ConfigError for one that cannot."""
        if not isinstance(self.engine, DisaggregatedEngine):
            raise ConfigError(f"a {self.config.role.value} worker needs an engine whose KV the worker moves; "
                              f"{self.engine.identity.name} serves colocated workers only")
        return self.engine

    def kv_pool(self) -> PoolBytes:
        """The pool the role's KV transport moves (``pdrouter.worker.backend.kv_pool``); one per role."""
        engine = self.disaggregated()
        assert isinstance(engine, EngineDriver), "the KV transport moves the project's engine's pool"
        return kv_pool(engine.engine)

    def transfer(self) -> TransferConfig:
        """The KV transport's identity for this incarnation: shared token, this epoch, the backend, TLS.

        Raises ``ConfigError`` without a token; only roles that move KV ask for it.
        """
        cfg = self.config
        config = TransferConfig(auth_token=cfg.kv_auth_token, epoch=self.epoch, backend=Backend(cfg.kv_backend),
                                tls=cfg.tls, tcp_congestion=cfg.kv_tcp_congestion)
        log.info("%s", describe_tcp_congestion(cfg.kv_tcp_congestion))
        return config


@dataclass(frozen=True)
class Service:
    """One gRPC service of a role: ``add_to_server(servicer, server)`` is the generated ``add_XServicer_to_server``."""

    add_to_server: Callable[[Any, Any], None]
    servicer: object
    name: str
    """The full service name, e.g. ``pdrouter.v1.DecodeWorker`` (health checks and reflection)."""


class Role(Protocol):
    """A started role: the services it serves, its KV address, and how it shuts down."""

    @property
    def kv_address(self) -> str:
        """host:port of the KV receiver (decode workers), or empty."""
        ...

    def services(self) -> Sequence[Service]: ...

    async def close(self) -> None:
        """Release what the role holds (KV transport, links); called after the servers drained."""
        ...


RoleFactory = Callable[[RoleContext], Awaitable[Role]]
"""Builds a role for a started process (``pdrouter.worker.roles.build_role``)."""
