"""The engine's configuration: one frozen dataclass, built once by the worker's CLI."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from pdrouter.core.capacity import DEFAULT_BLOCK_SIZE, DEFAULT_OVERHEAD_BYTES, pool_blocks_for_budget
from pdrouter.core.errors import ConfigError
from pdrouter.core.model_spec import ModelSpec
from pdrouter.engine.batch_engine import SchedulingConfig


@dataclass(frozen=True)
class EngineConfig:
    """How to build one engine.

    KV pool size: ``num_blocks`` when given; otherwise the capacity math of
    ``pdrouter.core.capacity.pool_blocks_for_budget``: ``memory_budget_bytes × memory_utilization −
    weights − overhead_bytes`` divided by the bytes of one block. On CUDA the budget defaults to
    the device's total memory and the overhead to ``DEFAULT_OVERHEAD_BYTES`` (2 GiB); on the CPU
    there is no default budget (give one, or ``num_blocks``) and the overhead defaults to 0.
    """

    model_dir: Path
    device: str = "cpu"
    dtype: str | None = None
    """Weights and KV dtype; None keeps the ``torch_dtype`` of the folder's config.json."""
    block_size: int = DEFAULT_BLOCK_SIZE
    num_blocks: int | None = None
    memory_budget_bytes: int | None = None
    memory_utilization: float = 0.9
    overhead_bytes: int | None = None
    max_num_seqs: int = 64
    """Most requests admitted to the running batch by local scheduling."""
    max_num_batched_tokens: int = 512
    """Token budget of one step; longer prompts are prefilled in chunks of at most this many tokens."""
    enable_prefix_caching: bool = True
    hash_seed: int | str | bytes = 0
    """Seed of the chained block hashes; must equal the router's."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "model_dir", Path(self.model_dir))
        if self.block_size <= 0:
            raise ConfigError(f"block_size must be > 0, got {self.block_size}")
        if self.num_blocks is not None and self.num_blocks <= 0:
            raise ConfigError(f"num_blocks must be > 0, got {self.num_blocks}")
        if self.max_num_seqs <= 0:
            raise ConfigError(f"max_num_seqs must be > 0, got {self.max_num_seqs}")
        if self.max_num_batched_tokens <= 0:
            raise ConfigError(f"max_num_batched_tokens must be > 0, got {self.max_num_batched_tokens}")
        if not 0.0 < self.memory_utilization <= 1.0:
            raise ConfigError(f"memory_utilization must be in (0, 1], got {self.memory_utilization}")

    def pool_blocks(self, spec: ModelSpec, device_memory_bytes: int | None) -> int:
        """Blocks of the KV pool for a model whose ``spec.dtype`` is the engine's dtype."""
        if self.num_blocks is not None:
            return self.num_blocks
        budget = self.memory_budget_bytes if self.memory_budget_bytes is not None else device_memory_bytes
        if budget is None:
            raise ConfigError("the KV pool size is unknown: set num_blocks or memory_budget_bytes "
                              "(there is no default memory budget on the CPU)")
        overhead = self.overhead_bytes
        if overhead is None:
            overhead = 0 if device_memory_bytes is None else DEFAULT_OVERHEAD_BYTES
        blocks = pool_blocks_for_budget(spec, budget, self.memory_utilization, self.block_size, overhead)
        if blocks <= 0:
            raise ConfigError(f"a memory budget of {budget} bytes leaves no room for one KV block")
        return blocks

    @property
    def scheduling(self) -> SchedulingConfig:
        return SchedulingConfig(self.max_num_seqs, self.max_num_batched_tokens, self.enable_prefix_caching,
                                self.hash_seed)
