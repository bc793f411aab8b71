"""How close a simulated GPU gets to its datasheet, per engine: efficiencies and fixed costs.

The timing model (:mod:`pdrouter.engine.sim.timing`) turns a step's FLOPs and bytes into time with
the efficiencies below, then adds the costs that are not arithmetic or memory traffic where they
arise: per step, per layer, per sequence, per collective. These are properties of an engine and
its release (which kernels, graph capture or not), so they come as presets:

* ``vllm`` (the default): vLLM with CUDA-graph decode and FlashAttention-class kernels;
* ``trtllm``: TensorRT-LLM (a compiled engine, fused kernels, its own all-reduce);
* ``torch-eager``: the project's own torch engine (eager PyTorch: no graphs, no fused kernels);
* release and variant presets: ``vllm-v0``, ``trtllm-0.6``, ``torch-compile`` (each below).

``benchmarks/sim_fidelity.py --fit`` fits the presets' fitted fields to the calibration rows of
its table of published measurements; the rest come from operator profiles (cited per field).

A file overrides any subset of the fields, on top of a preset (JSON, or YAML for a
``.yaml``/``.yml`` suffix)::

    {"preset": "trtllm", "mbu": 0.8, "decode_step_overhead_s": 0.0002}

``Calibration.from_file`` refuses unknown keys, nulls, non-numbers, negative values, an unknown
preset and out-of-range utilizations with a one-line ``ConfigError`` naming the field and the file.
``resolve_calibration("trtllm" | "cal.yaml")`` is what ``--calibration PRESET|FILE`` runs. In
code, ``Calibration().with_overrides(mbu=0.8)`` (or ``dataclasses.replace``) derives a variant;
both run the same validation.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pdrouter.core.errors import ConfigError

_FRACTIONS = ("mfu", "mbu", "kv_mbu", "attention_mfu", "expert_efficiency")
_UNIT_INTERVAL = ("serial_fraction", "kv_group_rereads", "legacy_expert_kernels", "host_overlap")
_POSITIVE = ("fp8_speedup",)
_INTEGERS = ("graph_max_batch", "kv_group_kernel_size")
PRESET_KEY = "preset"


@dataclass(frozen=True)
class Calibration:
    """Efficiencies and fixed costs of one engine (its kernels, its runtime) on any GPU.

    The defaults are the ``vllm`` preset.
    """

    mfu: float = 0.72
    """Fraction of peak FLOP/s the matrix multiplications reach when compute-bound (large prefills)."""
    mbu: float = 0.73
    """Fraction of peak memory bandwidth reached streaming the weights (and activations, KV writes)."""
    kv_mbu: float = 0.7
    """Fraction of peak memory bandwidth the decode attention kernel reaches reading the KV cache: the
    attention kernel's own efficiency (paged gathers, partial tiles). A kernel that re-reads the KV
    once per query head of a group instead of once per group is this divided by the group size."""
    kv_group_rereads: float = 0.0
    """How many of a grouped-query attention group's query heads beyond the first read their KV head
    again in a decode step, as a fraction of them: 0 for kernels that load each KV head once for the
    whole group (TensorRT-LLM's XQA, FlashAttention and FlashInfer decode kernels), 1 for a kernel that
    runs one thread block per query head (TensorRT-LLM's masked multi-head attention before XQA).
    Every read passes through the L2 cache (``GpuSpec.l2_bandwidth_bytes_per_s``), which serves the
    re-reads: the kernel takes the longer of the DRAM's time and the L2's, both at ``kv_mbu``."""
    kv_group_kernel_size: int = 0
    """The one query-group size the engine's grouped decode kernel is built for; a model whose groups have
    another size runs the per-query-head kernel (``kv_group_rereads`` 1). 0: built for every size."""
    kv_convert_ops: float = 0.0
    """Conversion instructions per cached KV element, per query head that reads it, in a decode attention
    kernel that computes in FP32 on the CUDA cores (``GpuSpec.int_convert_per_s``): 1 for a kernel that
    converts each FP16 or FP8 element to FP32 before its dot products, 0 for tensor-core kernels. The
    kernel takes the longer of its KV reads and its conversions."""
    attention_mfu: float = 0.5
    """Fraction of the BF16 peak a prefill's attention (QKᵀ and AV) reaches, FlashAttention-class."""
    serial_fraction: float = 0.5
    """How much of the smaller of a matmul's compute and weight-streaming times fails to hide under
    the larger: ``max(c, m) + serial_fraction × min(c, m)² / max(c, m)``. The penalty is largest where
    the two are equal (prompts of a few hundred tokens, large decode batches: shapes near the ridge
    point, where real GEMMs reach neither peak) and vanishes far from it (0: the plain roofline)."""
    fp8_speedup: float = 1.6
    """Matmul speedup of FP8 weights over BF16 on GPUs with FP8 tensor cores (the datasheets say 2;
    elsewhere FP8 weights compute at the BF16 rate). Attention stays BF16."""
    expert_efficiency: float = 1.0
    """A mixture of experts' expert matmuls (grouped GEMMs, a few tokens per expert, routing and
    permutation kernels) compute at this fraction of the dense matmuls' ``mfu``; their weights
    stream at ``mbu`` like the others."""
    legacy_expert_kernels: float = 0.0
    """The share of a mixture of experts' expert FLOPs run by grouped GEMMs of the previous tensor-core
    generation in 16 bits: no FP8 speedup, and at most ``GpuSpec.legacy_mma_fraction`` of the 16-bit peak
    (2/3 on Hopper). 1 for TensorRT-LLM 0.9's MoE plugin (the ``trtllm`` preset: its Mixtral rows on
    H100, H200, L40S and A100 agree only so), 0 for kernels that use the GPU's own FP8 and MMA paths."""
    expert_layer_overhead_s: float = 0.0
    """Per mixture-of-experts layer, in every step (graph-captured or not): the router's top-k, the
    sort and permutation of the tokens by expert, and the finalize (un-permute and weighted sum)
    kernels, which a dense layer does not have."""
    dequant_convert_ops: float = 0.0
    """Conversion instructions per weight in a weight-only 8-bit matmul (``ModelSpec.weight_only``),
    run on the CUDA cores at ``GpuSpec.int_convert_per_s`` and added to the matmul's compute side: 1
    for compiler-generated kernels that turn each int8 weight into a float with a conversion
    instruction (the least any such kernel needs), 0 for hand-written kernels that convert with
    integer bit operations on the ALUs (TensorRT-LLM's weight-only GEMV, Marlin)."""
    activation_traffic: float = 1.0
    """Bytes the elementwise kernels (norms, rotary, SwiGLU, residual adds) move, as a multiple of an
    unfused implementation's ``(10·h + 2(q+kv)/tp + 3·I/tp)`` activations per token and layer: 1 for
    separate kernels, less where they are fused into the matmuls."""
    step_overhead_s: float = 0.0005
    """Fixed cost of a step that is not replayed from a captured graph (prefill or mixed steps, eager
    decode): scheduling, input preparation, sampling, launch."""
    decode_step_overhead_s: float = 0.0003
    """Fixed cost of a decode-only step replayed from a captured graph (near 0 for engines that also
    overlap their scheduling with the GPU)."""
    layer_overhead_s: float = 2.5e-5
    """Per layer, in a step that is not graph-captured: kernel launches and the floor of the small
    kernels (norms, rotary, activation, residual), which cost 17–35 µs per layer at ≤ 128 tokens in
    Vidur's eager operator profiles (H100, A100)."""
    fp8_layer_overhead_s: float = 3e-5
    """Per layer, added to ``layer_overhead_s`` for FP8 weights: the kernels that quantize the
    activations before each FP8 matmul (and their scales), which small prompts cannot hide."""
    decode_layer_overhead_s: float = 8e-6
    """Per layer, in a graph-captured decode step: the small kernels' floor without launch gaps."""
    per_seq_overhead_s: float = 0.0
    """Per sequence of a step (input preparation, sampling): no published figure isolates it."""
    allreduce_latency_s: float = 8.3e-6
    """Latency of one small all-reduce with the engine's own kernels over NVLink; 0: NCCL's, the
    interconnect's (``pdrouter.core.gpu.INTERCONNECT_PRESETS``). Over PCIe the interconnect's."""
    graph_max_batch: int = 512
    """Decode-only steps of up to this many sequences are replayed from captured graphs
    (``decode_*`` costs); larger ones and every other step are not. 0: the engine captures none."""
    host_overlap: float = 0.0
    """How much of the step's fixed and per-sequence costs (the host's work) runs while the GPU runs the
    step's kernels: 0, added to them (an engine that prepares and launches between GPU steps); 1, the step
    takes the longer of the two (an eager engine whose kernels queue on the GPU while its host goes on
    launching the rest of the step). The step is ``gpu + host − host_overlap·min(gpu, host)``."""

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            _check_value(f.name, getattr(self, f.name))

    @property
    def graphs(self) -> bool:
        """The engine replays decode steps from captured graphs."""
        return self.graph_max_batch > 0

    def with_overrides(self, **overrides: Any) -> Calibration:
        """A copy with some fields replaced (validated like a file); ConfigError for unknown names."""
        unknown = sorted(set(overrides) - field_names())
        if unknown:
            raise ConfigError(f"unknown calibration field {unknown[0]!r}; fields: {', '.join(sorted(field_names()))}")
        return dataclasses.replace(self, **overrides)

    @classmethod
    def preset(cls, name: str) -> Calibration:
        """A preset by name (``vllm``, ``trtllm``, ``torch-eager``); ConfigError listing them otherwise."""
        cal = CALIBRATION_PRESETS.get(name.strip().lower().replace("_", "-"))
        if cal is None:
            raise ConfigError(f"unknown calibration preset {name!r}; presets: {', '.join(CALIBRATION_PRESETS)}")
        return cal

    @classmethod
    def from_mapping(cls, data: Any, source: str = "calibration") -> Calibration:
        """Build from a parsed mapping (all keys optional, ``preset`` the base); ``source`` names it in errors."""
        if not isinstance(data, dict):
            raise ConfigError(f"{source}: a calibration must be a mapping of field to number, "
                              f"got {type(data).__name__}")
        base = Calibration()
        if PRESET_KEY in data:
            name = data[PRESET_KEY]
            if not isinstance(name, str):
                raise ConfigError(f"{source}: '{PRESET_KEY}' must name a preset ({', '.join(CALIBRATION_PRESETS)}), "
                                  f"got {name!r}")
            try:
                base = cls.preset(name)
            except ConfigError as exc:
                raise ConfigError(f"{source}: {exc.message}") from None
        known = field_names()
        values: dict[str, Any] = {}
        for key, value in data.items():
            if key == PRESET_KEY:
                continue
            if key not in known:
                raise ConfigError(f"{source}: unknown calibration field {key!r}; fields: "
                                  f"{', '.join(sorted(known | {PRESET_KEY}))}")
            try:
                _check_value(str(key), value)
            except ConfigError as exc:
                raise ConfigError(f"{source}: {exc.message}") from None
            values[key] = int(value) if key in _INTEGERS else float(value)
        return dataclasses.replace(base, **values)

    @classmethod
    def from_file(cls, path: str | Path) -> Calibration:
        """Read a JSON file, or YAML for a ``.yaml``/``.yml`` suffix; ConfigError naming the file."""
        p = Path(path)
        try:
            text = p.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise ConfigError(f"{p}: cannot read the calibration file ({exc.__class__.__name__}: {exc})") from None
        if p.suffix.lower() in (".yaml", ".yml"):
            import yaml

            try:
                data = yaml.safe_load(text)
            except yaml.YAMLError as exc:
                raise ConfigError(f"{p}: not valid YAML ({' '.join(str(exc).split())})") from None
        else:
            try:
                data = json.loads(text)
            except json.JSONDecodeError as exc:
                raise ConfigError(f"{p}: not valid JSON ({exc})") from None
        return cls.from_mapping({} if data is None else data, source=str(p))


def resolve_calibration(spec: str | Path | None) -> Calibration:
    """``--calibration PRESET|FILE``: a preset name, else a calibration file; None: the default."""
    if spec is None:
        return Calibration()
    text = str(spec)
    if text.strip().lower().replace("_", "-") in CALIBRATION_PRESETS:
        return Calibration.preset(text)
    if not Path(text).exists() and "/" not in text and "." not in text:
        raise ConfigError(f"--calibration {text!r} is neither a preset ({', '.join(CALIBRATION_PRESETS)}) "
                          f"nor a file")
    return Calibration.from_file(text)


def field_names() -> set[str]:
    return {f.name for f in dataclasses.fields(Calibration)}


def _check_value(name: str, value: Any) -> None:
    """One field's value: a finite number >= 0; (0, 1] for the utilizations; > 0 for the FP8 speedup;
    a whole number for the graph batch."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        shown = "null" if value is None else repr(value)
        raise ConfigError(f"calibration field {name!r} must be a number, got {shown}")
    if not math.isfinite(value):
        raise ConfigError(f"calibration field {name!r} must be finite, got {value}")
    if name in _UNIT_INTERVAL and not 0.0 <= value <= 1.0:
        raise ConfigError(f"calibration field {name!r} must be in [0, 1], got {value}")
    if name in _FRACTIONS and not 0.0 < value <= 1.0:
        raise ConfigError(f"calibration field {name!r} must be in (0, 1], got {value}")
    if name in _POSITIVE and value <= 0:
        raise ConfigError(f"calibration field {name!r} must be > 0, got {value}")
    if name in _INTEGERS and value != int(value):
        raise ConfigError(f"calibration field {name!r} must be a whole number, got {value}")
    if value < 0:
        raise ConfigError(f"calibration field {name!r} must be >= 0, got {value}")


_VLLM = Calibration()
# TensorRT-LLM from 0.8 (0.9 included) shipped its XQA kernels precompiled for groups of 8 query heads per KV head only
# (cpp/tensorrt_llm/kernels/decoderMaskedMultiheadAttention/cubin/xqa_kernel_cubin.h lists "nqpkv_8" single-query
# kernels and no other size); other groups run the masked multi-head attention kernel, which computes in FP32 on the
# CUDA cores and so converts each cached element once per query head.
_TRTLLM = Calibration(mbu=0.61, kv_mbu=0.8, serial_fraction=1.0, fp8_speedup=1.73, expert_efficiency=0.62,
                      legacy_expert_kernels=1.0, expert_layer_overhead_s=5.2e-5, layer_overhead_s=3.1e-5,
                      fp8_layer_overhead_s=3.7e-5, decode_step_overhead_s=3.3e-4, allreduce_latency_s=1.1e-5,
                      activation_traffic=0.5, graph_max_batch=4096, kv_group_kernel_size=8, kv_convert_ops=1.0)
CALIBRATION_PRESETS: dict[str, Calibration] = {
    "vllm": _VLLM,
    # vLLM's V0 engine (before 0.8) ran its scheduler, input preparation, sampling and output processing
    # between the GPU steps: 0.83 ms a step + 42 us a sequence in Vidur's CPU profile of a vLLM-derived
    # engine (microsoft/vidur, data/profiling/a100/cpu_overheads.csv at 6d98aa8: Llama-2-7B, TP 1,
    # batches 8-128).
    "vllm-v0": dataclasses.replace(_VLLM, step_overhead_s=8.3e-4, decode_step_overhead_s=8.3e-4,
                                   per_seq_overhead_s=4.2e-5),
    "trtllm": _TRTLLM,
    # TensorRT-LLM before 0.8: its masked multi-head attention kernel ran one thread block per query head, so
    # a grouped-query model's KV head was read once per query head ("XQA kernel ... reducing data loading",
    # docs/source/blogs/XQA-kernel.md, which shipped XQA in 0.8).
    "trtllm-0.6": dataclasses.replace(_TRTLLM, fp8_speedup=1.36, kv_group_rereads=1.0),
    # PyTorch engines compiled with torch.compile and decoding from CUDA graphs (gpt-fast): the vllm preset's
    # costs, and weight-only int8 matmuls that Inductor generates as Triton kernels converting each weight
    # with a conversion instruction.
    "torch-compile": dataclasses.replace(_VLLM, dequant_convert_ops=1.0),
    # The project's torch engine: fitted by benchmarks/gpu_calibration.py --fit to its own run on an H200
    # (benchmarks/data/gpu_calibration_h200.json: Llama-3-8B geometry, 16 shapes). The efficiencies come from
    # the profiled kernel times (unfused eager kernels, a decode attention over gathered blocks); the host
    # costs from the whole steps: ~64 launches a layer at ~10 us each on that machine's host, which runs
    # while the queued kernels run (host_overlap 1). No graphs, no fused all-reduce.
    "torch-eager": Calibration(mfu=0.64, mbu=0.44, kv_mbu=0.23, attention_mfu=0.43, activation_traffic=1.1,
                               step_overhead_s=0.0, decode_step_overhead_s=0.0, layer_overhead_s=7.1e-4,
                               decode_layer_overhead_s=7.1e-4, per_seq_overhead_s=4.1e-5, allreduce_latency_s=0.0,
                               graph_max_batch=0, host_overlap=1.0),
}
"""Per-engine presets: ``benchmarks/sim_fidelity.py --fit`` fits their ``FITTED`` fields (rounded here to
two digits) to the calibration rows of its table; the other fields are profiled or estimated values
(``docs/simulation.md`` lists each one's basis)."""
