"""HF-format model folders: write a seeded random one, read one back.

A folder holds ``config.json`` (an HF ``LlamaForCausalLM`` config), ``model.safetensors`` (or
several ``*.safetensors`` shards) with HF tensor names, and a tokenizer: the project's byte-level one,
written as an HF tokenizer with its chat template too (``pdrouter.core.byte_hf_tokenizer``), so
transformers and vLLM load the folder as it is. :func:`make_model`
writes such a folder from a ``pdrouter.core`` preset; same preset + seed + dtype gives identical bytes.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from pdrouter.core.errors import ConfigError
from pdrouter.core.model_spec import ModelSpec, get_model_preset
from pdrouter.engine.device import torch_dtype
from pdrouter.engine.model_folder import ModelFolder, read_model_folder, write_config_folder

__all__ = ["MAX_RANDOM_PARAMS", "WEIGHTS_FILE", "ModelFolder", "load_weights", "make_model", "random_weights",
           "read_model_folder", "write_random_model"]

WEIGHTS_FILE = "model.safetensors"
MAX_RANDOM_PARAMS = 300_000_000
"""A random model larger than this is refused: it would only be a slow way to fill a disk."""


def make_model(preset: str, seed: int, out: Path, dtype: str | None = None) -> Path:
    """Write a random model of a ``pdrouter.core`` preset (``tiny``, ``small``…) to ``out``; returns ``out``."""
    return write_random_model(get_model_preset(preset), seed, Path(out), dtype)


def _weight_shapes(spec: ModelSpec) -> Iterator[tuple[str, tuple[int, ...], str]]:
    """(HF name, shape, init kind) of every tensor, in a fixed order (the order the RNG is drawn in)."""
    h, d = spec.hidden_size, spec.head_dim
    q, kv, inter = spec.num_heads * d, spec.num_kv_heads * d, spec.intermediate_size
    yield "model.embed_tokens.weight", (spec.vocab_size, h), "embed"
    for i in range(spec.num_layers):
        p = f"model.layers.{i}"
        yield f"{p}.input_layernorm.weight", (h,), "norm"
        yield f"{p}.self_attn.q_proj.weight", (q, h), "linear"
        yield f"{p}.self_attn.k_proj.weight", (kv, h), "linear"
        yield f"{p}.self_attn.v_proj.weight", (kv, h), "linear"
        yield f"{p}.self_attn.o_proj.weight", (h, q), "linear"
        if spec.attention_bias:
            yield f"{p}.self_attn.q_proj.bias", (q,), "bias"
            yield f"{p}.self_attn.k_proj.bias", (kv,), "bias"
            yield f"{p}.self_attn.v_proj.bias", (kv,), "bias"
            yield f"{p}.self_attn.o_proj.bias", (h,), "bias"
        yield f"{p}.post_attention_layernorm.weight", (h,), "norm"
        yield f"{p}.mlp.gate_proj.weight", (inter, h), "linear"
        yield f"{p}.mlp.up_proj.weight", (inter, h), "linear"
        yield f"{p}.mlp.down_proj.weight", (h, inter), "linear"
    yield "model.norm.weight", (h,), "norm"
    if not spec.tie_word_embeddings:
        yield "lm_head.weight", (spec.vocab_size, h), "linear"


def random_weights(spec: ModelSpec, seed: int) -> dict[str, torch.Tensor]:
    """Seeded fp32 weights with HF names.

    Embeddings get std 0.02 and linear layers std 1/sqrt(fan_in), so the layers dominate the
    residual stream (with large embeddings a tied-embedding model echoes its input token). The
    q and k projections get twice that, so attention is sharp enough to tell positions apart:
    with near-uniform attention the state converges and greedy decoding repeats one token.
    Norm weights are 1 ± 0.1 so that comparisons with HF exercise them.
    """
    if spec.param_count > MAX_RANDOM_PARAMS:
        raise ConfigError(f"model {spec.name!r} has {spec.param_count / 1e9:.1f} B parameters; random "
                          f"models are for presets up to {MAX_RANDOM_PARAMS / 1e6:.0f} M "
                          f"(use a real checkpoint)")
    gen = torch.Generator().manual_seed(seed)
    out: dict[str, torch.Tensor] = {}
    for name, shape, kind in _weight_shapes(spec):
        noise = torch.randn(shape, generator=gen, dtype=torch.float32)
        if kind == "norm":
            out[name] = 1.0 + 0.1 * noise
        elif kind in ("embed", "bias"):
            out[name] = 0.02 * noise
        else:
            gain = 2.0 if name.endswith(("q_proj.weight", "k_proj.weight")) else 1.0
            out[name] = noise * (gain / math.sqrt(shape[1]))
    return out


def write_random_model(spec: ModelSpec, seed: int, out: Path, dtype: str | None = None) -> Path:
    """Write a random model of any geometry (tests use custom shapes); see :func:`make_model`."""
    if dtype is not None:
        spec = spec.with_dtype(dtype)
    tdtype = torch_dtype(spec.dtype)
    tensors = {k: v.to(tdtype).contiguous() for k, v in random_weights(spec, seed).items()}
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / WEIGHTS_FILE), metadata={"format": "pt"})
    return write_config_folder(spec, out, hf_tokenizer=True)


def load_weights(folder: ModelFolder, dtype: torch.dtype, device: torch.device) -> dict[str, torch.Tensor]:
    """All tensors of the folder's safetensors files, cast to ``dtype`` on ``device``."""
    tensors: dict[str, torch.Tensor] = {}
    for file in folder.weight_files():
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                tensors[name] = f.get_tensor(name).to(device=device, dtype=dtype)
    return tensors
