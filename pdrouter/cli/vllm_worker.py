"""``pdrouter worker --backend vllm``: the vLLM engine's configuration from the worker's flags, sized before it starts.

The KV pool follows the memory the worker may use, through the same capacity math as
``pdrouter capacity`` and the torch backend (``pdrouter.core.capacity``):

* **on a GPU** vLLM sizes its pool itself from ``gpu_memory_utilization`` (the memory it may use:
  weights, activations, then KV). Under a memory quota (``--quota-gb``, or HAMi's
  ``CUDA_DEVICE_MEMORY_LIMIT_<i>`` / ``CUDA_DEVICE_MEMORY_LIMIT``) that is quota ÷ the card's
  physical memory, never vLLM's default 0.9: with 0.9 on a 40 GiB quota of an 80 GiB card vLLM
  would plan a 72 GiB footprint and be killed at start, again and again. An explicit utilization
  (``--utilization`` or ``--vllm-arg gpu_memory_utilization=…``) above the quota is refused here,
  in one line, before vLLM is imported. Without a quota: 0.9.
* **on the CPU** vLLM takes its KV space in bytes (``kv_cache_memory_bytes``; its
  ``VLLM_CPU_KVCACHE_SPACE`` variable says the same in whole GiB and overrides it when set). The
  worker gives it the pool the capacity math makes of the budget: ``--quota-gb`` (as utilization
  quota ÷ the machine's memory, of that memory), else ``--kv-memory-gb`` (default 1 GiB) ×
  ``--utilization`` (default 0.9), less the weights. An explicit KV space (``VLLM_CPU_KVCACHE_SPACE``
  or ``--vllm-arg kv_cache_memory_bytes=…``) larger than the quota leaves for KV is refused.

``--num-blocks`` becomes vLLM's ``num_gpu_blocks_override`` (a pool of exactly that many blocks).
The worker logs the predicted pool here and, once vLLM started, the pool vLLM allocated
(``pdrouter.engine.vllm.engine``); docs/vllm.md explains the difference.
"""

from __future__ import annotations

import argparse
import logging
import os
from collections.abc import Callable, Mapping, MutableMapping
from typing import Any

from pdrouter.core.capacity import (
    DEFAULT_BLOCK_SIZE,
    DEFAULT_OVERHEAD_BYTES,
    MemoryQuota,
    kv_pool_bytes,
    resolve_utilization,
    weight_bytes_per_rank,
)
from pdrouter.core.errors import ConfigError
from pdrouter.core.gpu import GiB, get_gpu_preset
from pdrouter.core.model_spec import ModelSpec, normalize_dtype
from pdrouter.engine.vllm.config import OWNED_ARGS, VllmEngineConfig, parse_engine_arg

log = logging.getLogger(__name__)

CPU_BLOCK_SIZE = 32
"""The KV block size of a vLLM worker on the CPU unless ``--block-size`` says: the smallest vLLM's CPU
attention kernels take (they take multiples of 32; vLLM's own CPU default is 128). On a GPU the
worker's default is the router's, 16, which is vLLM's GPU default too."""
DEFAULT_UTILIZATION = 0.9
"""vLLM's own default ``gpu_memory_utilization``, used only without a memory quota."""
CPU_KVCACHE_ENV = "VLLM_CPU_KVCACHE_SPACE"
CPU_DEFAULT_ENV = {"VLLM_CPU_OMP_THREADS_BIND": "nobind"}
"""Set for vLLM on the CPU unless the environment sets them: its default binds one OpenMP thread to
each core, which a worker sharing the machine with a router and other workers must not do."""


def vllm_config(args: argparse.Namespace, environ: Mapping[str, str], quota: MemoryQuota | None,
                device_memory: Callable[[], int]) -> VllmEngineConfig:
    """The engine configuration of ``pdrouter worker --backend vllm``; ConfigError for a bad
    ``--vllm-arg`` or a pool that breaks the memory quota. ``quota``: the memory quota the worker must
    stay within (``--quota-gb``, or HAMi's on a GPU); ``device_memory()``: the GPU's physical memory
    (asked only on a GPU without ``--gpu``)."""
    if args.model is None or not (args.model / "config.json").is_file():
        raise ConfigError(f"--model {args.model} is not a model folder with a config.json (create one with "
                          f"`pdrouter make-model`)")
    passed = dict(parse_engine_arg(item) for item in args.vllm_arg)
    owned = sorted(OWNED_ARGS & set(passed))
    if owned:
        raise ConfigError(f"--vllm-arg {owned[0]}: the worker sets it itself" + (" (use --model)" if owned[0] == "model"
                                                                                  else ""))
    spec = ModelSpec.from_pretrained_dir(args.model)
    dtype = args.dtype or passed.get("dtype")
    if isinstance(dtype, str) and dtype != "auto":
        spec = spec.with_dtype(normalize_dtype(dtype))
    on_gpu = args.device.startswith("cuda")
    explicit_util = args.utilization if args.utilization is not None else passed.pop("gpu_memory_utilization", None)
    if explicit_util is not None and not isinstance(explicit_util, int | float):
        raise ConfigError(f"gpu_memory_utilization must be a number, got {explicit_util!r}")
    if args.num_blocks is not None:
        if args.num_blocks <= 0:
            raise ConfigError(f"--num-blocks must be > 0, got {args.num_blocks}")
        passed["num_gpu_blocks_override"] = args.num_blocks
    utilization: float | None
    if on_gpu:
        utilization, kv_bytes, predicted = _gpu_sizing(args, spec, quota, explicit_util, passed, device_memory)
    else:
        utilization, kv_bytes, predicted = _cpu_sizing(args, spec, quota, explicit_util, passed, environ)
    given_block_size = passed.pop("block_size", None)
    block_size = args.block_size or given_block_size or (DEFAULT_BLOCK_SIZE if on_gpu else CPU_BLOCK_SIZE)
    config = VllmEngineConfig(
        model_dir=args.model, device=args.device, dtype=args.dtype, block_size=int(block_size),
        max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_batched_tokens,
        tensor_parallel_size=args.tp, gpu_memory_utilization=utilization, kv_cache_memory_bytes=kv_bytes,
        predicted_pool_bytes=predicted, engine_args=tuple(passed.items()))
    return config


def _gpu_sizing(args: argparse.Namespace, spec: ModelSpec, quota: MemoryQuota | None, explicit: float | None,
                passed: dict[str, Any], device_memory: Callable[[], int]) -> tuple[float, int | None, int | None]:
    if args.gpu:
        physical = get_gpu_preset(args.gpu).memory_bytes
    elif args.kv_memory_gb:
        physical = int(args.kv_memory_gb * GiB)
    else:
        physical = device_memory()
        if quota is not None and quota.bytes >= physical:  # HAMi already shows the device as the quota
            log.info("the device reports %.2f GiB, within the %.2f GiB memory quota (%s): vLLM plans from the "
                     "device's memory", physical / GiB, quota.bytes / GiB, quota.source)
            quota = None
    source = None if quota is None else quota.source
    utilization = resolve_utilization(explicit, None if quota is None else quota.bytes, physical,
                                      default=DEFAULT_UTILIZATION, source=source)
    kv_bytes = passed.get("kv_cache_memory_bytes")
    if kv_bytes is not None and quota is not None:
        _check_kv_space(int(kv_bytes), quota, spec, args.tp, "--vllm-arg kv_cache_memory_bytes")
    predicted = kv_pool_bytes(physical, utilization, weight_bytes_per_rank(spec, args.tp), DEFAULT_OVERHEAD_BYTES)
    limit = "no memory quota" if quota is None else f"memory quota {quota.bytes / GiB:.2f} GiB ({quota.source})"
    log.info("vLLM KV plan: gpu_memory_utilization %.3f of %.2f GiB (%s); the capacity math predicts a %.2f GiB pool",
             utilization, physical / GiB, limit, predicted / GiB)
    return utilization, None, predicted


def _cpu_sizing(args: argparse.Namespace, spec: ModelSpec, quota: MemoryQuota | None, explicit: float | None,
                passed: dict[str, Any], environ: Mapping[str, str]) -> tuple[float | None, int | None, int | None]:
    physical = machine_memory_bytes()
    weights = weight_bytes_per_rank(spec, args.tp)
    env_space = environ.get(CPU_KVCACHE_ENV, "").strip()
    given: tuple[int, str] | None = None
    if env_space:
        try:
            given = (int(env_space) * GiB, f"{CPU_KVCACHE_ENV}={env_space}")
        except ValueError:
            raise ConfigError(f"{CPU_KVCACHE_ENV} must be a whole number of GiB, got {env_space!r}") from None
    elif passed.get("kv_cache_memory_bytes") is not None:
        given = (int(passed.pop("kv_cache_memory_bytes")), "--vllm-arg kv_cache_memory_bytes")
    if given is not None:
        if quota is not None:
            _check_kv_space(given[0], quota, spec, args.tp, given[1])
        log.info("vLLM KV plan: %.2f GiB of KV space (%s)", given[0] / GiB, given[1])
        return None, None if env_space else given[0], given[0]
    if quota is not None:
        utilization = resolve_utilization(explicit, quota.bytes, physical, source=quota.source)
        budget = physical
    else:
        utilization = DEFAULT_UTILIZATION if explicit is None else float(explicit)
        budget = int((args.kv_memory_gb or 1.0) * GiB)
    kv_bytes = kv_pool_bytes(budget, utilization, weights, 0)
    limit = "no memory quota" if quota is None else f"memory quota {quota.bytes / GiB:.2f} GiB ({quota.source})"
    log.info("vLLM KV plan: %.2f GiB of KV space = %.3f × %.2f GiB − %.2f GiB of weights (%s)", kv_bytes / GiB,
             utilization, budget / GiB, weights / GiB, limit)
    return None, kv_bytes, kv_bytes


def _check_kv_space(kv_bytes: int, quota: MemoryQuota, spec: ModelSpec, tp: int, what: str) -> None:
    room = quota.bytes - weight_bytes_per_rank(spec, tp)
    if kv_bytes > room:
        raise ConfigError(f"{what} asks for {kv_bytes / GiB:.2f} GiB of KV space, but the {quota.bytes / GiB:.2f} GiB "
                          f"memory quota ({quota.source}) leaves {max(room, 0) / GiB:.2f} GiB after the weights")


def machine_memory_bytes() -> int:
    """This machine's physical memory (what vLLM's CPU backend takes its utilization of)."""
    return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))


def apply_vllm_environment(args: argparse.Namespace, environ: MutableMapping[str, str]) -> None:
    """Environment vLLM reads (set before it is imported; its engine processes inherit it): on the CPU
    the defaults of :data:`CPU_DEFAULT_ENV`; ``--torch-threads N`` as ``OMP_NUM_THREADS``."""
    if not args.device.startswith("cuda"):
        for key, value in CPU_DEFAULT_ENV.items():
            environ.setdefault(key, value)
    if args.torch_threads:
        environ["OMP_NUM_THREADS"] = str(args.torch_threads)
