"""Model and GPU presets, HF config round trips."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pdrouter.core.errors import ConfigError
from pdrouter.core.gpu import get_gpu_preset
from pdrouter.core.kv_layout import KvLayout, model_compat_hash
from pdrouter.core.model_spec import MODEL_PRESETS, ModelSpec, get_model_preset


@pytest.mark.parametrize(("name", "billions"), [
    ("llama-3-8b", 8.03), ("llama-3-70b", 70.55), ("qwen2.5-7b", 7.62), ("qwen2.5-32b", 32.76),
    ("qwen2.5-72b", 72.71), ("mistral-7b", 7.25),
])
def test_param_counts_match_published_sizes(name: str, billions: float) -> None:
    assert round(get_model_preset(name).param_count / 1e9, 2) == billions


def test_preset_lookup_is_forgiving_but_strict() -> None:
    assert get_model_preset("Llama-3-8B").name == "llama-3-8b"
    assert get_model_preset("qwen2_5-7b").name == "qwen2.5-7b"
    assert get_gpu_preset("H100").name == "h100-80g"
    with pytest.raises(ConfigError, match="unknown model 'gpt-5'"):
        get_model_preset("gpt-5")
    with pytest.raises(ConfigError, match="unknown gpu"):
        get_gpu_preset("tpu")


def test_hf_config_round_trip(tmp_path: Path) -> None:
    for spec in MODEL_PRESETS.values():
        (tmp_path / "config.json").write_text(json.dumps(spec.to_hf_config()))
        loaded = ModelSpec.from_pretrained_dir(tmp_path)
        assert loaded == ModelSpec(**{**spec.__dict__, "name": tmp_path.name})


def test_hf_config_variants() -> None:
    cfg = {"hidden_size": 64, "num_attention_heads": 4, "num_hidden_layers": 2, "intermediate_size": 128,
           "vocab_size": 100, "rope_parameters": {"rope_theta": 5e5, "rope_type": "default"},
           "dtype": "bfloat16"}
    spec = ModelSpec.from_hf_config(cfg, name="x")
    assert (spec.num_kv_heads, spec.head_dim, spec.rope_theta, spec.dtype) == (4, 16, 5e5, "bfloat16")
    with pytest.raises(ConfigError, match="lacks required field 'vocab_size'"):
        ModelSpec.from_hf_config({k: v for k, v in cfg.items() if k != "vocab_size"})
    with pytest.raises(ConfigError, match="not found"):
        ModelSpec.from_pretrained_dir("/nonexistent")


def test_invalid_geometry_is_refused() -> None:
    base = get_model_preset("tiny")
    with pytest.raises(ConfigError, match="multiple of"):
        ModelSpec(**{**base.__dict__, "num_heads": 3})
    with pytest.raises(ConfigError, match="num_layers must be > 0"):
        ModelSpec(**{**base.__dict__, "num_layers": 0})
    with pytest.raises(ConfigError, match="unknown dtype"):
        ModelSpec(**{**base.__dict__, "dtype": "int3"})


def test_kv_layout_and_compat_hashes() -> None:
    spec = get_model_preset("llama-3-8b")
    layout = KvLayout.for_model(spec, num_blocks=10)
    assert layout.shape == (32, 2, 10, 16, 8, 128)
    assert layout.block_bytes == 16 * 128 * 1024
    assert layout.kv_bytes_per_token == 128 * 1024
    bigger = KvLayout.for_model(spec, num_blocks=99)
    assert layout.compat_hash() == bigger.compat_hash()  # pool size does not matter
    assert layout.compat_hash() != KvLayout.for_model(spec, num_blocks=10, block_size=32).compat_hash()
    assert layout.compat_hash() != KvLayout.for_model(spec, num_blocks=10, dtype="float16").compat_hash()
    assert model_compat_hash(spec, 16) == model_compat_hash(get_model_preset("llama-3-8b"), 16)
    assert model_compat_hash(spec, 16) != model_compat_hash(get_model_preset("mistral-7b"), 16)
    assert model_compat_hash(spec, 16) != model_compat_hash(spec, 32)


def test_mixtures_of_experts_count_every_expert_and_route_to_k() -> None:
    mixtral = {"hidden_size": 4096, "num_attention_heads": 32, "num_key_value_heads": 8, "num_hidden_layers": 32,
               "intermediate_size": 14336, "vocab_size": 32000, "num_local_experts": 8, "num_experts_per_tok": 2,
               "model_type": "mixtral"}
    spec = ModelSpec.from_hf_config(mixtral, name="m")
    assert (spec.num_experts, spec.experts_per_token, spec.is_moe) == (8, 2, True)
    preset = get_model_preset("mixtral-8x7b")
    assert spec.param_count == preset.param_count and spec.active_param_count == preset.active_param_count
    # Mixtral-8x7B: 46.7B parameters, 12.9B of them per token (the published figures).
    assert 46.6e9 < spec.param_count < 46.8e9 and 12.8e9 < spec.active_param_count < 13.0e9
    dense = ModelSpec.from_hf_config({**mixtral, "num_local_experts": None}, name="d")
    assert not dense.is_moe and dense.param_count == dense.active_param_count
    # Qwen3-MoE names its expert width moe_intermediate_size.
    qwen = ModelSpec.from_hf_config({**mixtral, "num_local_experts": None, "num_experts": 128, "num_experts_per_tok": 8,
                                     "moe_intermediate_size": 768}, name="q")
    assert (qwen.num_experts, qwen.experts_per_token, qwen.intermediate_size) == (128, 8, 768)
    with pytest.raises(ConfigError, match="shared experts"):
        ModelSpec.from_hf_config({**mixtral, "shared_expert_intermediate_size": 5632})
    with pytest.raises(ConfigError, match="experts_per_token"):
        ModelSpec(**{**spec.__dict__, "experts_per_token": 9})
