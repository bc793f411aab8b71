"""What a worker is and how loaded it is: the records the registry stores and the router reads."""

from __future__ import annotations

import enum
import json
from dataclasses import asdict, dataclass, field, fields

from pdrouter.core.errors import InvalidRequestError
from pdrouter.core.ids import Epoch, WorkerId

DEFAULT_HEARTBEAT_TTL_MS = 3000
"""A worker whose last heartbeat is older than this is not live (``--heartbeat-ttl-ms``)."""
DEFAULT_HEARTBEAT_INTERVAL_S = 1.0
"""How often a worker heartbeats (``--heartbeat-interval-s``): a third of the TTL, so one late beat
does not end its liveness."""


class WorkerRole(enum.Enum):
    PREFILL = "prefill"
    DECODE = "decode"
    COLOCATED = "colocated"


@dataclass(frozen=True)
class EngineIdentity:
    """What runs a worker's model, as its registry record names it."""

    name: str
    """``torch``, ``sim`` or ``vllm``."""
    version: str
    """The engine's version: pd-router's for its own engines, vLLM's for vLLM."""
    device: str
    """What it runs on: ``cpu``, ``cuda:0``, ``sim:h100-80g``…"""


@dataclass(frozen=True)
class WorkerLoad:
    """A worker's load at one instant (heartbeated)."""

    running: int = 0
    waiting: int = 0
    queued_prefill_tokens: int = 0
    queued_prefill_by_priority: tuple[tuple[int, int], ...] = ()
    """``queued_prefill_tokens`` split by engine priority: (priority, tokens) pairs, lowest value first,
    from a worker whose scheduler computes prompts by priority (the project's engines). Empty from
    one that does not (vLLM): there the whole backlog is ahead of every prompt."""
    free_blocks: int = 0
    total_blocks: int = 0
    allocated_blocks: int = 0
    sim_modeled_s: float = 0.0
    """A simulated GPU's modeled step time so far (simulated seconds; 0 on real engines)."""
    sim_late_s: float = 0.0
    """Of that, how much the machine ran late (see ``SimStepStats.late_s``)."""
    engine_failed: bool = False
    """The worker's engine stopped (its gRPC health is NOT_SERVING): routers place nothing there."""
    prefix_cache_queries: int = 0
    """Prompt tokens the engine looked up in its prefix cache since it started (vLLM's
    ``vllm:prefix_cache_queries``; the project's engine counts each request's first admission)."""
    prefix_cache_hits: int = 0
    """Of those, tokens found cached (vLLM's ``vllm:prefix_cache_hits``)."""
    kv_sent_bytes: int = 0
    """KV bytes this worker sent to decode workers since it started (prefill workers)."""
    kv_received_bytes: int = 0
    """KV bytes that landed in this worker's blocks since it started (decode workers)."""
    kv_transfer_s: float = 0.0
    """Wall time of those transfers, summed."""
    kv_transfer_failures: int = 0
    """Transfers that failed on this worker (it freed their blocks)."""
    taken_at: float = 0.0
    """When the worker took this load (Unix seconds, by its clock; its heartbeat sets it); 0: not known
    (a load asked over gRPC, or a worker of an earlier version)."""

    @property
    def kv_usage(self) -> float:
        """Fraction of the pool's blocks held by requests (0 when the pool size is unknown)."""
        return self.allocated_blocks / self.total_blocks if self.total_blocks else 0.0

    def prefill_tokens_ahead(self, priority: int) -> int:
        """Of the prefill backlog, the tokens a prompt of engine ``priority`` waits for: those queued at
        that priority or a lower value; the whole backlog when the worker does not split it."""
        if not self.queued_prefill_by_priority:
            return self.queued_prefill_tokens
        return sum(tokens for p, tokens in self.queued_prefill_by_priority if p <= priority)

    def to_json(self) -> str:
        return json.dumps(asdict(self), separators=(",", ":"))

    @classmethod
    def from_json(cls, raw: str | bytes) -> WorkerLoad:
        """The load a heartbeat carries; fields this version does not know (a newer worker's) are
        left out, so workers can be upgraded before routers."""
        data = json.loads(raw or "{}")
        known = {k: v for k, v in data.items() if k in _LOAD_FIELDS}
        pairs = known.get("queued_prefill_by_priority")
        if pairs is not None:
            known["queued_prefill_by_priority"] = tuple((int(p), int(t)) for p, t in pairs)
        return cls(**known)


_LOAD_FIELDS = frozenset(f.name for f in fields(WorkerLoad))


@dataclass(frozen=True)
class WorkerRecord:
    """One worker incarnation as registered: identity, model, KV capacity, where to reach it."""

    worker_id: WorkerId
    role: WorkerRole
    address: str
    epoch: Epoch
    model: str
    model_compat_hash: str
    kv_compat_hash: str
    block_size: int
    capacity_blocks: int
    kv_address: str = ""
    kv_backends: tuple[str, ...] = field(default_factory=tuple)
    lane_address: str = ""
    """host:port of the worker lane (``pdrouter.wire.lane``), or empty when it serves gRPC only."""
    device: str = ""
    """What the engine runs on: ``cpu``, ``cuda:0``, or a simulated GPU such as ``sim:h100-80g``."""
    engine: str = ""
    """What runs the model: ``torch``, ``sim`` or ``vllm`` (``EngineIdentity.name``)."""
    engine_version: str = ""
    """Its version: pd-router's for the project's engines, vLLM's for vLLM."""

    @property
    def capacity_tokens(self) -> int:
        return self.capacity_blocks * self.block_size

    @property
    def schedules_by_priority(self) -> bool:
        """Whether the engine computes waiting prompts by engine priority: the project's engines do;
        vLLM does only under its priority policy, which its record does not say, so it counts as not."""
        return self.engine in ("torch", "sim")

    def to_json(self) -> str:
        data = asdict(self)
        data["role"] = self.role.value
        data["kv_backends"] = list(self.kv_backends)
        return json.dumps(data, separators=(",", ":"))

    @classmethod
    def from_json(cls, raw: str | bytes) -> WorkerRecord:
        try:
            data = json.loads(raw)
            data["role"] = WorkerRole(data["role"])
            data["kv_backends"] = tuple(data.get("kv_backends", ()))
            data["worker_id"] = WorkerId(data["worker_id"])
            data["epoch"] = Epoch(int(data["epoch"]))
            return cls(**data)
        except (ValueError, KeyError, TypeError) as exc:
            raise InvalidRequestError(f"malformed worker record: {exc}") from None


@dataclass(frozen=True)
class LiveWorker:
    """A registered worker whose heartbeat is current, with its last reported load."""

    record: WorkerRecord
    load: WorkerLoad
