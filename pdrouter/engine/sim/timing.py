"""The timing model of a simulated GPU: one engine step's work → modeled seconds, costed where it arises.

A step computes, for each sequence of the batch, ``n`` new tokens at positions ``c … c+n−1``
(``c`` = tokens already in its KV cache). Everything is per TP rank. With ``T = Σn`` tokens, ``S``
sequences that sample, ``B`` sequences, ``L`` layers, ``h`` hidden size, ``V`` vocabulary::

    matmuls    c = [2·P_act·T + 2·h·V·S] / tp / (peak·mfu)  [+ W·q / cvt]      m = W / (bw·mbu)
               t_mm = max(c, m) + σ·min(c, m)² / max(c, m)
    attention  t_att = Σᵢ max( 4·L·H·d·(nᵢcᵢ + nᵢ(nᵢ+1)/2) / tp / (peak_bf16·attention_mfu), (cᵢ + nᵢ)·t_kv )
                       +  T·KV / (bw·mbu)
               t_kv  = max( KV·max(1/bw, (1 + ρ(g−1))/l2) / kv_mbu,  E·(1 + ρ(g−1))·u / cvt )
    elementwise t_el = activation_traffic · L·T·(10h + 2(q+kv)/tp + 3·k·I/tp)·a / (bw·mbu)
    collectives t_cc = 2L · allreduce(T·h·a) + [S > 0]·allgather(S·V·a)        (tp > 1)
    fixed      graph-captured decode step: decode_step_overhead + L·decode_layer_overhead
               any other step:             step_overhead + L·(layer_overhead [+ fp8_layer_overhead])
               a mixture of experts, every step: + L·expert_layer_overhead
    host       fixed + per_seq_overhead·B
    seconds    = gpu + host − host_overlap·min(gpu, host),  gpu = t_mm + t_att + t_el + t_cc

* ``P_act`` are the non-embedding parameters a token computes with (all of them for a dense model;
  the attention, norms, router and ``k`` routed experts for a mixture of experts). ``W`` are the
  weight bytes the step reads: the dense part, the LM head when some sequence samples, and for a
  mixture of ``E`` experts ``E·(1 − (1 − k/E)^T)`` experts per layer, the expected number a batch
  of ``T`` tokens routes to (``routing="uniform"``: tokens route independently, as a served mix
  does), or ``k`` (``routing="identical"``: every token of a step is the same token in the same
  context, as in a benchmark whose prompts repeat one token id and decode greedily). The experts'
  FLOPs run at ``expert_efficiency`` of the dense matmuls' rate (grouped GEMMs), or, for the share
  ``legacy_expert_kernels`` run by previous-generation 16-bit kernels, at that of the GPU's
  ``legacy_mma_fraction`` of its 16-bit peak, without the FP8 speedup; their bytes stream at ``mbu``.
  Geometry from ``pdrouter.core.capacity``, as the admission's.
* ``peak`` is the GPU's dense BF16 rate, × ``fp8_speedup`` for FP8 weights on FP8-capable GPUs,
  ½ for FP32; attention runs at the BF16 peak. ``a`` is 2 (activations stay BF16 under FP8).
* Attention is its own kernel: a prefill's is compute-bound at FlashAttention-class efficiency, a
  decode's reads each sequence's KV at the attention kernel's bandwidth efficiency. A kernel that
  reads a KV head once per query head of its group of ``g`` (``kv_group_rereads`` ρ = 1, or a group
  size the engine's grouped kernel is not built for: ``kv_group_kernel_size``) gets the ``g − 1``
  re-reads from the L2 cache (``l2``, ``GpuSpec.l2_bandwidth_bytes_per_s``), which every read passes
  through: the DRAM or the L2 binds, whichever is slower (no L2 figure: the DRAM). One that computes
  in FP32 converts each of a token's ``E`` KV elements per query head that reads it (``u``,
  ``kv_convert_ops``) at the conversion rate ``cvt``; the kernel takes the longer of reads and
  conversions.
* Weight-only 8-bit weights (``ModelSpec.weight_only``) compute at the 16-bit rate, and the kernel
  converts each of the ``W`` weight bytes with ``q`` (``dequant_convert_ops``) conversion
  instructions at the GPU's conversion rate ``cvt`` (``GpuSpec.int_convert_per_s``), on the compute
  side of the overlap.
* Collectives: the two all-reduces per layer (after attention, after the MLP) and the gather of the
  logits, each a latency plus its bytes over the interconnect's bus bandwidth (``GpuSpec.link``);
  the latency is the engine's own one-shot kernel's over NVLink (``allreduce_latency_s`` at 2 GPUs,
  more per GPU and past a directly linked group: ``InterconnectSpec.collective_latency_s``), else
  NCCL's. Not overlapped with compute.
* A decode-only step of at most ``graph_max_batch`` sequences is replayed from a captured graph and
  pays the decode costs; prefill and mixed steps pay the eager ones.

Measured mode (``profile``, :mod:`pdrouter.engine.sim.profile`): where an operator profile of this
model, GPU and TP covers the step's token count, its interpolated per-layer operator times replace
the matmul and elementwise terms (the LM head stays on the roofline), and a collective profile
replaces the all-reduce formula within its message sizes; outside them the roofline answers.

Pure arithmetic; nothing here imports torch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from pdrouter.core.capacity import kv_bytes_per_token, kv_heads_per_rank, weight_bytes_per_rank
from pdrouter.core.errors import ConfigError
from pdrouter.core.gpu import GpuSpec
from pdrouter.core.model_spec import DTYPE_BYTES, ModelSpec, normalize_dtype
from pdrouter.engine.sim.calibration import Calibration
from pdrouter.engine.sim.profile import OperatorProfile

ROUTINGS = ("uniform", "identical")
ACTIVATION_BYTES = 2
"""Activations (and the all-reduced hidden states) are BF16/FP16, whatever the weights."""


@dataclass(frozen=True, slots=True)
class SeqWork:
    """One sequence's share of one step: compute num_new_tokens tokens whose positions start at context_before."""

    num_new_tokens: int
    context_before: int
    samples: bool = True
    """The LM head runs for its last token (a sampled token); False for a partial prefill chunk."""

    def __post_init__(self) -> None:
        if self.num_new_tokens <= 0 or self.context_before < 0:
            raise ValueError(f"a sequence's step needs num_new_tokens >= 1 and context_before >= 0, "
                             f"got {self.num_new_tokens} and {self.context_before}")


@dataclass(frozen=True)
class StepCost:
    """The modeled cost of one step; FLOPs and bytes are per GPU (TP rank), times in seconds.

    ``seconds = matmul_s + attention_s + elementwise_s + comm_s + overhead_s − hidden_s``. ``compute_s`` and
    ``memory_s`` are the step's FLOP and byte times at the calibrated efficiencies (before overlap).
    """

    seconds: float
    flops: float
    bytes: float
    compute_s: float
    memory_s: float
    comm_s: float
    overhead_s: float
    matmul_s: float = 0.0
    attention_s: float = 0.0
    elementwise_s: float = 0.0
    hidden_s: float = 0.0
    """The host's share (``overhead_s``) that ran while the GPU ran the kernels (``host_overlap``)."""
    graph: bool = False
    """Replayed from a captured graph (a decode-only step within ``graph_max_batch``)."""
    measured: bool = False
    """The layers' operator times came from a profile (measured mode)."""

    @property
    def compute_bound(self) -> bool:
        """The FLOPs term, not the bytes term, is the larger."""
        return self.compute_s >= self.memory_s


_ZERO = StepCost(seconds=0.0, flops=0.0, bytes=0.0, compute_s=0.0, memory_s=0.0, comm_s=0.0, overhead_s=0.0)


class TimingModel:
    """The step time of one model on one GPU type at one tensor-parallel size, for one engine."""

    def __init__(self, spec: ModelSpec, gpu: GpuSpec, *, tp: int = 1, calibration: Calibration | None = None,
                 kv_dtype: str | None = None, profile: OperatorProfile | None = None,
                 routing: str = "uniform") -> None:
        if tp <= 0:
            raise ConfigError(f"tensor parallel size must be >= 1, got {tp}")
        if spec.num_heads % tp:
            raise ConfigError(f"tp={tp} does not divide the {spec.num_heads} attention heads of {spec.name}")
        if tp > 1 and gpu.interconnect_bytes_per_s <= 0:
            raise ConfigError(f"gpu {gpu.name!r} has no interconnect bandwidth: tp={tp} needs "
                              f"interconnect_bytes_per_s > 0")
        if profile is not None and profile.tp != tp:
            raise ConfigError(f"the operator profile {profile.source} is for TP {profile.tp}, the model runs at "
                              f"TP {tp}")
        if routing not in ROUTINGS:
            raise ConfigError(f"unknown expert routing {routing!r}; routings: {', '.join(ROUTINGS)}")
        self.routing = routing
        self.spec = spec
        self.gpu = gpu
        self.tp = tp
        self.profile = profile
        self.calibration = cal = calibration if calibration is not None else Calibration()
        self.kv_bytes_per_token = kv_bytes_per_token(spec, tp, kv_dtype)
        """KV bytes one token adds on one rank (K and V, every layer)."""

        table_params = spec.vocab_size * spec.hidden_size
        tables = 1 if spec.tie_word_embeddings else 2
        self.body_params = spec.param_count - tables * table_params
        """Non-embedding parameters: the layers and the final norm (every expert)."""
        self.active_body_params = spec.active_param_count - tables * table_params
        """Non-embedding parameters one token computes with (the matmul FLOPs' ``P_act``)."""
        wbytes = spec.dtype_bytes
        self.head_bytes = table_params * wbytes / tp
        """LM head bytes per rank (read by a step in which some sequence samples)."""
        self.body_bytes = weight_bytes_per_rank(spec, tp) - tables * self.head_bytes
        """Weight bytes per rank of the layers and the final norm (every expert)."""
        self.expert_bytes = spec.expert_params * wbytes / tp if spec.is_moe else 0.0
        """Bytes per rank of one expert of one layer (0 for a dense model)."""
        self.dense_bytes = self.body_bytes - spec.num_layers * spec.num_experts * self.expert_bytes
        """Weight bytes per rank every step reads whatever its batch (all but the experts and the head)."""

        self.peak_flops = gpu.bf16_flops * _dtype_flops_factor(spec.dtype, gpu, cal, spec.weight_only)
        """Dense FLOP/s of one GPU for this model's weight dtype (before ``mfu``)."""
        self._mm_rate = self.peak_flops * cal.mfu
        legacy = cal.legacy_expert_kernels
        native_rate = self._mm_rate * cal.expert_efficiency
        legacy_rate = gpu.bf16_flops * gpu.legacy_mma_fraction * cal.mfu * cal.expert_efficiency
        self._expert_rate = 1.0 / ((1.0 - legacy) / native_rate + legacy / legacy_rate)
        """FLOP/s of the experts' grouped GEMMs: native kernels at ``expert_efficiency`` of the dense rate,
        previous-generation 16-bit ones at that of the GPU's ``legacy_mma_fraction`` of its 16-bit peak."""
        self._attn_rate = gpu.bf16_flops * cal.attention_mfu
        self._bytes_rate = gpu.bandwidth_bytes_per_s * cal.mbu
        self._kv_rate = gpu.bandwidth_bytes_per_s * cal.kv_mbu
        group = spec.num_heads // spec.num_kv_heads
        reread = cal.kv_group_rereads
        if cal.kv_group_kernel_size and group not in (1, cal.kv_group_kernel_size):
            reread = 1.0
        rereads = reread * (group - 1)
        self.kv_group_reread = reread
        """The share of a group's query heads beyond the first that read its KV head again in a decode step
        (``kv_group_rereads``, or 1 where the engine's grouped kernel is not built for this group size)."""
        kv_read_s = self.kv_bytes_per_token / self._kv_rate
        if gpu.l2_bandwidth_bytes_per_s > 0:
            kv_read_s = max(kv_read_s, self.kv_bytes_per_token * (1 + rereads)
                            / (gpu.l2_bandwidth_bytes_per_s * cal.kv_mbu))
        kv_elements = 2 * spec.num_layers * kv_heads_per_rank(spec, tp) * spec.head_dim
        kv_convert_s = (kv_elements * (1 + rereads) * cal.kv_convert_ops / gpu.int_convert_per_s
                        if gpu.int_convert_per_s > 0 else 0.0)
        self._kv_s_per_token = max(kv_read_s, kv_convert_s)
        """Seconds a decode attention kernel spends per cached token: its KV from DRAM, re-reads from L2, or
        the conversions of its elements to the kernel's arithmetic type, whichever is longer."""
        convert = cal.dequant_convert_ops if spec.weight_only else 0.0
        self._convert_s_per_weight_byte = convert / gpu.int_convert_per_s if gpu.int_convert_per_s > 0 else 0.0
        """Conversion seconds per weight byte a weight-only matmul streams (one weight per byte)."""
        layers, h = spec.num_layers, spec.hidden_size
        self._attn_flops_per_key = 4 * layers * spec.num_heads * spec.head_dim / tp
        expert_params = spec.num_layers * spec.experts_per_token * spec.expert_params if spec.is_moe else 0
        self._mm_flops_per_token = 2 * (self.active_body_params - expert_params) / tp
        self._expert_flops_per_token = 2 * expert_params / tp
        self._head_flops = 2 * h * spec.vocab_size / tp
        q, kv = spec.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim
        per_token_layer = 10 * h + 2 * (q + kv) / tp + 3 * spec.experts_per_token * spec.intermediate_size / tp
        self._act_bytes_per_token = cal.activation_traffic * layers * per_token_layer * ACTIVATION_BYTES
        self._allreduce_bytes_per_token = h * ACTIVATION_BYTES
        self._logit_bytes_per_seq = spec.vocab_size * ACTIVATION_BYTES
        link = gpu.link
        self._link = link
        self._link_latency: float | None = (cal.allreduce_latency_s if link.nvlink and cal.allreduce_latency_s > 0
                                            else None)
        """The engine's one-shot all-reduce latency at 2 GPUs over NVLink; None: NCCL's."""
        fp8 = cal.fp8_layer_overhead_s if spec.dtype == "float8" and gpu.fp8 and not spec.weight_only else 0.0
        self._eager_fixed = cal.step_overhead_s + layers * (cal.layer_overhead_s + fp8)
        self._graph_fixed = cal.decode_step_overhead_s + layers * cal.decode_layer_overhead_s
        self._moe_fixed = layers * cal.expert_layer_overhead_s if spec.is_moe else 0.0

    # -- public shapes ------------------------------------------------------------------------
    def step(self, batch: Sequence[SeqWork]) -> StepCost:
        """The modeled cost of one step over ``batch``; an empty batch costs nothing."""
        return self.step_of([(w.num_new_tokens, w.context_before, w.samples) for w in batch])

    def step_of(self, batch: Sequence[tuple[int, int, bool]]) -> StepCost:
        """``step`` of ``(num_new_tokens, context_before, samples)`` triples, not checked: the
        simulated engine's own path (its work is valid by construction; one ``SeqWork`` per
        sequence and step cost more than the step's arithmetic)."""
        if not batch:
            return _ZERO
        tokens = sampled = kv_tokens = 0
        attn_c = attn_m = attn_s = attn_flops = 0.0
        decode_only = True
        for n, c, samples in batch:
            tokens += n
            sampled += samples
            kv_tokens += c + n
            decode_only = decode_only and n == 1
            flops = self._attn_flops_per_key * (n * c + n * (n + 1) // 2)
            ci, mi = flops / self._attn_rate, (c + n) * self._kv_s_per_token
            attn_flops += flops
            attn_c += ci
            attn_m += mi
            attn_s += ci if ci > mi else mi
        return self._cost(len(batch), tokens, sampled, decode_only, attn_flops, attn_c, attn_m, attn_s, kv_tokens)

    def decode_step(self, batch_size: int, context: int) -> StepCost:
        """One decode step of ``batch_size`` sequences, each with ``context`` tokens cached."""
        if batch_size < 0 or context < 0:
            raise ValueError(f"batch_size and context must be >= 0, got {batch_size} and {context}")
        if batch_size == 0:
            return _ZERO
        b = batch_size
        flops = self._attn_flops_per_key * (context + 1)
        ci, mi = flops / self._attn_rate, (context + 1) * self._kv_s_per_token
        return self._cost(b, b, b, True, b * flops, b * ci, b * mi, b * max(ci, mi), b * (context + 1))

    def prefill(self, tokens: int, cached: int = 0) -> StepCost:
        """One sequence's whole prompt of ``tokens`` tokens in one step, the first ``cached`` already in KV."""
        if not 0 <= cached < tokens:
            raise ValueError(f"prefill needs 0 <= cached < tokens, got cached={cached}, tokens={tokens}")
        return self.step([SeqWork(tokens - cached, cached)])

    def decode_tokens_per_s(self, batch_size: int, context: int) -> float:
        """Tokens/s of a decode step of ``batch_size`` sequences: batch_size ÷ the step's seconds."""
        if batch_size <= 0:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        return batch_size / self.decode_step(batch_size, context).seconds

    def allreduce_s(self, nbytes: float) -> float:
        """One all-reduce of ``nbytes`` per rank across this model's TP group (0 at TP 1)."""
        if self.tp == 1:
            return 0.0
        if self.profile is not None:
            measured = self.profile.allreduce_time(nbytes)
            if measured is not None:
                return measured
        return self._link.allreduce_s(nbytes, self.tp, self._link_latency)

    # -- the sums ------------------------------------------------------------------------------
    def _weight_bytes(self, tokens: int, sampled: int) -> tuple[float, float]:
        """The step's dense weight bytes (with the head when some sequence samples) and its experts'."""
        spec = self.spec
        dense = self.dense_bytes + (self.head_bytes if sampled else 0.0)
        if not spec.is_moe:
            return dense, 0.0
        e, k = spec.num_experts, spec.experts_per_token
        touched = float(k) if self.routing == "identical" else e * (1.0 - (1.0 - k / e) ** tokens)
        return dense, spec.num_layers * touched * self.expert_bytes

    def _cost(self, seqs: int, tokens: int, sampled: int, decode_only: bool, attn_flops: float, attn_c: float,
              attn_m: float, attn_s: float, kv_tokens: int) -> StepCost:
        cal, layers = self.calibration, self.spec.num_layers
        graph = decode_only and 0 < seqs <= cal.graph_max_batch
        dense_bytes, expert_bytes = self._weight_bytes(tokens, sampled)
        weight_bytes = dense_bytes + expert_bytes
        expert_flops = self._expert_flops_per_token * tokens
        mm_flops = self._mm_flops_per_token * tokens + self._head_flops * sampled + expert_flops
        write_s = tokens * self.kv_bytes_per_token / self._bytes_rate
        act_bytes = self._act_bytes_per_token * tokens
        convert_s = weight_bytes * self._convert_s_per_weight_byte
        layer_ops = self.profile.layer_time(tokens) if self.profile is not None else None
        if layer_ops is not None:
            # Measured mode: the layers' matmuls and elementwise kernels from the profile; the LM head
            # on the roofline.
            head_c = self._head_flops * sampled / self._mm_rate
            head_m = (self.head_bytes if sampled else 0.0) / self._bytes_rate
            matmul_s = layers * layer_ops + _overlap(head_c, head_m, cal.serial_fraction)
            elementwise_s = 0.0
        else:
            c = (mm_flops - expert_flops) / self._mm_rate + expert_flops / self._expert_rate
            c += convert_s
            m = weight_bytes / self._bytes_rate
            matmul_s = _overlap(c, m, cal.serial_fraction)
            elementwise_s = act_bytes / self._bytes_rate
        attention_s = attn_s + write_s
        comm_s = 0.0
        if self.tp > 1:
            comm_s = 2 * layers * self.allreduce_s(tokens * self._allreduce_bytes_per_token)
            if sampled:
                comm_s += self._link.allgather_s(sampled * self._logit_bytes_per_seq, self.tp, self._link_latency)
        overhead_s = (self._graph_fixed if graph else self._eager_fixed) + cal.per_seq_overhead_s * seqs
        overhead_s += self._moe_fixed
        nbytes = weight_bytes + act_bytes + (kv_tokens + tokens) * self.kv_bytes_per_token
        gpu_s = matmul_s + attention_s + elementwise_s + comm_s
        hidden_s = cal.host_overlap * min(gpu_s, overhead_s)
        return StepCost(
            seconds=gpu_s + overhead_s - hidden_s, hidden_s=hidden_s,
            flops=mm_flops + attn_flops, bytes=nbytes,
            compute_s=(mm_flops - expert_flops) / self._mm_rate + expert_flops / self._expert_rate + convert_s + attn_c,
            memory_s=weight_bytes / self._bytes_rate + attn_m + write_s + act_bytes / self._bytes_rate,
            comm_s=comm_s, overhead_s=overhead_s, matmul_s=matmul_s, attention_s=attention_s,
            elementwise_s=elementwise_s, graph=graph, measured=layer_ops is not None)


def _overlap(compute_s: float, memory_s: float, serial_fraction: float) -> float:
    """A kernel's time from its compute and memory times: the larger, plus the part of the smaller that
    does not hide under it, which shrinks as the two move apart."""
    hi, lo = max(compute_s, memory_s), min(compute_s, memory_s)
    return hi + serial_fraction * lo * lo / hi if hi > 0 else 0.0


def _dtype_flops_factor(dtype: str, gpu: GpuSpec, cal: Calibration, weight_only: bool = False) -> float:
    """Peak FLOP/s for ``dtype`` weights relative to the GPU's dense BF16 rate (weight-only formats: 1)."""
    dtype = normalize_dtype(dtype)
    if weight_only:
        return 1.0
    if dtype == "float8":
        return cal.fp8_speedup if gpu.fp8 else 1.0
    if DTYPE_BYTES[dtype] == 4:
        return 0.5
    return 1.0
