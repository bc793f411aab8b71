"""The router's configuration: one frozen object, built once by the CLI."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from pdrouter.core.errors import ConfigError
from pdrouter.core.tenants import Tenants
from pdrouter.core.tls import TlsFiles
from pdrouter.router.admission import AdmissionConfig
from pdrouter.router.dispatch import DispatchConfig
from pdrouter.router.frontdoor.auth import ApiKeys
from pdrouter.router.frontdoor.limits import HttpLimits
from pdrouter.router.frontdoor.served_models import FrontdoorConfig
from pdrouter.router.placement.cache_aware import CacheAwareConfig
from pdrouter.state.client import MIN_CONNECTIONS
from pdrouter.wire.grpc_limits import GrpcLimits
from pdrouter.wire.security import PeerSecurity, check_token


@dataclass(frozen=True)
class RouterConfig:
    """Everything one router process needs."""

    model_dir: Path
    """A model folder with config.json and the tokenizer (weights are not read)."""
    model_name: str | None = None
    redis_url: str | None = field(default=None, repr=False)
    """May hold a password: left out of the repr (log it with ``pdrouter.core.redact.redact_url``)."""
    static_workers: tuple[str, ...] = ()
    mode: Literal["disaggregated", "colocated"] = "disaggregated"
    host: str = "127.0.0.1"
    http_port: int = 8000
    grpc_port: int = 50051
    metrics_port: int | None = None
    """Serve ``/metrics`` on a listener of its own (no key asked) instead of on the HTTP port; 0: any free port."""
    metrics_host: str | None = None
    """Bind host of the metrics listener (None: ``host``)."""
    api_keys: ApiKeys = field(default_factory=ApiKeys)
    """The keys both front doors ask for (none: the doors are open)."""
    tenants: Tenants | None = None
    """Whose key is whose, and each tenant's limits, priority, weight and cache policy
    (``--tenants``, ``pdrouter.core.tenants``); None: no tenants, every request as before."""
    tls: TlsFiles | None = None
    """TLS: the front doors serve ``cert``/``key`` (no client certificate asked), and the calls to
    the workers verify them against ``ca`` and present ``cert`` (mutual TLS). None: plaintext."""
    internal_token: str | None = field(default=None, repr=False)
    """The secret the workers ask of every internal call (``PDROUTER_INTERNAL_TOKEN``); None: none sent."""
    block_size: int = 16
    hash_seed: int = 0
    cache_aware: bool = True
    admission: bool = True
    redis_max_connections: int = 64
    """Connections of the router's Redis pool; a call that finds them all busy waits for one (up
    to ``redis_pool_timeout_s``) instead of failing (``pdrouter.state.client``)."""
    redis_pool_timeout_s: float = 5.0
    refresh_interval_s: float = 1.0
    worker_transport: Literal["lane", "grpc"] = "lane"
    """How requests reach the workers: the worker lane where a worker serves one (the fast path),
    else gRPC; or always gRPC."""
    grpc_server: Literal["builtin", "grpcio"] = "builtin"
    """The gRPC door's server: ``pdrouter.wire.h2_grpc.H2GrpcServer`` (written for the door) or grpcio's
    asyncio server (``pdrouter.wire.grpc_util.GrpcServer``)."""
    dispatch: DispatchConfig = field(default_factory=DispatchConfig)
    placement: CacheAwareConfig = field(default_factory=CacheAwareConfig)
    admission_config: AdmissionConfig = field(default_factory=AdmissionConfig)
    frontdoor: FrontdoorConfig = field(default_factory=FrontdoorConfig)
    http_limits: HttpLimits = field(default_factory=HttpLimits)
    """Slow-client and overload limits of both HTTP doors (the API door and the metrics listener)."""
    grpc_limits: GrpcLimits = field(default_factory=GrpcLimits.for_door)
    """Limits of the gRPC door (its largest request is the HTTP door's largest body)."""

    @property
    def placement_policy(self) -> str:
        """The placement policy's name (``pdrouter.router.placement.policies``): cache-aware, or by load alone."""
        return "cache_aware" if self.cache_aware else "least_loaded"

    @property
    def worker_security(self) -> PeerSecurity:
        """The credentials of the router's calls to its workers."""
        return PeerSecurity(self.internal_token, self.tls)

    def __post_init__(self) -> None:
        object.__setattr__(self, "model_dir", Path(self.model_dir))
        if self.internal_token is not None:
            check_token(self.internal_token)
        if not self.redis_url and not self.static_workers:
            raise ConfigError("the router needs --redis (worker registry) or --workers (a static list)")
        for port in (self.http_port, self.grpc_port, *([] if self.metrics_port is None else [self.metrics_port])):
            if not 0 <= port < 65536:
                raise ConfigError(f"ports must be in [0, 65535], got {port}")
        if self.mode not in ("disaggregated", "colocated"):
            raise ConfigError(f"mode must be disaggregated or colocated, got {self.mode!r}")
        if self.worker_transport not in ("lane", "grpc"):
            raise ConfigError(f"worker transport must be lane or grpc, got {self.worker_transport!r}")
        if self.block_size <= 0:
            raise ConfigError(f"block size must be > 0, got {self.block_size}")
        if self.redis_max_connections < MIN_CONNECTIONS or self.redis_pool_timeout_s <= 0:
            raise ConfigError(f"the Redis pool (--redis-max-connections) needs at least {MIN_CONNECTIONS} "
                              f"connections and a wait > 0 s for one, got {self.redis_max_connections} and "
                              f"{self.redis_pool_timeout_s:g} s")
