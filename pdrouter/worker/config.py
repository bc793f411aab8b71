"""One frozen configuration per worker process, built once by the CLI."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from pdrouter.core.errors import ConfigError
from pdrouter.core.tls import TlsFiles
from pdrouter.core.workers import DEFAULT_HEARTBEAT_INTERVAL_S, DEFAULT_HEARTBEAT_TTL_MS, WorkerRole
from pdrouter.engine.config import EngineConfig
from pdrouter.engine.faults import EngineFault
from pdrouter.engine.sim.config import SimEngineConfig
from pdrouter.engine.vllm.config import VllmEngineConfig
from pdrouter.transfer.config import check_tcp_congestion
from pdrouter.wire.grpc_limits import GrpcLimits
from pdrouter.wire.lane.limits import LaneLimits
from pdrouter.wire.security import PeerSecurity

KV_BACKENDS = ("tcp", "gloo", "nccl")


@dataclass(frozen=True)
class WorkerConfig:
    """How to run one prefill, decode or colocated worker."""

    role: WorkerRole
    worker_id: str
    engine: EngineConfig | SimEngineConfig | VllmEngineConfig
    """The torch engine's configuration, a simulated GPU's or vLLM's (``pdrouter.worker.backend``)."""
    host: str = "127.0.0.1"
    port: int = 0
    advertise_host: str | None = None
    """The host others dial (default: ``host``, or 127.0.0.1 when binding 0.0.0.0)."""
    redis_url: str | None = field(default=None, repr=False)
    """Registry, heartbeats and the prefix index; None runs standalone (static router lists). Kept out of
    the repr: it may carry a password."""
    model_name: str | None = None
    """The name the model is served under; default: the model folder's name."""
    pool: str | None = None
    """The model pool name in Redis; default: the served model name."""
    kv_backend: str = "tcp"
    kv_port: int = 0
    kv_auth_token: str = field(default="", repr=False)
    kv_tcp_congestion: str | None = None
    """The TCP congestion control of the KV connections (``TransferConfig.tcp_congestion``); None: the host's."""
    heartbeat_interval_s: float = DEFAULT_HEARTBEAT_INTERVAL_S
    heartbeat_ttl_ms: int = DEFAULT_HEARTBEAT_TTL_MS
    lease_ms: int = 30_000
    """An allocation nobody follows up within this long is freed (decode workers)."""
    max_lease_ms: int = 120_000
    """The longest lease an ``Allocate`` may ask for; a longer one is refused (INVALID_ARGUMENT)."""
    decode_kv_addresses: tuple[str, ...] = ()
    """Prefill workers without ``redis_url``: the decode KV receivers (host:port) they may send KV
    to. With a registry the pool's registered decode workers are the ones; with neither, none."""
    kv_wait_s: float = 60.0
    """How long a decode request waits for its KV to land."""
    drain_grace_s: float = 10.0
    lane_port: int | None = 0
    """Port of the worker lane, the router's fast path (0: any free port; None: gRPC only)."""
    lane_limits: LaneLimits = field(default_factory=LaneLimits)
    """What one lane connection may take: handshake and per-frame deadlines, buffered bytes, connections."""
    grpc_limits: GrpcLimits = field(default_factory=GrpcLimits)
    """The gRPC port's deadlines and caps (handshake, idle, age, connections, streams, message size)."""
    internal_token: str | None = field(default=None, repr=False)
    """The secret every internal caller (router, decode workers) must present (``PDROUTER_INTERNAL_TOKEN``);
    None: no secret (then only mutual TLS, if any, authenticates callers)."""
    tls: TlsFiles | None = None
    """TLS for the worker's ports (gRPC, lane, KV) and its own calls out; with a CA, mutual TLS."""
    engine_fault: EngineFault | None = None
    """A fault injected into the engine's model step, for tests (``PDROUTER_ENGINE_FAULT``,
    ``pdrouter.engine.faults``); None in service."""

    def __post_init__(self) -> None:
        if not self.worker_id or any(c in self.worker_id for c in " :{}"):
            raise ConfigError("worker id must be non-empty without spaces, ':' or braces, "
                              f"got {self.worker_id!r}")
        if self.kv_backend not in KV_BACKENDS:
            raise ConfigError(f"kv backend must be one of {KV_BACKENDS}, got {self.kv_backend!r}")
        if self.kv_tcp_congestion is not None:
            check_tcp_congestion(self.kv_tcp_congestion)
        for name, port in (("port", self.port), ("kv port", self.kv_port), ("lane port", self.lane_port or 0)):
            if not 0 <= port < 65536:
                raise ConfigError(f"the {name} must be in [0, 65535], got {port}")
        if not (math.isfinite(self.heartbeat_interval_s) and self.heartbeat_interval_s > 0):
            raise ConfigError(f"--heartbeat-interval-s must be > 0, got {self.heartbeat_interval_s}")
        if self.heartbeat_interval_s * 1000 >= self.heartbeat_ttl_ms:
            raise ConfigError(f"the heartbeat interval ({self.heartbeat_interval_s} s) must be shorter than the "
                              f"heartbeat TTL ({self.heartbeat_ttl_ms} ms): a TTL of 2-3 times the interval "
                              f"rides out a late heartbeat")
        if self.lease_ms <= 0 or self.kv_wait_s <= 0:
            raise ConfigError("lease_ms and kv_wait_s must be > 0")
        if self.lease_ms > self.max_lease_ms:
            raise ConfigError(f"the lease ({self.lease_ms} ms) must not exceed --max-lease-ms ({self.max_lease_ms})")
        if self.decode_kv_addresses and self.redis_url:
            raise ConfigError("--decode-kv-addresses is for prefill workers without --redis; with --redis the "
                              "registry names the decode workers")
        for address in self.decode_kv_addresses:
            host, sep, number = address.rpartition(":")
            if not sep or not host or not number.isdigit() or not 0 < int(number) < 65536:
                raise ConfigError(f"--decode-kv-addresses takes host:port entries, got {address!r}")

    @property
    def security(self) -> PeerSecurity:
        """The credentials of the worker's servers and of its calls to other workers."""
        return PeerSecurity(self.internal_token, self.tls)

    @property
    def public_host(self) -> str:
        if self.advertise_host:
            return self.advertise_host
        return "127.0.0.1" if self.host in ("0.0.0.0", "::", "") else self.host
