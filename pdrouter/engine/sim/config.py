"""One simulated worker's configuration: which model on which GPU, how big its pool is, how fast time runs.

Built once by the worker's CLI (``pdrouter prefill|decode|worker --backend sim``) and frozen. The
KV pool is sized by the same capacity math as ``pdrouter capacity`` and the admission
(``pdrouter.core.capacity.plan_capacity``): a Llama-3-8B worker on an H100 at utilization 0.9 gets
exactly the blocks that command prints.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from pdrouter.core.capacity import DEFAULT_BLOCK_SIZE, DEFAULT_OVERHEAD_BYTES, plan_capacity
from pdrouter.core.errors import ConfigError
from pdrouter.core.gpu import GiB, GpuSpec
from pdrouter.core.model_spec import ModelSpec
from pdrouter.engine.batch_engine import SchedulingConfig
from pdrouter.engine.sim.calibration import Calibration
from pdrouter.engine.sim.link import LinkSpec, get_link_preset
from pdrouter.engine.sim.profile import OperatorProfile

BYTE_TEXT_TOKENS = (32, 127)
"""Printable ASCII in the byte-level tokenizer: simulated tokens drawn from here each decode to one
character, so a streaming client sees one text delta per token (ids past the byte range decode to
nothing in that tokenizer)."""


@dataclass(frozen=True)
class SimEngineConfig:
    """How to build one ``SimEngine``.

    ``time_scale``: simulated time runs this many times slower than the wall clock (1: real
    time; 10: a modeled 5 ms step takes 50 ms, so the router and the machine's own overheads
    shrink tenfold in simulated terms); 0 answers as fast as the code can, without sleeping.
    """

    spec: ModelSpec
    gpu: GpuSpec
    eos_token_ids: tuple[int, ...] = ()
    model_dir: Path | None = None
    """The model folder the geometry came from (None: a preset)."""
    tp: int = 1
    calibration: Calibration = field(default_factory=Calibration)
    """The engine modelled (``--calibration PRESET|FILE``; the default is the ``vllm`` preset)."""
    profile: OperatorProfile | None = None
    """Profiled operator times of this model, GPU and TP (measured mode; ``--operator-profile``)."""
    time_scale: float = 1.0
    block_size: int = DEFAULT_BLOCK_SIZE
    num_blocks: int | None = None
    """Pool blocks; None sizes the pool from the GPU's memory (the capacity math)."""
    memory_utilization: float | None = None
    """Fraction of the GPU's memory the engine may use (None: 0.9, or quota ÷ memory with a quota)."""
    memory_quota_bytes: int | None = None
    overhead_bytes: int = DEFAULT_OVERHEAD_BYTES
    scheduling: SchedulingConfig = field(default_factory=SchedulingConfig)
    link: LinkSpec = field(default_factory=lambda: get_link_preset("rdma-400g"))
    """The prefill worker's link for KV transfers (the modeled transfer time)."""
    link_shared: bool = True
    """Concurrent transfers share the link's bandwidth (else each gets all of it)."""
    token_range: tuple[int, int] | None = None
    """The ``[low, high)`` ids the simulated tokens are drawn from (None: the whole vocabulary)."""

    def __post_init__(self) -> None:
        if self.tp <= 0:
            raise ConfigError(f"--tp must be >= 1, got {self.tp}")
        if self.spec.num_heads % self.tp:
            raise ConfigError(f"--tp {self.tp} does not divide the {self.spec.num_heads} attention heads "
                              f"of {self.spec.name}")
        if self.spec.num_kv_heads % self.tp and self.tp % self.spec.num_kv_heads:
            raise ConfigError(f"--tp {self.tp} does not divide the {self.spec.num_kv_heads} KV heads of "
                              f"{self.spec.name} (nor the other way round)")
        if self.profile is not None and self.profile.tp != self.tp:
            raise ConfigError(f"--operator-profile {self.profile.source} was read for TP {self.profile.tp}, "
                              f"the worker runs at --tp {self.tp}")
        if self.time_scale < 0:
            raise ConfigError(f"--time-scale must be >= 0 (0: no sleeping), got {self.time_scale}")
        if self.block_size <= 0:
            raise ConfigError(f"--block-size must be > 0, got {self.block_size}")
        if self.num_blocks is not None and self.num_blocks <= 0:
            raise ConfigError(f"--num-blocks must be > 0, got {self.num_blocks}")
        if self.memory_utilization is not None and not 0.0 < self.memory_utilization <= 1.0:
            raise ConfigError(f"--utilization must be in (0, 1], got {self.memory_utilization}")
        vocab = self.spec.vocab_size
        if self.token_range is not None and not 0 <= self.token_range[0] < self.token_range[1] <= vocab:
            raise ConfigError(f"token range {self.token_range} is not inside the vocabulary [0, {vocab})")
        if self.scheduling.max_num_seqs <= 0 or self.scheduling.max_num_batched_tokens <= 0:
            raise ConfigError("--max-num-seqs and --max-batched-tokens must be > 0")

    @property
    def name(self) -> str:
        """The simulated accelerator, as workers report it: ``sim:h100-80g`` (``×N`` at TP > 1)."""
        return f"sim:{self.gpu.name}" + (f"x{self.tp}" if self.tp > 1 else "")

    def pool_blocks(self) -> int:
        """``num_blocks``, or the blocks ``pdrouter capacity`` prints for this model, GPU, TP and utilization."""
        if self.num_blocks is not None:
            return self.num_blocks
        utilization = self.memory_utilization
        if utilization is None and self.memory_quota_bytes is None:
            utilization = 0.9
        plan = plan_capacity(self.spec, self.gpu, tp=self.tp, utilization=utilization,
                             quota_bytes=self.memory_quota_bytes, block_size=self.block_size,
                             overhead_bytes=self.overhead_bytes)
        if plan.num_blocks <= 0:
            raise ConfigError(f"the KV pool of {plan.kv_pool_bytes / GiB:.3f} GiB holds no block of "
                              f"{plan.kv_bytes_per_token * self.block_size} bytes")
        return plan.num_blocks
