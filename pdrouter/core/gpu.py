"""Accelerator presets: memory, memory bandwidth, dense BF16 throughput and GPU-to-GPU interconnect.

Figures are the vendors' public datasheet numbers (SXM parts where both exist; dense, not
sparse, FLOP/s). The interconnect is the datasheet's per-GPU NVLink figure, both directions
together (A100 600 GB/s, H100/H200 900 GB/s, B200 1.8 TB/s); the L40S has no NVLink, so its
figure is PCIe Gen4 x16, 64 GB/s both directions. One direction carries half.

Memory is the nominal size taken as GiB: an "80 GB" H100 exposes about 80 GiB (81,559 MiB in
nvidia-smi), which is also the unit HAMi's ``nvidia.com/gpumem`` quota is in (MiB).
"""

from __future__ import annotations

from dataclasses import dataclass

from pdrouter.core.errors import ConfigError

GiB = 1024**3


@dataclass(frozen=True)
class GpuSpec:
    """One accelerator: what the roofline and the capacity math need."""

    name: str
    memory_bytes: int
    bandwidth_bytes_per_s: float
    bf16_flops: float
    interconnect_bytes_per_s: float = 0.0
    """GPU-to-GPU link per GPU, both directions together (what tensor parallelism all-reduces over);
    0: unknown."""

    def __post_init__(self) -> None:
        if self.memory_bytes <= 0 or self.bandwidth_bytes_per_s <= 0 or self.bf16_flops <= 0:
            raise ConfigError(f"gpu {self.name!r}: memory, bandwidth and flops must be > 0")
        if self.interconnect_bytes_per_s < 0:
            raise ConfigError(f"gpu {self.name!r}: interconnect bandwidth must be >= 0")

    @property
    def memory_gib(self) -> float:
        return self.memory_bytes / GiB

    @property
    def ridge_point(self) -> float:
        """Arithmetic intensity (FLOP/byte) where the roofline turns from bandwidth- to compute-bound."""
        return self.bf16_flops / self.bandwidth_bytes_per_s


GPU_PRESETS: dict[str, GpuSpec] = {
    g.name: g
    for g in (
        GpuSpec("a100-80g", 80 * GiB, 2.039e12, 312e12, 600e9),
        GpuSpec("h100-80g", 80 * GiB, 3.35e12, 989e12, 900e9),
        GpuSpec("h200", 141 * GiB, 4.8e12, 989e12, 900e9),
        GpuSpec("l40s", 48 * GiB, 0.864e12, 362e12, 64e9),
        GpuSpec("b200", 180 * GiB, 8.0e12, 2250e12, 1.8e12),
    )
}
_ALIASES = {"a100": "a100-80g", "h100": "h100-80g", "h100-sxm": "h100-80g", "h200-141g": "h200",
            "b200-180g": "b200", "l40s-48g": "l40s"}


def get_gpu_preset(name: str) -> GpuSpec:
    """A GPU preset by name or alias (``h100`` → ``h100-80g``); ConfigError otherwise."""
    key = name.strip().lower().replace("_", "-")
    spec = GPU_PRESETS.get(_ALIASES.get(key, key))
    if spec is None:
        raise ConfigError(f"unknown gpu {name!r}; presets: {', '.join(GPU_PRESETS)}")
    return spec
