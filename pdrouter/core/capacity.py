"""KV capacity math, from first principles.

    KV bytes per token  = 2 (K and V) × layers × kv_heads × head_dim × dtype bytes   (kv_heads / TP per rank)
    KV pool bytes       = GPU memory × utilization − weights / TP − activation/graph overhead
    max concurrency     ≈ KV pool bytes ÷ (KV bytes per token × average context)
    decode upper bound  ≈ memory bandwidth ÷ weight bytes          (one stream, weights read once per token)
    utilization (quota) = memory quota ÷ physical memory            (HAMi ``nvidia.com/gpumem``)

Everything here is pure arithmetic on ``ModelSpec`` and ``GpuSpec``; admission, the engine's pool
sizing and ``pdrouter capacity`` all call these same functions. ``plan_tp`` tries every
tensor-parallel size that splits the KV heads evenly and names the smallest that fits;
``memory_quota_from_env`` reads HAMi's in-container limit from an environment mapping the caller
passes (this module reads no environment itself).
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass

from pdrouter.core.errors import ConfigError
from pdrouter.core.gpu import GiB, GpuSpec
from pdrouter.core.model_spec import DTYPE_BYTES, ModelSpec, normalize_dtype

DEFAULT_BLOCK_SIZE = 16
DEFAULT_OVERHEAD_BYTES = 2 * GiB
"""Activations, CUDA graphs and the context's own allocations: the seed's "about 2-3 GB" floor."""


def _check_tp(spec: ModelSpec, tp: int) -> None:
    if tp <= 0:
        raise ConfigError(f"tensor parallel size must be >= 1, got {tp}")
    if spec.num_kv_heads % tp and tp % spec.num_kv_heads:
        raise ConfigError(f"tp={tp} does not divide {spec.num_kv_heads} KV heads of {spec.name} "
                          f"(nor the other way round)")


def kv_heads_per_rank(spec: ModelSpec, tp: int = 1) -> int:
    """KV heads held by one TP rank (heads are replicated when TP exceeds the KV head count)."""
    _check_tp(spec, tp)
    return max(1, spec.num_kv_heads // tp)


def kv_bytes_per_token(spec: ModelSpec, tp: int = 1, kv_dtype: str | None = None) -> int:
    """2 × layers × kv_heads(/TP) × head_dim × dtype bytes."""
    dtype_bytes = DTYPE_BYTES[normalize_dtype(kv_dtype)] if kv_dtype else spec.dtype_bytes
    return 2 * spec.num_layers * kv_heads_per_rank(spec, tp) * spec.head_dim * dtype_bytes


def kv_bytes_for_context(spec: ModelSpec, tokens: int, tp: int = 1, kv_dtype: str | None = None) -> int:
    """KV bytes that ``tokens`` tokens of context occupy on one rank."""
    if tokens < 0:
        raise ConfigError(f"context must be >= 0 tokens, got {tokens}")
    return kv_bytes_per_token(spec, tp, kv_dtype) * tokens


def weight_bytes_per_rank(spec: ModelSpec, tp: int = 1) -> int:
    _check_tp(spec, tp)
    return math.ceil(spec.weight_bytes / tp)


def blocks_for_tokens(tokens: int, block_size: int = DEFAULT_BLOCK_SIZE) -> int:
    """ceil(tokens / block_size): the blocks a sequence of ``tokens`` tokens occupies."""
    if block_size <= 0:
        raise ConfigError(f"block size must be > 0, got {block_size}")
    return -(-tokens // block_size)


def _pool_room(memory_bytes: int, utilization: float, weight_bytes: int, overhead_bytes: int) -> int:
    """memory × utilization − weights − overhead, possibly <= 0; ConfigError for impossible inputs."""
    if not 0.0 < utilization <= 1.0:
        raise ConfigError(f"utilization must be in (0, 1], got {utilization}")
    if memory_bytes <= 0:
        raise ConfigError(f"memory must be > 0 bytes, got {memory_bytes}")
    if overhead_bytes < 0:
        raise ConfigError(f"overhead must be >= 0 bytes, got {overhead_bytes}")
    return int(memory_bytes * utilization) - weight_bytes - overhead_bytes


def _no_room(memory_bytes: int, utilization: float, weight_bytes: int, overhead_bytes: int) -> str:
    budget = int(memory_bytes * utilization)
    pool = budget - weight_bytes - overhead_bytes
    return (f"{budget / GiB:.1f} GiB budget ({utilization:.2f} × {memory_bytes / GiB:.1f} GiB) − "
            f"{weight_bytes / GiB:.1f} GiB weights − {overhead_bytes / GiB:.1f} GiB overhead = "
            f"{pool / GiB:.1f} GiB")


def kv_pool_bytes(memory_bytes: int, utilization: float, weight_bytes: int,
                  overhead_bytes: int = DEFAULT_OVERHEAD_BYTES) -> int:
    """memory × utilization − weights − overhead; ConfigError when nothing is left for KV."""
    pool = _pool_room(memory_bytes, utilization, weight_bytes, overhead_bytes)
    if pool <= 0:
        raise ConfigError(
            f"the KV pool does not fit: {_no_room(memory_bytes, utilization, weight_bytes, overhead_bytes)}; "
            f"raise tensor parallelism, utilization or memory, or use a smaller model/dtype")
    return pool


def utilization_from_quota(quota_bytes: int, physical_bytes: int) -> float:
    """The ``gpu_memory_utilization`` that keeps an engine inside a memory quota: quota ÷ physical."""
    if quota_bytes <= 0 or physical_bytes <= 0:
        raise ConfigError(f"quota and physical memory must be > 0, got {quota_bytes} and {physical_bytes}")
    if quota_bytes > physical_bytes:
        raise ConfigError(f"memory quota {quota_bytes / GiB:.1f} GiB exceeds the card's "
                          f"{physical_bytes / GiB:.1f} GiB")
    return quota_bytes / physical_bytes


def check_utilization_against_quota(utilization: float, quota_bytes: int, physical_bytes: int,
                                    source: str | None = None) -> None:
    """Refuse a utilization whose budget exceeds the quota (the pool init would be OOM-killed).

    ``source`` names where the quota came from (``CUDA_DEVICE_MEMORY_LIMIT_0=40g``) in the message.
    """
    allowed = utilization_from_quota(quota_bytes, physical_bytes)
    if utilization * physical_bytes > quota_bytes * (1 + 1e-9):
        where = f" ({source})" if source else ""
        raise ConfigError(
            f"utilization {utilization:.2f} × {physical_bytes / GiB:.0f} GiB = "
            f"{utilization * physical_bytes / GiB:.1f} GiB exceeds the {quota_bytes / GiB:.1f} GiB "
            f"memory quota{where}: "
            f"the engine would size its KV pool past the quota and be OOM-killed at start; "
            f"use utilization <= {allowed:.2f} (quota ÷ physical memory)")


def quota_for_pool(spec: ModelSpec, pool_bytes: int, tp: int = 1,
                   overhead_bytes: int = DEFAULT_OVERHEAD_BYTES) -> int:
    """Memory quota a pod needs: weights/TP + the wanted KV pool + overhead."""
    return weight_bytes_per_rank(spec, tp) + pool_bytes + overhead_bytes


def decode_tokens_per_s_bound(spec: ModelSpec, gpu: GpuSpec, tp: int = 1) -> float:
    """Single-stream decode ceiling: every token reads every weight once (TP ranks read in parallel)."""
    return gpu.bandwidth_bytes_per_s / weight_bytes_per_rank(spec, tp)


def resolve_utilization(utilization: float | None, quota_bytes: int | None, physical_bytes: int, *,
                        default: float | None = None, source: str | None = None) -> float:
    """The utilization to plan a pool with: ``utilization`` when given (refused above the quota),
    else quota ÷ physical memory, else ``default`` (ConfigError when there is none).

    ``source`` names where the quota came from, for the messages (``CUDA_DEVICE_MEMORY_LIMIT_0=40g``).
    """
    if quota_bytes is not None:
        try:
            derived = utilization_from_quota(quota_bytes, physical_bytes)
        except ConfigError as exc:
            raise ConfigError(f"{source}: {exc.message}" if source else exc.message) from None
        if utilization is None:
            return derived
        check_utilization_against_quota(utilization, quota_bytes, physical_bytes, source)
        return utilization
    if utilization is not None:
        return utilization
    if default is None:
        raise ConfigError("give a utilization or a memory quota")
    return default


@dataclass(frozen=True)
class CapacityPlan:
    """What one GPU (one TP rank) can hold, for one model at one average context."""

    model: str
    gpu: str
    tp: int
    context: int
    block_size: int
    utilization: float
    memory_bytes: int
    overhead_bytes: int
    weight_bytes_per_rank: int
    kv_bytes_per_token: int
    kv_bytes_per_request: int
    kv_pool_bytes: int
    num_blocks: int
    max_concurrency: int
    decode_tokens_per_s_bound: float
    quota_bytes: int | None = None

    @property
    def pool_tokens(self) -> int:
        return self.num_blocks * self.block_size

    @property
    def quota_utilization(self) -> float | None:
        return None if self.quota_bytes is None else self.quota_bytes / self.memory_bytes


def plan_capacity(spec: ModelSpec, gpu: GpuSpec, *, tp: int = 1, context: int = 4096,
                  utilization: float | None = 0.9, quota_bytes: int | None = None,
                  block_size: int = DEFAULT_BLOCK_SIZE,
                  overhead_bytes: int = DEFAULT_OVERHEAD_BYTES,
                  kv_dtype: str | None = None) -> CapacityPlan:
    """The whole capacity table for a model on a GPU.

    With ``quota_bytes`` and no ``utilization`` the utilization is derived from the quota; with
    both, they are checked against each other (ConfigError when the utilization exceeds it).
    """
    if context <= 0:
        raise ConfigError(f"context must be > 0 tokens, got {context}")
    if block_size <= 0:
        raise ConfigError(f"block size must be > 0, got {block_size}")
    utilization = resolve_utilization(utilization, quota_bytes, gpu.memory_bytes)
    per_token = kv_bytes_per_token(spec, tp, kv_dtype)
    weights = weight_bytes_per_rank(spec, tp)
    pool = kv_pool_bytes(gpu.memory_bytes, utilization, weights, overhead_bytes)
    num_blocks = pool // (per_token * block_size)
    return CapacityPlan(
        model=spec.name, gpu=gpu.name, tp=tp, context=context, block_size=block_size,
        utilization=utilization, memory_bytes=gpu.memory_bytes, overhead_bytes=overhead_bytes,
        weight_bytes_per_rank=weights, kv_bytes_per_token=per_token,
        kv_bytes_per_request=per_token * context, kv_pool_bytes=pool, num_blocks=num_blocks,
        max_concurrency=num_blocks // blocks_for_tokens(context, block_size),
        decode_tokens_per_s_bound=decode_tokens_per_s_bound(spec, gpu, tp),
        quota_bytes=quota_bytes,
    )


def pool_blocks_for_budget(spec: ModelSpec, memory_budget_bytes: int, utilization: float,
                           block_size: int = DEFAULT_BLOCK_SIZE,
                           overhead_bytes: int = 0, tp: int = 1) -> int:
    """Blocks an engine allocates for a memory budget (the engine's pool sizing on CPU or GPU)."""
    pool = kv_pool_bytes(memory_budget_bytes, utilization, weight_bytes_per_rank(spec, tp), overhead_bytes)
    return pool // (kv_bytes_per_token(spec, tp) * block_size)


# -- tensor parallelism: the smallest size that fits ---------------------------------------------


def tp_sizes(spec: ModelSpec) -> tuple[int, ...]:
    """The tensor-parallel sizes worth planning: powers of two that divide the KV heads (1, 2, 4, 8 for 8)."""
    sizes = [1]
    while spec.num_kv_heads % (sizes[-1] * 2) == 0:
        sizes.append(sizes[-1] * 2)
    return tuple(sizes)


@dataclass(frozen=True)
class ModelFigures:
    """What a model costs whatever the pool: the whole model's KV and weights, and the TP-1 decode ceiling."""

    kv_bytes_per_token: int
    context: int
    kv_bytes_per_request: int
    """KV bytes of one request of ``context`` tokens."""
    weight_bytes: int
    decode_tokens_per_s_bound: float
    """One stream at TP 1: memory bandwidth ÷ weight bytes (every token reads every weight once)."""


def model_figures(spec: ModelSpec, gpu: GpuSpec, context: int, kv_dtype: str | None = None) -> ModelFigures:
    per_token = kv_bytes_per_token(spec, 1, kv_dtype)
    return ModelFigures(kv_bytes_per_token=per_token, context=context, kv_bytes_per_request=per_token * context,
                        weight_bytes=spec.weight_bytes, decode_tokens_per_s_bound=decode_tokens_per_s_bound(spec, gpu))


@dataclass(frozen=True)
class TpOption:
    """One tensor-parallel size: its plan (None when weights and overhead leave no pool) and, when it
    falls short, why."""

    tp: int
    weight_bytes_per_rank: int
    plan: CapacityPlan | None
    shortfall: str = ""
    """Empty when the size fits: the pool holds at least the wanted concurrency."""

    @property
    def fits(self) -> bool:
        return self.plan is not None and not self.shortfall


@dataclass(frozen=True)
class TpSizing:
    """A model on a GPU at every tensor-parallel size of ``tp_sizes`` (and the one asked for)."""

    figures: ModelFigures
    utilization: float
    """The utilization every option is planned with (given, or derived from the quota)."""
    requested_tp: int
    min_concurrency: int
    options: tuple[TpOption, ...]
    """By increasing TP."""

    @property
    def requested(self) -> TpOption:
        return next(o for o in self.options if o.tp == self.requested_tp)

    @property
    def fits(self) -> bool:
        """Whether the requested TP fits."""
        return self.requested.fits

    @property
    def chosen(self) -> TpOption | None:
        """The requested TP when it fits, else the smallest larger one that does (None: none does)."""
        return next((o for o in self.options if o.tp >= self.requested_tp and o.fits), None)


def plan_tp(spec: ModelSpec, gpu: GpuSpec, *, tp: int = 1, context: int = 4096,
            utilization: float | None = 0.9, quota_bytes: int | None = None,
            block_size: int = DEFAULT_BLOCK_SIZE, overhead_bytes: int = DEFAULT_OVERHEAD_BYTES,
            kv_dtype: str | None = None, min_concurrency: int = 1) -> TpSizing:
    """``plan_capacity`` at each TP size, never failing for lack of room: a size whose weights and
    overhead leave no pool, or whose pool holds fewer than ``min_concurrency`` requests of
    ``context`` tokens, is marked short with the reason. ConfigError only for impossible inputs."""
    if min_concurrency < 1:
        raise ConfigError(f"the wanted concurrency must be >= 1, got {min_concurrency}")
    if context <= 0:
        raise ConfigError(f"context must be > 0 tokens, got {context}")
    if block_size <= 0:
        raise ConfigError(f"block size must be > 0, got {block_size}")
    _check_tp(spec, tp)
    utilization = resolve_utilization(utilization, quota_bytes, gpu.memory_bytes)
    options = []
    for size in sorted({*tp_sizes(spec), tp}):
        weights = weight_bytes_per_rank(spec, size)
        if _pool_room(gpu.memory_bytes, utilization, weights, overhead_bytes) <= 0:
            reason = _no_room(gpu.memory_bytes, utilization, weights, overhead_bytes)
            options.append(TpOption(size, weights, None, reason))
            continue
        plan = plan_capacity(spec, gpu, tp=size, context=context, utilization=utilization, quota_bytes=quota_bytes,
                             block_size=block_size, overhead_bytes=overhead_bytes, kv_dtype=kv_dtype)
        shortfall = ""
        if plan.max_concurrency < min_concurrency:
            wanted = "one" if min_concurrency == 1 else f"{min_concurrency} concurrent"
            shortfall = (f"its {plan.kv_pool_bytes / GiB:.2f} GiB KV pool holds {plan.max_concurrency} "
                         f"{context}-token requests ({plan.kv_bytes_per_request / GiB:.2f} GiB each per rank), "
                         f"not {wanted}")
        options.append(TpOption(size, weights, plan, shortfall))
    return TpSizing(model_figures(spec, gpu, context, kv_dtype), utilization, tp, min_concurrency, tuple(options))


# -- memory quotas from the environment ----------------------------------------------------------

HAMI_MEMORY_LIMIT_ENV = "CUDA_DEVICE_MEMORY_LIMIT"
"""HAMi's in-container memory limit: ``CUDA_DEVICE_MEMORY_LIMIT_<i>`` for visible device ``i``, else
``CUDA_DEVICE_MEMORY_LIMIT`` for every device."""
_SIZE = re.compile(r"(\d+(?:\.\d+)?)\s*([kmgt]?)(?:ib?|b)?", re.IGNORECASE)
_UNIT = {"": 1, "k": 1024, "m": 1024**2, "g": 1024**3, "t": 1024**4}


def parse_memory_size(text: str) -> int:
    """Bytes of ``40g``, ``40G``, ``40960m``, ``40Gi`` or plain bytes; k/m/g/t are powers of 1024, as
    HAMi reads them. ConfigError for anything else."""
    m = _SIZE.fullmatch(text.strip())
    if m is None:
        raise ConfigError(f"{text!r} is not a memory size (such as 40g, 40960m or a number of bytes)")
    return int(float(m.group(1)) * _UNIT[m.group(2).lower()])


@dataclass(frozen=True)
class MemoryQuota:
    """A memory limit on one GPU, and where it was read (for the messages that name it)."""

    bytes: int
    source: str
    """``--quota-gb 40`` or ``CUDA_DEVICE_MEMORY_LIMIT_0=40g``."""


def memory_quota_from_env(environ: Mapping[str, str], device_index: int = 0) -> MemoryQuota | None:
    """HAMi's limit for visible device ``device_index``: its own variable, else the shared one.

    None when neither is set (or the value is empty or 0, which HAMi treats as no limit).
    """
    for name in (f"{HAMI_MEMORY_LIMIT_ENV}_{device_index}", HAMI_MEMORY_LIMIT_ENV):
        raw = environ.get(name, "").strip()
        if not raw:
            continue
        try:
            size = parse_memory_size(raw)
        except ConfigError as exc:
            raise ConfigError(f"{name}: {exc.message}") from None
        return MemoryQuota(size, f"{name}={raw}") if size else None
    return None
