"""Accelerator presets: memory, memory bandwidth, dense BF16 throughput and GPU-to-GPU interconnect.

Figures are the vendors' public datasheet numbers (SXM parts where both exist; dense, not
sparse, FLOP/s). ``interconnect_bytes_per_s`` is the datasheet's per-GPU link figure, both
directions together (A100 600 GB/s, H100/H200 900 GB/s, B200 1.8 TB/s; the L40S has no NVLink, so
its figure is PCIe Gen4 x16, 64 GB/s both directions).

What a collective really achieves over that link is an ``InterconnectSpec`` (``GpuSpec.link``):
a fixed latency plus the bus bandwidth NCCL reaches on large messages, from published
measurements (each preset cites its source). An all-reduce of ``s`` bytes over ``n`` GPUs takes
``latency + 2(n−1)/n · s / bus_bandwidth``: its bus efficiency ``s / (s + s½)`` rises with the
message size, half of the bus bandwidth at ``s½ = latency · bus_bandwidth · n / (2(n−1))``.

Memory is the nominal size taken as GiB: an "80 GB" H100 exposes about 80 GiB (81,559 MiB in
nvidia-smi), which is also the unit HAMi's ``nvidia.com/gpumem`` quota is in (MiB).
"""

from __future__ import annotations

from dataclasses import dataclass

from pdrouter.core.errors import ConfigError

GiB = 1024**3


@dataclass(frozen=True)
class InterconnectSpec:
    """How fast collectives run between the GPUs of one tensor-parallel group.

    ``latency_s`` and ``bus_bytes_per_s`` are the intercept and slope of NCCL's all-reduce time
    against message size (the ``busbw`` of nccl-tests, not the link's line rate). ``nvlink``: the
    GPUs share an NVLink fabric, where engines run their own small-message all-reduce kernels
    (``Calibration.allreduce_latency_s``); over PCIe they use NCCL's.
    """

    name: str
    latency_s: float
    bus_bytes_per_s: float
    nvlink: bool
    source: str = ""

    def __post_init__(self) -> None:
        if self.latency_s < 0 or self.bus_bytes_per_s <= 0:
            raise ConfigError(f"interconnect {self.name!r}: latency must be >= 0 and bandwidth > 0")

    def allreduce_s(self, nbytes: float, ranks: int, latency_s: float | None = None) -> float:
        """One ring all-reduce of ``nbytes`` (each rank's buffer) over ``ranks`` GPUs; 0 for one GPU.

        ``latency_s`` replaces the link's own (an engine's custom kernel); None keeps NCCL's."""
        if ranks <= 1 or nbytes <= 0:
            return 0.0
        lat = self.latency_s if latency_s is None else latency_s
        return lat + 2 * (ranks - 1) / ranks * nbytes / self.bus_bytes_per_s

    def allgather_s(self, nbytes: float, ranks: int, latency_s: float | None = None) -> float:
        """One ring all-gather whose result is ``nbytes`` on every rank; 0 for one GPU."""
        if ranks <= 1 or nbytes <= 0:
            return 0.0
        lat = self.latency_s if latency_s is None else latency_s
        return lat + (ranks - 1) / ranks * nbytes / self.bus_bytes_per_s

    def half_efficiency_bytes(self, ranks: int) -> float:
        """The message size at which the all-reduce reaches half of its bus bandwidth."""
        if ranks <= 1:
            return 0.0
        return self.latency_s * self.bus_bytes_per_s * ranks / (2 * (ranks - 1))


_VIDUR = ("Vidur's published NCCL all-reduce profiles (microsoft/vidur, data/profiling/network/{}/all_reduce.csv, "
          "MIT licence): least-squares line through the median kernel times of 1-64 MiB messages, TP 2-8 "
          "within one node")
INTERCONNECT_PRESETS: dict[str, InterconnectSpec] = {
    i.name: i
    for i in (
        # h100_dgx: intercepts 21-37 us, bus bandwidth 299 (TP 2), 345 (TP 4), 370 GB/s (TP 8); messages up
        # to 128 KiB take 28-40 us.
        InterconnectSpec("nvlink4", 30e-6, 350e9, True, _VIDUR.format("h100_dgx")),
        # a100_dgx: intercepts 45-81 us, bus bandwidth 171-186 GB/s; messages up to 128 KiB take 21-50 us.
        InterconnectSpec("nvlink3", 40e-6, 180e9, True, _VIDUR.format("a100_dgx")),
        # No published profile at hand: NVLink 5 doubles NVLink 4's per-GPU bandwidth (datasheets), the
        # same efficiency and latency are assumed.
        InterconnectSpec("nvlink5", 30e-6, 700e9, True, "NVLink 4's profile scaled by the datasheet ratio (an "
                                                          "estimate)"),
        # PCIe Gen4 x16 (32 GB/s each way): NCCL rings between PCIe GPUs reach 24-30 GB/s of bus bandwidth
        # (NVIDIA/nccl issues 1453 and 1639, the host's PCIe and memory being the limit) and take 37-42 us
        # for an 8-byte all-reduce over 8 GPUs (NVIDIA/nccl issue 1530).
        InterconnectSpec("pcie4", 40e-6, 25e9, False, "nccl-tests results on PCIe GPUs, NVIDIA/nccl issues 1453, "
                                                         "1530 and 1639"),
    )
}


@dataclass(frozen=True)
class GpuSpec:
    """One accelerator: what the roofline and the capacity math need."""

    name: str
    memory_bytes: int
    bandwidth_bytes_per_s: float
    bf16_flops: float
    interconnect_bytes_per_s: float = 0.0
    """GPU-to-GPU link per GPU, both directions together (datasheet); 0: none (no tensor parallelism)."""
    interconnect: str = "nvlink4"
    """The ``INTERCONNECT_PRESETS`` entry collectives are costed with."""
    fp8: bool = False
    """FP8 tensor cores (Hopper, Ada, Blackwell): FP8 weights compute faster than BF16."""

    def __post_init__(self) -> None:
        if self.memory_bytes <= 0 or self.bandwidth_bytes_per_s <= 0 or self.bf16_flops <= 0:
            raise ConfigError(f"gpu {self.name!r}: memory, bandwidth and flops must be > 0")
        if self.interconnect_bytes_per_s < 0:
            raise ConfigError(f"gpu {self.name!r}: interconnect bandwidth must be >= 0")
        if self.interconnect not in INTERCONNECT_PRESETS:
            raise ConfigError(f"gpu {self.name!r}: unknown interconnect {self.interconnect!r}; presets: "
                              f"{', '.join(INTERCONNECT_PRESETS)}")

    @property
    def memory_gib(self) -> float:
        return self.memory_bytes / GiB

    @property
    def ridge_point(self) -> float:
        """Arithmetic intensity (FLOP/byte) where the roofline turns from bandwidth- to compute-bound."""
        return self.bf16_flops / self.bandwidth_bytes_per_s

    @property
    def link(self) -> InterconnectSpec:
        """What collectives between GPUs of this kind achieve."""
        return INTERCONNECT_PRESETS[self.interconnect]


GPU_PRESETS: dict[str, GpuSpec] = {
    g.name: g
    for g in (
        GpuSpec("a100-80g", 80 * GiB, 2.039e12, 312e12, 600e9, "nvlink3"),
        GpuSpec("h100-80g", 80 * GiB, 3.35e12, 989e12, 900e9, "nvlink4", fp8=True),
        GpuSpec("h200", 141 * GiB, 4.8e12, 989e12, 900e9, "nvlink4", fp8=True),
        GpuSpec("l40s", 48 * GiB, 0.864e12, 362e12, 64e9, "pcie4", fp8=True),
        GpuSpec("b200", 180 * GiB, 8.0e12, 2250e12, 1.8e12, "nvlink5", fp8=True),
        GpuSpec("a100-40g", 40 * GiB, 1.555e12, 312e12, 600e9, "nvlink3"),
        # A CPU host running an engine on its cores: nominal peaks (a server socket's memory bandwidth and
        # vector FLOP/s) for a calibration to scale (benchmarks/sim_dynamics.py fits one on this machine).
        GpuSpec("cpu", 16 * GiB, 50e9, 2e12, 0.0, "pcie4"),
    )
}
_ALIASES = {"a100": "a100-80g", "h100": "h100-80g", "h100-sxm": "h100-80g", "h200-141g": "h200",
            "b200-180g": "b200", "l40s-48g": "l40s", "a100-40gb": "a100-40g", "a100-80gb": "a100-80g"}


def get_gpu_preset(name: str) -> GpuSpec:
    """A GPU preset by name or alias (``h100`` → ``h100-80g``); ConfigError otherwise."""
    key = name.strip().lower().replace("_", "-")
    spec = GPU_PRESETS.get(_ALIASES.get(key, key))
    if spec is None:
        raise ConfigError(f"unknown gpu {name!r}; presets: {', '.join(GPU_PRESETS)}")
    return spec
