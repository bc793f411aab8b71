"""The timing model of a simulated GPU: one engine step's FLOPs and bytes → modeled seconds.

A step computes, for each sequence of the batch, ``n`` new tokens at positions ``c … c+n−1``
(``c`` = the tokens already in its KV cache). With ``P`` the non-embedding parameters (layers and
final norm), ``h`` the hidden size, ``V`` the vocabulary, ``L`` layers, ``H × d`` query heads ×
head dim, ``S`` the sequences that sample a token, and everything per TP rank (÷ ``tp``)::

    FLOPs  = [ 2·P·Σn  +  2·h·V·S  +  4·L·H·d·Σ(n·c + n(n+1)/2) ] / tp
             (matmuls)   (LM head)    (QKᵀ and AV: the token at position p sees p+1 keys, causal)
    bytes  = W_layers/tp + [S > 0]·W_head/tp + Σ(c + n)·KV_tok + Σn·KV_tok
             (weights, read once a step)       (KV read)         (KV written)
    comm   = 2·L · [ 2(tp−1)/tp · Σn·h·a / (link/2) + t_ar ]          (tp > 1, else 0)
    c, m   = FLOPs / (peak·mfu), bytes / (bandwidth·mbu)
    time   = max(c, m) + σ·min(c, m) + comm + t_step + t_seq·len(batch)

* ``KV_tok`` is :func:`pdrouter.core.capacity.kv_bytes_per_token` at this TP (heads replicated
  when TP exceeds the KV heads) and the weights come from
  :func:`pdrouter.core.capacity.weight_bytes_per_rank`, so the geometry is the admission's.
* The embedding table is a gather of ``Σn`` rows (kilobytes): it is left out of the bytes. The LM
  head (the same table when tied) is read only when some sequence samples; a step of partial
  prefill chunks alone skips it.
* KV read: each sequence's cached ``c`` tokens plus its ``n`` new ones, each read once (an ideal
  attention kernel; a tiled one re-reads keys per query tile, mostly from L2).
* ``peak`` is the GPU's dense BF16 rate; FP8 weights multiply it by the calibration's
  ``fp8_speedup`` on GPUs with FP8 tensor cores (H100, H200, B200, L40S: recognised by name);
  FP32 weights halve it (the TF32 rate).
* ``comm``: two ring all-reduces per layer (after attention and after the MLP) of the step's
  activations, ``a`` bytes each (2 for FP8 weights: activations stay BF16), over one direction of
  the GPU's interconnect, each plus a fixed latency; not overlapped with compute. The embedding's
  all-reduce and the logits' gather are not counted.

* ``σ`` (``serial_fraction``): the part of the smaller term that does not hide under the larger
  one (0 gives the plain roofline); it matters where compute and memory time are close.

Everything is pure arithmetic; nothing here imports torch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from pdrouter.core.capacity import kv_bytes_per_token, weight_bytes_per_rank
from pdrouter.core.errors import ConfigError
from pdrouter.core.gpu import GpuSpec
from pdrouter.core.model_spec import DTYPE_BYTES, ModelSpec, normalize_dtype
from pdrouter.engine.sim.calibration import Calibration

_FP8_GPU_PREFIXES = ("h100", "h200", "h20", "h800", "gh200", "b100", "b200", "gb200", "l40", "l4")
"""GPUs with FP8 tensor cores (Hopper, Blackwell, Ada), recognised by their preset-style name."""


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
    """The modeled cost of one step; FLOPs and bytes are per GPU (TP rank)."""

    seconds: float
    flops: float
    bytes: float
    compute_s: float
    memory_s: float
    comm_s: float
    overhead_s: float

    @property
    def compute_bound(self) -> bool:
        """The FLOPs term, not the bytes term, sets the step's roofline time."""
        return self.compute_s >= self.memory_s


_ZERO = StepCost(seconds=0.0, flops=0.0, bytes=0.0, compute_s=0.0, memory_s=0.0, comm_s=0.0, overhead_s=0.0)


class TimingModel:
    """The roofline step time of one model on one GPU type at one tensor-parallel size."""

    def __init__(self, spec: ModelSpec, gpu: GpuSpec, *, tp: int = 1, calibration: Calibration | None = None,
                 kv_dtype: str | None = None) -> None:
        if tp <= 0:
            raise ConfigError(f"tensor parallel size must be >= 1, got {tp}")
        if spec.num_heads % tp:
            raise ConfigError(f"tp={tp} does not divide the {spec.num_heads} attention heads of {spec.name}")
        if tp > 1 and gpu.interconnect_bytes_per_s <= 0:
            raise ConfigError(f"gpu {gpu.name!r} has no interconnect bandwidth: tp={tp} needs "
                              f"interconnect_bytes_per_s > 0")
        self.spec = spec
        self.gpu = gpu
        self.tp = tp
        self.calibration = calibration if calibration is not None else Calibration()
        self.kv_bytes_per_token = kv_bytes_per_token(spec, tp, kv_dtype)
        """KV bytes one token adds on one rank (K and V, every layer)."""

        table_params = spec.vocab_size * spec.hidden_size
        tables = 1 if spec.tie_word_embeddings else 2
        self.body_params = spec.param_count - tables * table_params
        """Non-embedding parameters: the layers and the final norm (the matmul FLOPs' ``P``)."""
        head_bytes = table_params * spec.dtype_bytes / tp
        self.head_bytes = head_bytes
        """LM head bytes per rank (read by a step in which some sequence samples)."""
        self.body_bytes = weight_bytes_per_rank(spec, tp) - tables * head_bytes
        """Weight bytes per rank every step reads: all but the embedding table and the LM head."""

        cal = self.calibration
        self.peak_flops = gpu.bf16_flops * _dtype_flops_factor(spec.dtype, gpu, cal)
        """Dense FLOP/s of one GPU for this model's weight dtype (before ``mfu``)."""
        self._flops_rate = self.peak_flops * cal.mfu
        self._bytes_rate = gpu.bandwidth_bytes_per_s * cal.mbu
        self._attn_flops_per_key = 4 * spec.num_layers * spec.num_heads * spec.head_dim / tp
        self._head_flops = 2 * spec.hidden_size * spec.vocab_size / tp
        act_bytes = 2 if spec.dtype == "float8" else spec.dtype_bytes
        self._allreduce_bytes_per_token = spec.hidden_size * act_bytes
        self._allreduces = 2 * spec.num_layers
        one_direction = gpu.interconnect_bytes_per_s / 2
        self._ring_s_per_byte = 2 * (tp - 1) / tp / one_direction if tp > 1 else 0.0

    def step(self, batch: Sequence[SeqWork]) -> StepCost:
        """The modeled cost of one step over ``batch``; an empty batch costs nothing."""
        if not batch:
            return _ZERO
        tokens = sampled = keys = context = 0
        for work in batch:
            n, c = work.num_new_tokens, work.context_before
            tokens += n
            sampled += work.samples
            keys += n * c + n * (n + 1) // 2
            context += c
        return self._cost(len(batch), tokens, sampled, keys, context)

    def decode_step(self, batch_size: int, context: int) -> StepCost:
        """One decode step of ``batch_size`` sequences, each with ``context`` tokens cached."""
        if batch_size < 0 or context < 0:
            raise ValueError(f"batch_size and context must be >= 0, got {batch_size} and {context}")
        if batch_size == 0:
            return _ZERO
        b = batch_size
        return self._cost(b, tokens=b, sampled=b, keys=b * (context + 1), context=b * context)

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

    def _cost(self, seqs: int, tokens: int, sampled: int, keys: int, context: int) -> StepCost:
        """The step's cost from its sums: sequences, new tokens, sampling sequences, attended keys
        (Σ over new tokens) and cached tokens."""
        flops = 2 * self.body_params * tokens / self.tp + self._head_flops * sampled \
            + self._attn_flops_per_key * keys
        weight_bytes = self.body_bytes + (self.head_bytes if sampled else 0.0)
        # KV read: the cached context and the new tokens (each once); KV written: the new tokens.
        nbytes = weight_bytes + (context + 2 * tokens) * self.kv_bytes_per_token
        compute_s = flops / self._flops_rate
        memory_s = nbytes / self._bytes_rate
        comm_s = 0.0
        if self.tp > 1:
            size = tokens * self._allreduce_bytes_per_token
            comm_s = self._allreduces * (size * self._ring_s_per_byte + self.calibration.allreduce_latency_s)
        cal = self.calibration
        overhead_s = cal.step_overhead_s + cal.per_seq_overhead_s * seqs
        roof_s = max(compute_s, memory_s) + cal.serial_fraction * min(compute_s, memory_s)
        return StepCost(seconds=roof_s + comm_s + overhead_s, flops=flops, bytes=nbytes,
                        compute_s=compute_s, memory_s=memory_s, comm_s=comm_s, overhead_s=overhead_s)


def _dtype_flops_factor(dtype: str, gpu: GpuSpec, cal: Calibration) -> float:
    """Peak FLOP/s for ``dtype`` weights relative to the GPU's dense BF16 rate."""
    dtype = normalize_dtype(dtype)
    if dtype == "float8":
        return cal.fp8_speedup if gpu.name.lower().startswith(_FP8_GPU_PREFIXES) else 1.0
    if DTYPE_BYTES[dtype] == 4:
        return 0.5
    return 1.0
