"""Accelerator presets: memory, memory bandwidth, dense BF16 throughput and GPU-to-GPU interconnect.

Figures are the vendors' public datasheet numbers (SXM parts where both exist; dense, not
sparse, FLOP/s). ``interconnect_bytes_per_s`` is the datasheet's per-GPU link figure, both
directions together (A100 600 GB/s, H100/H200 900 GB/s, B200 1.8 TB/s; the L40S has no NVLink, so
its figure is PCIe Gen4 x16, 64 GB/s both directions).

What a collective really achieves over that link is an ``InterconnectSpec`` (``GpuSpec.link``):
a fixed latency plus the bus bandwidth NCCL reaches on large messages, from published
measurements (each preset cites its source). An all-reduce of ``s`` bytes over ``n`` GPUs takes
``latency + 2(n−1)/n · s / bus_bandwidth``: its bus efficiency ``s / (s + s½)`` rises with the
message size, half of the bus bandwidth at ``s½ = latency · bus_bandwidth · n / (2(n−1))``. An
engine's own one-shot kernel (small messages over NVLink) pays its latency plus a little per GPU
beyond the second (every rank signals and reads every peer), and twice that where the group is
wider than the GPUs that share direct links (a hybrid cube mesh at 8 GPUs: two dependent rounds).

Two on-chip rates serve mechanisms the datasheets do not price: the L2 cache's bandwidth (an
attention kernel that reads a KV head once per query head of its group gets the re-reads from L2)
and the rate at which the CUDA cores convert types (a weight-only 8-bit matmul converts every
weight before it multiplies; a decode attention kernel that computes in FP32 converts every cached
KV element it reads).

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
    (``Calibration.allreduce_latency_s``, the latency at 2 GPUs); over PCIe they use NCCL's.
    """

    name: str
    latency_s: float
    bus_bytes_per_s: float
    nvlink: bool
    source: str = ""
    peer_latency_s: float = 0.0
    """What each GPU beyond the second adds to an engine's one-shot all-reduce: one more peer to
    signal, wait for and read (NCCL's ``latency_s`` is a measured intercept and takes nothing)."""
    full_mesh_ranks: int = 8
    """The largest group whose GPUs all have direct links (8 behind an NVSwitch; 4 in a hybrid cube
    mesh). A one-shot all-reduce over a wider group takes two dependent rounds: twice the latency."""

    def __post_init__(self) -> None:
        if self.latency_s < 0 or self.bus_bytes_per_s <= 0 or self.peer_latency_s < 0:
            raise ConfigError(f"interconnect {self.name!r}: latencies must be >= 0 and bandwidth > 0")
        if self.full_mesh_ranks < 2:
            raise ConfigError(f"interconnect {self.name!r}: full_mesh_ranks must be >= 2")

    def collective_latency_s(self, ranks: int, latency_s: float | None = None) -> float:
        """The fixed part of one collective over ``ranks`` GPUs: NCCL's intercept (``latency_s`` None), or an
        engine's one-shot kernel of latency ``latency_s`` at 2 GPUs, ``peer_latency_s`` more per further GPU,
        doubled past ``full_mesh_ranks``."""
        if latency_s is None:
            return self.latency_s
        mesh = min(ranks, self.full_mesh_ranks)
        one_round = latency_s + max(mesh - 2, 0) * self.peer_latency_s
        return one_round if ranks <= self.full_mesh_ranks else 2 * one_round

    def allreduce_s(self, nbytes: float, ranks: int, latency_s: float | None = None) -> float:
        """One ring all-reduce of ``nbytes`` (each rank's buffer) over ``ranks`` GPUs; 0 for one GPU.

        ``latency_s`` is an engine's own kernel's latency at 2 GPUs; None keeps NCCL's."""
        if ranks <= 1 or nbytes <= 0:
            return 0.0
        return self.collective_latency_s(ranks, latency_s) + 2 * (ranks - 1) / ranks * nbytes / self.bus_bytes_per_s

    def allgather_s(self, nbytes: float, ranks: int, latency_s: float | None = None) -> float:
        """One ring all-gather whose result is ``nbytes`` on every rank; 0 for one GPU."""
        if ranks <= 1 or nbytes <= 0:
            return 0.0
        return self.collective_latency_s(ranks, latency_s) + (ranks - 1) / ranks * nbytes / self.bus_bytes_per_s

    def half_efficiency_bytes(self, ranks: int) -> float:
        """The message size at which the all-reduce reaches half of its bus bandwidth."""
        if ranks <= 1:
            return 0.0
        return self.latency_s * self.bus_bytes_per_s * ranks / (2 * (ranks - 1))


# SGLang's custom all-reduce kernel on H100 (sgl-project/sglang pull request 2904, 'unit test performance in
# H100'): 3.7/4.8/5.9 us at 512 B, 3.9/3.7/5.7 us at 4 KiB, 4.5/4.8/7.8 us at 32 KiB over 2/4/8 GPUs; the
# least-squares slope against the GPUs beyond the second is 0.42 us each.
_PEER_LATENCY = 0.42e-6
_VIDUR = ("Vidur's published NCCL all-reduce profiles (microsoft/vidur, data/profiling/network/{}/all_reduce.csv, "
          "MIT licence): least-squares line through the median kernel times of 1-64 MiB messages, TP 2-8 "
          "within one node")
INTERCONNECT_PRESETS: dict[str, InterconnectSpec] = {
    i.name: i
    for i in (
        # h100_dgx: intercepts 21-37 us, bus bandwidth 299 (TP 2), 345 (TP 4), 370 GB/s (TP 8); messages up
        # to 128 KiB take 28-40 us.
        InterconnectSpec("nvlink4", 30e-6, 350e9, True, _VIDUR.format("h100_dgx"), _PEER_LATENCY),
        # a100_dgx: intercepts 45-81 us, bus bandwidth 171-186 GB/s; messages up to 128 KiB take 21-50 us. The
        # per-GPU latency of a one-shot kernel is NVLink 4's (no A100 measurement at hand).
        InterconnectSpec("nvlink3", 40e-6, 180e9, True, _VIDUR.format("a100_dgx"), _PEER_LATENCY),
        # A100s in a hybrid cube mesh (no NVSwitch): each GPU has NVLinks to 4 others, the 4 of its own quad
        # fully connected. PyTorch's intra-node all-reduce detects it and runs its HCM algorithm at 8 GPUs:
        # sum the 3 direct neighbours' buffers, then exchange with the relay GPU in the other quad, after a
        # second signal round (torch/csrc/distributed/c10d/intra_node_comm.cu, hybridCubeMeshAllReduceKernel).
        # Bus bandwidth and NCCL latency: the NVSwitch A100's (no HCM profile at hand).
        InterconnectSpec("nvlink3-hcm", 40e-6, 180e9, True, "the a100_dgx profile; PyTorch's intra-node "
                         "all-reduce for the topology", _PEER_LATENCY, full_mesh_ranks=4),
        # No published profile at hand: NVLink 5 doubles NVLink 4's per-GPU bandwidth (datasheets), the
        # same efficiency and latency are assumed.
        InterconnectSpec("nvlink5", 30e-6, 700e9, True, "NVLink 4's profile scaled by the datasheet ratio (an "
                                                          "estimate)", _PEER_LATENCY),
        # PCIe Gen4 x16 (32 GB/s each way) on an L40S host: NCCL's all-reduce between 2 of its GPUs reaches 20 GB/s of
        # bus bandwidth from 32 MiB up (NVIDIA's aiconfigurator, systems/data/l40s/comm/nccl/2.27.3, the one published
        # sweep of an L40S host). A ring over more GPUs of one PCIe host shares its root complexes and memory and can
        # only be slower (35 -> 28 GB/s from 4 to 8 GPUs on one host, NVIDIA/nccl issue 1639); hosts differ (GPU
        # peer-to-peer off, two sockets): a host's own measurement goes in with --collective-profile. An 8-byte
        # all-reduce over 8 GPUs takes 37-42 us (NVIDIA/nccl issue 1530).
        InterconnectSpec("pcie4", 40e-6, 20e9, False, "NCCL's all-reduce between 2 GPUs of an L40S host "
                                                         "(aiconfigurator systems/data/l40s/comm/nccl/2.27.3); "
                                                         "NVIDIA/nccl issues 1530 and 1639"),
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
    l2_bandwidth_bytes_per_s: float = 0.0
    """L2 cache read bandwidth; 0: unknown, data read again from it is taken not to bind."""
    int_convert_per_s: float = 0.0
    """Type conversions per second on the CUDA cores (SMs × clock × the conversions an SM retires per
    clock): integer-to-float, and FP8/FP16 to FP32; 0: unknown, conversions are not costed."""
    legacy_mma_fraction: float = 1.0
    """The share of the dense 16-bit peak that kernels built on the previous generation's tensor-core
    instruction (``mma.sync``, Ampere's) can reach: below 1 where the peak needs a newer one (Hopper's
    ``wgmma``); 1 where ``mma.sync`` is the native path (A100, L40S) or no figure is at hand."""

    def __post_init__(self) -> None:
        if self.memory_bytes <= 0 or self.bandwidth_bytes_per_s <= 0 or self.bf16_flops <= 0:
            raise ConfigError(f"gpu {self.name!r}: memory, bandwidth and flops must be > 0")
        if self.interconnect_bytes_per_s < 0 or self.l2_bandwidth_bytes_per_s < 0 or self.int_convert_per_s < 0:
            raise ConfigError(f"gpu {self.name!r}: interconnect, L2 and conversion rates must be >= 0")
        if not 0 < self.legacy_mma_fraction <= 1:
            raise ConfigError(f"gpu {self.name!r}: legacy_mma_fraction must be in (0, 1], "
                              f"got {self.legacy_mma_fraction}")
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


# L2 read bandwidth: 5,120 bytes per clock on A100 and H100, 7,219 GB/s at the A100's 1,410 MHz and 8,986 GB/s
# at the H100's 1,755 MHz (Table 3 of the article in Ultrasonics Sonochemistry 99 (2023) 106546, PMC10448217,
# doi:10.1016/j.ultsonch.2023.106546; the A100 figure is the A100 whitepaper's "2.3x the L2 cache read bandwidth
# of V100"). The H200 is the H100's die. No figure at hand for the L40S and B200.
_L2_A100, _L2_H100 = 7.219e12, 8.986e12
# Conversions from an integer to a floating-point type: 16 per clock per SM on compute capability 8.x and 9.0
# (CUDA C++ Programming Guide, "Throughput of Native Arithmetic Instructions": "all other type
# conversions"), times the SMs and the boost clock of the datasheets: A100 108 SMs at 1,410 MHz, H100 and
# H200 SXM 132 at 1,980 MHz, L40S 142 at 2,520 MHz.
_CVT_A100, _CVT_H100, _CVT_L40S = 16 * 108 * 1.41e9, 16 * 132 * 1.98e9, 16 * 142 * 2.52e9
# Hopper's peak needs its warpgroup MMA (wgmma); "the older mma.sync instruction can only reach about 2/3 the peak
# throughput of the Hopper Tensor Cores" (J. Shah et al., "FlashAttention-3", arXiv:2407.08608, 2024, section 2.2).
_LEGACY_MMA_HOPPER = 2 / 3
GPU_PRESETS: dict[str, GpuSpec] = {
    g.name: g
    for g in (
        GpuSpec("a100-80g", 80 * GiB, 2.039e12, 312e12, 600e9, "nvlink3", l2_bandwidth_bytes_per_s=_L2_A100,
                int_convert_per_s=_CVT_A100),
        GpuSpec("h100-80g", 80 * GiB, 3.35e12, 989e12, 900e9, "nvlink4", fp8=True, l2_bandwidth_bytes_per_s=_L2_H100,
                int_convert_per_s=_CVT_H100, legacy_mma_fraction=_LEGACY_MMA_HOPPER),
        GpuSpec("h200", 141 * GiB, 4.8e12, 989e12, 900e9, "nvlink4", fp8=True, l2_bandwidth_bytes_per_s=_L2_H100,
                int_convert_per_s=_CVT_H100, legacy_mma_fraction=_LEGACY_MMA_HOPPER),
        GpuSpec("l40s", 48 * GiB, 0.864e12, 362e12, 64e9, "pcie4", fp8=True, int_convert_per_s=_CVT_L40S),
        GpuSpec("b200", 180 * GiB, 8.0e12, 2250e12, 1.8e12, "nvlink5", fp8=True),
        GpuSpec("a100-40g", 40 * GiB, 1.555e12, 312e12, 600e9, "nvlink3", l2_bandwidth_bytes_per_s=_L2_A100,
                int_convert_per_s=_CVT_A100),
        # A100-80GB SXM boards wired as a hybrid cube mesh (NVLink to 4 neighbours, no NVSwitch).
        GpuSpec("a100-80g-hcm", 80 * GiB, 2.039e12, 312e12, 600e9, "nvlink3-hcm", l2_bandwidth_bytes_per_s=_L2_A100,
                int_convert_per_s=_CVT_A100),
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
