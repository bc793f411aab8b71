"""Model geometry: the few numbers that decide weight bytes and KV bytes.

Preset figures are those of the models' published HF ``config.json`` files.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pdrouter.core.errors import ConfigError

DTYPE_BYTES: dict[str, int] = {"float32": 4, "bfloat16": 2, "float16": 2, "float8": 1}
_DTYPE_ALIASES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16", "half": "float16",
                  "fp8": "float8", "float8_e4m3fn": "float8", "float": "float32"}


def normalize_dtype(name: str) -> str:
    """Canonical dtype name (``bf16`` → ``bfloat16``); ConfigError for unknown ones."""
    key = name.lower().removeprefix("torch.")
    key = _DTYPE_ALIASES.get(key, key)
    if key not in DTYPE_BYTES:
        raise ConfigError(f"unknown dtype {name!r}; use one of {sorted(DTYPE_BYTES)}")
    return key


@dataclass(frozen=True)
class ModelSpec:
    """Geometry of a Llama-family decoder (grouped-query attention, SwiGLU MLP, RMSNorm, RoPE).

    A mixture of experts (Mixtral, Qwen3-MoE) has ``num_experts`` > 1 SwiGLU experts of
    ``intermediate_size`` each in every layer, ``experts_per_token`` of them chosen per token by a
    router (``h × num_experts`` weights); every expert's weights count towards the memory, only the
    chosen ones towards a token's FLOPs (``active_param_count``).
    """

    name: str
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    max_context: int
    dtype: str = "bfloat16"
    tie_word_embeddings: bool = False
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-5
    attention_bias: bool = False
    num_experts: int = 1
    """SwiGLU experts per layer (1: a dense MLP)."""
    experts_per_token: int = 1
    """Experts each token is routed to (top-k)."""
    weight_only: bool = False
    """The 1-byte weights are an 8-bit weight-only format (W8A16: int8 or FP8 weights, 16-bit
    activations): the matmul kernels convert each weight to 16 bits before multiplying, at the 16-bit
    rate whatever FP8 units the GPU has. False: FP8 weights multiply on FP8 tensor cores where the
    GPU has them."""

    def __post_init__(self) -> None:
        for field in ("num_layers", "hidden_size", "num_heads", "num_kv_heads", "head_dim",
                      "intermediate_size", "vocab_size", "max_context"):
            if getattr(self, field) <= 0:
                raise ConfigError(f"model {self.name!r}: {field} must be > 0, got {getattr(self, field)}")
        if not 1 <= self.experts_per_token <= self.num_experts:
            raise ConfigError(f"model {self.name!r}: experts_per_token must be in [1, num_experts={self.num_experts}], "
                              f"got {self.experts_per_token}")
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(f"model {self.name!r}: num_heads ({self.num_heads}) must be a multiple of "
                              f"num_kv_heads ({self.num_kv_heads})")
        object.__setattr__(self, "dtype", normalize_dtype(self.dtype))
        if self.weight_only and DTYPE_BYTES[self.dtype] != 1:
            raise ConfigError(f"model {self.name!r}: weight_only describes 8-bit weights, but the dtype is "
                              f"{self.dtype}; use float8 for an 8-bit weight-only format")

    @property
    def dtype_bytes(self) -> int:
        return DTYPE_BYTES[self.dtype]

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 1

    @property
    def expert_params(self) -> int:
        """Parameters of one layer's one SwiGLU MLP (gate, up, down): the dense MLP or one expert."""
        return 3 * self.hidden_size * self.intermediate_size

    @property
    def param_count(self) -> int:
        """Parameters of the whole model (embeddings, layers, final norm, LM head unless tied; every expert)."""
        return self._params(self.num_experts)

    @property
    def active_param_count(self) -> int:
        """Parameters one token computes with: ``param_count`` with only its routed experts' MLPs."""
        return self._params(self.experts_per_token)

    def _params(self, experts: int) -> int:
        h, q, kv = self.hidden_size, self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        attn = h * q + 2 * h * kv + q * h
        if self.attention_bias:
            attn += q + 2 * kv
        router = h * self.num_experts if self.is_moe else 0
        per_layer = attn + experts * self.expert_params + router + 2 * h
        embed = self.vocab_size * h
        head = 0 if self.tie_word_embeddings else self.vocab_size * h
        return self.num_layers * per_layer + embed + head + h

    @property
    def weight_bytes(self) -> int:
        return self.param_count * self.dtype_bytes

    def with_dtype(self, dtype: str) -> ModelSpec:
        return dataclasses.replace(self, dtype=dtype)

    # -- HF config.json ---------------------------------------------------------------------
    @classmethod
    def from_hf_config(cls, config: Mapping[str, Any], name: str | None = None) -> ModelSpec:
        """Build from a parsed HF ``config.json`` (Llama, Mistral, Qwen2; Mixtral and Qwen3-MoE experts)."""
        try:
            experts = int(config.get("num_local_experts") or config.get("num_experts") or 1)
            if experts > 1 and int(config.get("shared_expert_intermediate_size") or 0) > 0:
                raise ConfigError("config.json describes shared experts (shared_expert_intermediate_size), "
                                  "which this geometry cannot express")
            inter = config.get("moe_intermediate_size") if experts > 1 else None
            hidden = int(config["hidden_size"])
            heads = int(config["num_attention_heads"])
            rope = config.get("rope_theta")
            if rope is None and isinstance(config.get("rope_parameters"), Mapping):
                rope = config["rope_parameters"].get("rope_theta")
            dtype = config.get("torch_dtype") or config.get("dtype") or "bfloat16"
            model_type = str(config.get("model_type", "llama"))
            return cls(
                name=name or str(config.get("_name_or_path") or model_type),
                num_layers=int(config["num_hidden_layers"]),
                hidden_size=hidden,
                num_heads=heads,
                num_kv_heads=int(config.get("num_key_value_heads") or heads),
                head_dim=int(config.get("head_dim") or hidden // heads),
                intermediate_size=int(inter or config["intermediate_size"]),
                vocab_size=int(config["vocab_size"]),
                max_context=int(config.get("max_position_embeddings", 4096)),
                dtype=str(dtype),
                tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
                rope_theta=float(rope if rope is not None else 10000.0),
                rms_norm_eps=float(config.get("rms_norm_eps", 1e-5)),
                attention_bias=bool(config.get("attention_bias", model_type == "qwen2")),
                num_experts=experts,
                experts_per_token=int(config.get("num_experts_per_tok") or 1) if experts > 1 else 1,
            )
        except KeyError as exc:
            raise ConfigError(f"config.json lacks required field {exc.args[0]!r}") from None
        except (TypeError, ValueError) as exc:
            raise ConfigError(f"config.json has a malformed field: {exc}") from None

    @classmethod
    def from_pretrained_dir(cls, path: str | Path) -> ModelSpec:
        """Read ``config.json`` from a local HF-format model folder."""
        cfg_path = Path(path) / "config.json"
        if not cfg_path.is_file():
            raise ConfigError(f"{cfg_path} not found: a model folder needs config.json + *.safetensors")
        with cfg_path.open() as f:
            return cls.from_hf_config(json.load(f), name=Path(path).name)

    def to_hf_config(self) -> dict[str, Any]:
        """An HF ``LlamaForCausalLM`` config.json dict for this geometry (``MixtralForCausalLM`` for experts)."""
        config: dict[str, Any] = {
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "vocab_size": self.vocab_size,
            "max_position_embeddings": self.max_context,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "tie_word_embeddings": self.tie_word_embeddings,
            "attention_bias": self.attention_bias,
            "mlp_bias": False,
            "hidden_act": "silu",
            "torch_dtype": self.dtype,
        }
        if self.is_moe:
            config.update(architectures=["MixtralForCausalLM"], model_type="mixtral",
                          num_local_experts=self.num_experts, num_experts_per_tok=self.experts_per_token)
        return config


def _llama(name: str, layers: int, hidden: int, heads: int, kv: int, inter: int, vocab: int,
           ctx: int, rope: float, **kw: Any) -> ModelSpec:
    return ModelSpec(name=name, num_layers=layers, hidden_size=hidden, num_heads=heads,
                     num_kv_heads=kv, head_dim=hidden // heads, intermediate_size=inter,
                     vocab_size=vocab, max_context=ctx, rope_theta=rope, **kw)


MODEL_PRESETS: dict[str, ModelSpec] = {
    m.name: m
    for m in (
        _llama("llama-3-8b", 32, 4096, 32, 8, 14336, 128256, 8192, 500000.0),
        _llama("llama-3-70b", 80, 8192, 64, 8, 28672, 128256, 8192, 500000.0),
        _llama("qwen2.5-7b", 28, 3584, 28, 4, 18944, 152064, 32768, 1000000.0,
               rms_norm_eps=1e-6, attention_bias=True),
        _llama("qwen2.5-32b", 64, 5120, 40, 8, 27648, 152064, 32768, 1000000.0,
               rms_norm_eps=1e-6, attention_bias=True),
        _llama("qwen2.5-72b", 80, 8192, 64, 8, 29568, 152064, 32768, 1000000.0,
               rms_norm_eps=1e-6, attention_bias=True),
        _llama("mistral-7b", 32, 4096, 32, 8, 14336, 32768, 32768, 1000000.0),
        _llama("mixtral-8x7b", 32, 4096, 32, 8, 14336, 32000, 32768, 1000000.0, num_experts=8,
               experts_per_token=2),
        # Small models the project builds itself with seeded random weights (tests, `pdrouter up`).
        ModelSpec(name="tiny", num_layers=2, hidden_size=64, num_heads=4, num_kv_heads=2, head_dim=16,
                  intermediate_size=176, vocab_size=512, max_context=1024, dtype="float32",
                  tie_word_embeddings=True, rope_theta=10000.0, rms_norm_eps=1e-5),
        ModelSpec(name="small", num_layers=6, hidden_size=512, num_heads=8, num_kv_heads=2, head_dim=64,
                  intermediate_size=1536, vocab_size=512, max_context=4096, dtype="float32",
                  tie_word_embeddings=False, rope_theta=10000.0, rms_norm_eps=1e-5),
    )
}


def _canonical(name: str) -> str:
    return name.strip().lower().replace("_", "-").replace("qwen2-5", "qwen2.5")


def get_model_preset(name: str) -> ModelSpec:
    """A preset by name (case-insensitive); ConfigError listing the presets otherwise."""
    spec = MODEL_PRESETS.get(_canonical(name))
    if spec is None:
        raise ConfigError(f"unknown model {name!r}; presets: {', '.join(MODEL_PRESETS)}")
    return spec
