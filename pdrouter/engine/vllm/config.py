"""How a worker runs vLLM: one frozen configuration, built once by the CLI, that imports no vLLM.

``VllmEngineConfig.engine_kwargs`` turns it into the keyword arguments of vLLM's
``AsyncEngineArgs``: the worker's own settings first (model folder, dtype, block size, batching, the
KV memory it derived from the quota), then the pass-through ``--vllm-arg KEY=VALUE`` arguments,
which may set any other engine argument but not the ones the worker must own
(:data:`OWNED_ARGS`).

Defaults that work on both kinds of machine:

* ``skip_tokenizer_init``: the worker sends token ids (``TokensPrompt``) and detokenizing is the
  router's, so vLLM needs no tokenizer (the folder's is still there for vLLM's own server);
* ``enforce_eager`` on the CPU (no graphs to capture there); on a GPU vLLM's default, CUDA graphs;
* ``disable_log_stats=False``: the worker's load comes from vLLM's scheduler statistics.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pdrouter.core.errors import ConfigError

OWNED_ARGS = frozenset({"model", "kv_events_config", "disable_log_stats", "served_model_name"})
"""Engine arguments the worker sets itself: the folder is ``--model``, the KV events feed the prefix
index, the statistics feed the load reports (a model name is the router's business)."""

SIZING_ARGS = frozenset({"gpu_memory_utilization", "kv_cache_memory_bytes", "num_gpu_blocks_override"})
"""Engine arguments that size the KV pool: given with ``--vllm-arg`` they are checked against a
memory quota before vLLM starts (``pdrouter.cli.worker_cmd``)."""


def parse_engine_arg(item: str) -> tuple[str, Any]:
    """``KEY=VALUE`` of ``--vllm-arg``: the key as vLLM's Python name (``max-model-len`` →
    ``max_model_len``), the value read as JSON when it is JSON (numbers, booleans, objects, lists),
    else the string itself."""
    key, sep, raw = item.partition("=")
    key = key.strip().removeprefix("--").replace("-", "_")
    if not sep or not key or not key.isidentifier():
        raise ConfigError(f"--vllm-arg takes KEY=VALUE (e.g. max_model_len=2048), got {item!r}")
    try:
        value: Any = json.loads(raw)
    except ValueError:
        value = raw
    return key, value


@dataclass(frozen=True)
class VllmEngineConfig:
    """One vLLM engine of a worker (see the module docstring)."""

    model_dir: Path
    device: str = "cpu"
    """``cpu`` or ``cuda`` / ``cuda:N``: which defaults apply (vLLM itself runs on its platform's device)."""
    dtype: str | None = None
    """Weights and KV dtype; None: vLLM's ``auto`` (the folder's)."""
    block_size: int | None = None
    """Tokens per KV block; None: vLLM's default for its platform (16 on CUDA, 128 on the CPU). The
    worker registers whatever vLLM reports."""
    max_num_seqs: int | None = None
    max_num_batched_tokens: int | None = None
    tensor_parallel_size: int = 1
    gpu_memory_utilization: float | None = None
    """The fraction of the GPU's memory vLLM plans for (on a GPU: derived from the memory quota, else
    0.9); None leaves vLLM's default."""
    kv_cache_memory_bytes: int | None = None
    """The KV space in bytes, which vLLM then uses instead of a utilization (the worker sets it on the
    CPU, where ``VLLM_CPU_KVCACHE_SPACE`` would say the same in whole GiB)."""
    predicted_pool_bytes: int | None = None
    """The pool the capacity math predicts for these settings (``pdrouter capacity``), logged beside
    the pool vLLM allocated."""
    enable_prefix_caching: bool = True
    hash_seed: int | str | bytes = 0
    """Seed of the project's chained block hashes (the prefix index's, computed from vLLM's KV events)."""
    engine_args: tuple[tuple[str, Any], ...] = ()
    """Pass-through engine arguments (``--vllm-arg KEY=VALUE``), applied over the worker's."""
    kv_transfer_config: Mapping[str, Any] | None = field(default=None)
    """vLLM's ``kv_transfer_config`` (a KV connector, by module path), for prefill/decode workers."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "model_dir", Path(self.model_dir))
        if self.block_size is not None and self.block_size <= 0:
            raise ConfigError(f"block_size must be > 0, got {self.block_size}")
        if self.tensor_parallel_size < 1:
            raise ConfigError(f"the tensor-parallel size must be >= 1, got {self.tensor_parallel_size}")
        u = self.gpu_memory_utilization
        if u is not None and not 0.0 < u <= 1.0:
            raise ConfigError(f"gpu_memory_utilization must be in (0, 1], got {u}")
        for key, _ in self.engine_args:
            if key in OWNED_ARGS:
                raise ConfigError(f"--vllm-arg {key}: the worker sets it itself"
                                  + (" (use --model)" if key == "model" else ""))

    @property
    def on_cpu(self) -> bool:
        return not self.device.startswith("cuda")

    @property
    def passed(self) -> dict[str, Any]:
        """The pass-through engine arguments as a dict (the last of a repeated key wins)."""
        return dict(self.engine_args)

    def engine_kwargs(self) -> dict[str, Any]:
        """Keyword arguments of vLLM's ``AsyncEngineArgs``, but for ``kv_events_config`` and
        ``kv_transfer_config`` (vLLM objects, made where vLLM is imported)."""
        kw: dict[str, Any] = {
            "model": str(self.model_dir),
            "skip_tokenizer_init": True,
            "enable_prefix_caching": self.enable_prefix_caching,
            "disable_log_stats": False,
            "tensor_parallel_size": self.tensor_parallel_size,
        }
        if self.on_cpu:
            kw["enforce_eager"] = True
        optional = {"dtype": self.dtype, "block_size": self.block_size, "max_num_seqs": self.max_num_seqs,
                    "max_num_batched_tokens": self.max_num_batched_tokens,
                    "gpu_memory_utilization": self.gpu_memory_utilization,
                    "kv_cache_memory_bytes": self.kv_cache_memory_bytes}
        kw.update({k: v for k, v in optional.items() if v is not None})
        kw.update(self.passed)
        return kw
