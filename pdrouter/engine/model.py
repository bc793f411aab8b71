"""A Llama-family decoder (RMSNorm, RoPE, grouped-query attention, SwiGLU) over a paged KV pool.

Covers Llama 2/3 (without rope scaling), Mistral and Qwen2-style checkpoints: optional tied
embeddings, optional q/k/v (and o) projection biases. Weights load from HF tensor names;
q/k/v and gate/up are fused into one matmul each. The forward pass takes a flat batch of tokens
(any mix of prompt chunks and decodes) plus :class:`~pdrouter.engine.attention.AttentionMetadata`, and
returns final-normed hidden states; :meth:`LlamaModel.logits` projects the rows that are sampled.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pdrouter.core.errors import ConfigError
from pdrouter.core.model_spec import ModelSpec
from pdrouter.engine.attention import AttentionMetadata, paged_attention
from pdrouter.engine.model_io import ModelFolder, load_weights


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # In float32, then back to the input's dtype before the weight, as HF's LlamaRMSNorm; one operator
        # for the normalization instead of five (each eager operator is a launch the host pays for).
        xf = F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps)
        return self.weight * xf.to(x.dtype)


class Rotary(nn.Module):
    """Rotate-half RoPE with cos/sin tables for every position up to the model's context."""

    def __init__(self, head_dim: int, theta: float, max_positions: int) -> None:
        super().__init__()
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
        freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32), inv_freq)
        self.register_buffer("cos", freqs.cos(), persistent=False)
        self.register_buffer("sin", freqs.sin(), persistent=False)

    def tables(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """``[tokens, 1, head_dim / 2]`` cos and sin for the given positions."""
        cos, sin = self.get_buffer("cos"), self.get_buffer("sin")
        return cos[positions].unsqueeze(1).to(dtype), sin[positions].unsqueeze(1).to(dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


class Attention(nn.Module):
    def __init__(self, spec: ModelSpec, o_bias: bool) -> None:
        super().__init__()
        self.num_heads, self.kv_heads, self.head_dim = spec.num_heads, spec.num_kv_heads, spec.head_dim
        q, kv = self.num_heads * self.head_dim, self.kv_heads * self.head_dim
        self.qkv = nn.Linear(spec.hidden_size, q + 2 * kv, bias=spec.attention_bias)
        self.o = nn.Linear(q, spec.hidden_size, bias=o_bias)
        self.scale = self.head_dim ** -0.5

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, meta: AttentionMetadata,
                k_cache: torch.Tensor, v_cache: torch.Tensor) -> torch.Tensor:
        tokens, heads, rotated = x.shape[0], self.num_heads, self.num_heads + self.kv_heads
        qkv = self.qkv(x).view(tokens, rotated + self.kv_heads, self.head_dim)
        qk = apply_rotary(qkv[:, :rotated], cos, sin)  # q's and k's heads lie side by side: one rotation
        q, k, v = qk[:, :heads], qk[:, heads:], qkv[:, rotated:]
        out = paged_attention(q, k, v, k_cache, v_cache, meta, self.scale)
        return self.o(out.reshape(tokens, heads * self.head_dim))


class Mlp(nn.Module):
    def __init__(self, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.gate_up = nn.Linear(hidden, 2 * intermediate, bias=False)
        self.down = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up(x).chunk(2, dim=-1)
        return self.down(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, spec: ModelSpec, o_bias: bool) -> None:
        super().__init__()
        self.input_norm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.attn = Attention(spec, o_bias)
        self.post_attn_norm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.mlp = Mlp(spec.hidden_size, spec.intermediate_size)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, meta: AttentionMetadata,
                kv: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.input_norm(x), cos, sin, meta, kv[0], kv[1])
        return x + self.mlp(self.post_attn_norm(x))


class LlamaModel(nn.Module):
    """The decoder; ``kv`` in :meth:`forward` is the pool ``[layers, 2, blocks, slot, kv_heads, dim]``."""

    def __init__(self, spec: ModelSpec, o_bias: bool = False) -> None:
        super().__init__()
        if spec.is_moe:
            raise ConfigError(f"model {spec.name!r} is a mixture of {spec.num_experts} experts; the torch engine "
                              f"runs dense Llama-family models only (a simulated GPU models experts: --backend sim)")
        self.spec = spec
        self.embed = nn.Embedding(spec.vocab_size, spec.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(spec, o_bias) for _ in range(spec.num_layers))
        self.norm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.lm_head = None if spec.tie_word_embeddings else nn.Linear(spec.hidden_size, spec.vocab_size,
                                                                       bias=False)
        self.rotary = Rotary(spec.head_dim, spec.rope_theta, spec.max_context)

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                kv: torch.Tensor) -> torch.Tensor:
        x = self.embed(input_ids)
        cos, sin = self.rotary.tables(positions, x.dtype)
        for i, layer in enumerate(self.layers):
            x = layer(x, cos, sin, meta, kv[i])
        out: torch.Tensor = self.norm(x)
        return out

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``[rows, vocab]`` float32 logits of final-normed hidden states."""
        weight = self.embed.weight if self.lm_head is None else self.lm_head.weight
        return F.linear(hidden, weight).float()

    @classmethod
    def load(cls, folder: ModelFolder, dtype: torch.dtype, device: torch.device) -> LlamaModel:
        """Build from HF-named weights (fusing q/k/v and gate/up); ConfigError naming missing tensors."""
        spec = folder.spec
        tensors = load_weights(folder, dtype, device)
        o_bias = "model.layers.0.self_attn.o_proj.bias" in tensors
        with torch.device("meta"):
            model = cls(spec, o_bias)
        state = _fused_state(spec, tensors, o_bias)
        missing = [k for k in model.state_dict() if k not in state]
        if missing:
            raise ConfigError(f"{folder.path}: weights lack {missing[:5]}{'…' if len(missing) > 5 else ''}")
        model.load_state_dict(state, assign=True, strict=True)
        model.rotary = Rotary(spec.head_dim, spec.rope_theta, spec.max_context).to(device)
        return model.eval()


def _fused_state(spec: ModelSpec, t: dict[str, torch.Tensor], o_bias: bool) -> dict[str, torch.Tensor]:
    def need(name: str) -> torch.Tensor:
        if name not in t:
            raise ConfigError(f"weights lack tensor {name!r}")
        return t[name]

    state = {"embed.weight": need("model.embed_tokens.weight"), "norm.weight": need("model.norm.weight")}
    if not spec.tie_word_embeddings:
        state["lm_head.weight"] = need("lm_head.weight")
    for i in range(spec.num_layers):
        hf, me = f"model.layers.{i}", f"layers.{i}"
        proj = [f"{hf}.self_attn.{p}_proj" for p in "qkv"]
        state[f"{me}.attn.qkv.weight"] = torch.cat([need(f"{p}.weight") for p in proj])
        if spec.attention_bias:
            state[f"{me}.attn.qkv.bias"] = torch.cat([need(f"{p}.bias") for p in proj])
        state[f"{me}.attn.o.weight"] = need(f"{hf}.self_attn.o_proj.weight")
        if o_bias:
            state[f"{me}.attn.o.bias"] = need(f"{hf}.self_attn.o_proj.bias")
        state[f"{me}.mlp.gate_up.weight"] = torch.cat([need(f"{hf}.mlp.gate_proj.weight"),
                                                       need(f"{hf}.mlp.up_proj.weight")])
        state[f"{me}.mlp.down.weight"] = need(f"{hf}.mlp.down_proj.weight")
        state[f"{me}.input_norm.weight"] = need(f"{hf}.input_layernorm.weight")
        state[f"{me}.post_attn_norm.weight"] = need(f"{hf}.post_attention_layernorm.weight")
    return state
