"""Random model folders: deterministic bytes, HF layout, loading in each dtype, clear errors."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from pdrouter.core.errors import ConfigError
from pdrouter.core.sampling import SamplingParams
from pdrouter.engine.config import EngineConfig
from pdrouter.engine.model_io import make_model, read_model_folder
from pdrouter.engine.torch_engine import TorchEngine


def test_same_preset_and_seed_give_identical_bytes(tmp_path: Path) -> None:
    a = make_model("tiny", 11, tmp_path / "a")
    b = make_model("tiny", 11, tmp_path / "b")
    c = make_model("tiny", 12, tmp_path / "c")
    files = ["chat_template.jinja", "config.json", "model.safetensors", "pdrouter_tokenizer.json", "tokenizer.json",
             "tokenizer_config.json"]
    assert sorted(p.name for p in a.iterdir()) == files
    for name in files:
        assert (a / name).read_bytes() == (b / name).read_bytes()
    assert (a / "model.safetensors").read_bytes() != (c / "model.safetensors").read_bytes()


def test_folder_uses_hf_llama_names_and_config(tiny_dir: Path) -> None:
    tensors = load_file(str(tiny_dir / "model.safetensors"))
    assert tensors["model.layers.1.self_attn.k_proj.weight"].shape == (32, 64)
    assert tensors["model.layers.0.mlp.gate_proj.weight"].shape == (176, 64)
    assert "lm_head.weight" not in tensors  # tied embeddings
    assert len(tensors) == 1 + 2 * 9 + 1
    config = json.loads((tiny_dir / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert (config["eos_token_id"], config["bos_token_id"], config["vocab_size"]) == (258, 257, 512)
    assert read_model_folder(tiny_dir).eos_token_ids == (258,)


@pytest.mark.parametrize("dtype", ["bf16", "float16"])
def test_half_precision_models_write_and_run(tmp_path: Path, dtype: str) -> None:
    folder = make_model("tiny", 0, tmp_path / dtype, dtype=dtype)
    expected = torch.bfloat16 if dtype == "bf16" else torch.float16
    assert load_file(str(folder / "model.safetensors"))["model.norm.weight"].dtype == expected
    engine = TorchEngine(EngineConfig(folder, num_blocks=8))
    assert engine.kv_tensor.dtype == expected
    (tokens,) = engine.generate([[1, 2, 3]], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    assert len(tokens) == 4 and all(0 <= t < 512 for t in tokens)


def test_fp32_folder_can_run_in_bf16(tiny_dir: Path) -> None:
    engine = TorchEngine(EngineConfig(tiny_dir, num_blocks=8, dtype="bfloat16"))
    assert engine.model.embed.weight.dtype == torch.bfloat16
    assert engine.kv_layout.dtype == "bfloat16"


def test_greedy_decoding_of_the_tiny_model_is_not_degenerate(tiny_dir: Path) -> None:
    engine = TorchEngine(EngineConfig(tiny_dir, num_blocks=64))
    prompts = [engine.tokenizer.encode(s) for s in ("Hello world", "The quick brown fox", "a", "12345")]
    outs = engine.generate(prompts, SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True))
    distinct = [len(set(o[16:])) for o in outs]
    assert min(distinct) >= 8, distinct
    assert len({tuple(o) for o in outs}) == len(outs)


def test_unknown_and_oversized_presets_are_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="unknown model"):
        make_model("no-such-model", 0, tmp_path / "x")
    with pytest.raises(ConfigError, match="real checkpoint"):
        make_model("llama-3-8b", 0, tmp_path / "y")
    assert not (tmp_path / "y").exists()


def test_missing_tensor_is_a_config_error(tiny_dir: Path, tmp_path: Path) -> None:
    broken = tmp_path / "broken"
    shutil.copytree(tiny_dir, broken)
    tensors = load_file(str(broken / "model.safetensors"))
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, str(broken / "model.safetensors"))
    with pytest.raises(ConfigError, match="up_proj"):
        TorchEngine(EngineConfig(broken, num_blocks=8))


@pytest.mark.parametrize("change", [{"rope_scaling": {"rope_type": "llama3", "factor": 8.0}},
                                    {"hidden_act": "gelu"}])
def test_unsupported_configs_are_refused(tiny_dir: Path, tmp_path: Path, change: dict[str, object]) -> None:
    folder = tmp_path / "variant"
    shutil.copytree(tiny_dir, folder)
    config = json.loads((folder / "config.json").read_text())
    config.update(change)
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError):
        read_model_folder(folder)


def test_folder_without_weights_is_refused(tiny_dir: Path, tmp_path: Path) -> None:
    folder = tmp_path / "noweights"
    folder.mkdir()
    shutil.copy(tiny_dir / "config.json", folder / "config.json")
    with pytest.raises(ConfigError, match="safetensors"):
        TorchEngine(EngineConfig(folder, num_blocks=8))
