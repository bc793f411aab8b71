"""KV capacity math, from first principles.

    KV bytes per token  = 2 (K and V) × layers × kv_heads × head_dim × dtype bytes   (kv_heads / TP per rank)
    KV pool bytes       = GPU memory × utilization − weights / TP − activation/graph overhead
    max concurrency     ≈ KV pool bytes ÷ (KV bytes per token × average context)
    decode upper bound  ≈ memory bandwidth ÷ weight bytes          (one stream, weights read once per token)
    utilization (quota) = memory quota ÷ physical memory            (HAMi ``nvidia.com/gpumem``)

Everything here is pure arithmetic on ``ModelSpec`` and ``GpuSpec``; admission, the engine's pool
sizing and ``pdrouter capacity`` all call these same functions.
"""

from __future__ import annotations

import math
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


def kv_pool_bytes(memory_bytes: int, utilization: float, weight_bytes: int,
                  overhead_bytes: int = DEFAULT_OVERHEAD_BYTES) -> int:
    """memory × utilization − weights − overhead; ConfigError when nothing is left for KV."""
    if not 0.0 < utilization <= 1.0:
        raise ConfigError(f"utilization must be in (0, 1], got {utilization}")
    if memory_bytes <= 0:
        raise ConfigError(f"memory must be > 0 bytes, got {memory_bytes}")
    if overhead_bytes < 0:
        raise ConfigError(f"overhead must be >= 0 bytes, got {overhead_bytes}")
    budget = int(memory_bytes * utilization)
    pool = budget - weight_bytes - overhead_bytes
    if pool <= 0:
        raise ConfigError(
            f"the KV pool does not fit: {budget / GiB:.1f} GiB budget ({utilization:.2f} × "
            f"{memory_bytes / GiB:.1f} GiB) − {weight_bytes / GiB:.1f} GiB weights − "
            f"{overhead_bytes / GiB:.1f} GiB overhead = {pool / GiB:.1f} GiB; "
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


def check_utilization_against_quota(utilization: float, quota_bytes: int, physical_bytes: int) -> None:
    """Refuse a utilization whose budget exceeds the quota (the pool init would be OOM-killed)."""
    allowed = utilization_from_quota(quota_bytes, physical_bytes)
    if utilization * physical_bytes > quota_bytes * (1 + 1e-9):
        raise ConfigError(
            f"utilization {utilization:.2f} × {physical_bytes / GiB:.0f} GiB = "
            f"{utilization * physical_bytes / GiB:.1f} GiB exceeds the {quota_bytes / GiB:.1f} GiB "
            f"memory quota: "
            f"the engine would size its KV pool past the quota and be OOM-killed at start; "
            f"use utilization <= {allowed:.2f} (quota ÷ physical memory)")


def quota_for_pool(spec: ModelSpec, pool_bytes: int, tp: int = 1,
                   overhead_bytes: int = DEFAULT_OVERHEAD_BYTES) -> int:
    """Memory quota a pod needs: weights/TP + the wanted KV pool + overhead."""
    return weight_bytes_per_rank(spec, tp) + pool_bytes + overhead_bytes


def decode_tokens_per_s_bound(spec: ModelSpec, gpu: GpuSpec, tp: int = 1) -> float:
    """Single-stream decode ceiling: every token reads every weight once (TP ranks read in parallel)."""
    return gpu.bandwidth_bytes_per_s / weight_bytes_per_rank(spec, tp)


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
    if quota_bytes is not None:
        derived = utilization_from_quota(quota_bytes, gpu.memory_bytes)
        if utilization is None:
            utilization = derived
        else:
            check_utilization_against_quota(utilization, quota_bytes, gpu.memory_bytes)
    if utilization is None:
        raise ConfigError("give a utilization or a memory quota")
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
