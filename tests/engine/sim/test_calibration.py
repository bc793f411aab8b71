"""Calibration files: JSON and YAML, every field optional, every bad value a one-line ConfigError."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from pdrouter.core.errors import ConfigError
from pdrouter.engine.sim.calibration import CALIBRATION_PRESETS, Calibration, resolve_calibration


def _write(tmp_path: Path, name: str, text: str) -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def _refused(path: Path, *words: str) -> str:
    with pytest.raises(ConfigError) as info:
        Calibration.from_file(path)
    message = info.value.message
    assert "\n" not in message
    assert str(path) in message
    for word in words:
        assert word in message
    return message


def test_the_defaults_are_valid_and_a_file_overrides_a_subset(tmp_path: Path) -> None:
    default = Calibration()
    assert 0 < default.mfu <= 1 and 0 < default.mbu <= 1 and default == CALIBRATION_PRESETS["vllm"]
    path = _write(tmp_path, "cal.json", json.dumps({"mbu": 0.8, "step_overhead_s": 0.002}))
    assert Calibration.from_file(path) == dataclasses.replace(default, mbu=0.8, step_overhead_s=0.002)
    assert Calibration.from_file(_write(tmp_path, "empty.json", "{}")) == default


@pytest.mark.parametrize("suffix", [".yaml", ".yml"])
def test_yaml_files(tmp_path: Path, suffix: str) -> None:
    path = _write(tmp_path, f"cal{suffix}", "mfu: 0.5\nallreduce_latency_s: 1.0e-5\nper_seq_overhead_s: 0\n")
    assert Calibration.from_file(path) == Calibration(mfu=0.5, allreduce_latency_s=1e-5, per_seq_overhead_s=0.0)
    assert Calibration.from_file(_write(tmp_path, f"blank{suffix}", "")) == Calibration()


@pytest.mark.parametrize(("content", "field"), [
    ({"mfu": 0.5, "bogus": 1}, "bogus"),
    ({"step_overhead_s": -0.001}, "step_overhead_s"),
    ({"mfu": 0}, "mfu"),
    ({"mbu": 1.2}, "mbu"),
    ({"mbu": "fast"}, "mbu"),
    ({"allreduce_latency_s": None}, "allreduce_latency_s"),
    ({"per_seq_overhead_s": True}, "per_seq_overhead_s"),
    ({"fp8_speedup": 0}, "fp8_speedup"),
    ({"mfu": [0.5]}, "mfu"),
])
def test_a_bad_value_names_the_field_and_the_file(tmp_path: Path, content: dict[str, object], field: str) -> None:
    _refused(_write(tmp_path, "cal.json", json.dumps(content)), repr(field))


def test_a_bad_yaml_value_names_the_field(tmp_path: Path) -> None:
    _refused(_write(tmp_path, "cal.yaml", "mbu: ~\n"), "'mbu'", "null")
    _refused(_write(tmp_path, "cal.yml", "mfu: 1.5\n"), "'mfu'", "(0, 1]")


def test_unreadable_and_malformed_files(tmp_path: Path) -> None:
    _refused(tmp_path / "missing.json", "cannot read")
    _refused(_write(tmp_path, "bad.json", '{"mfu": 0.5,'), "JSON")
    _refused(_write(tmp_path, "bad.yaml", "mfu: [0.5\n"), "YAML")
    _refused(_write(tmp_path, "list.json", "[0.5]"), "mapping")
    (tmp_path / "binary.json").write_bytes(b"\xff\xfe\x00")
    _refused(tmp_path / "binary.json", "cannot read")


def test_overrides_in_code_are_validated_like_files() -> None:
    assert Calibration().with_overrides(mbu=0.7).mbu == 0.7
    with pytest.raises(ConfigError, match="'speed'"):
        Calibration().with_overrides(speed=2.0)
    with pytest.raises(ConfigError, match="'mbu'"):
        Calibration().with_overrides(mbu=0.0)
    with pytest.raises(ConfigError, match="'mfu'"):
        Calibration(mfu=2.0)
    with pytest.raises(ConfigError, match="'step_overhead_s'"):
        dataclasses.replace(Calibration(), step_overhead_s=float("nan"))


def test_presets_per_engine_and_a_file_on_top_of_one(tmp_path: Path) -> None:
    assert Calibration.preset("vllm") == Calibration()
    trt, eager = Calibration.preset("TRTLLM"), Calibration.preset("torch_eager")
    assert trt.graph_max_batch > 0 and not eager.graphs and eager.allreduce_latency_s == 0.0
    assert set(CALIBRATION_PRESETS) >= {"vllm", "trtllm", "torch-eager"}
    path = _write(tmp_path, "cal.yaml", "preset: trtllm\nmbu: 0.5\n")
    assert Calibration.from_file(path) == dataclasses.replace(trt, mbu=0.5)
    message = _refused(_write(tmp_path, "bad.yaml", "preset: sglang-9\n"), "'sglang-9'", "trtllm")
    assert "unknown calibration preset" in message
    _refused(_write(tmp_path, "num.json", json.dumps({"preset": 3})), "'preset'")
    with pytest.raises(ConfigError, match="presets: vllm"):
        Calibration.preset("nope")


def test_release_and_variant_presets_differ_from_their_family_in_their_own_fields_only() -> None:
    trt, old = Calibration.preset("trtllm"), Calibration.preset("trtllm-0.6")
    assert trt.kv_group_rereads == 0.0 and old.kv_group_rereads == 1.0
    # TensorRT-LLM 0.9's XQA kernels were built for groups of 8; its attention computes in FP32 on the CUDA cores.
    assert trt.kv_group_kernel_size == 8 and trt.kv_convert_ops == 1.0
    assert Calibration().kv_group_kernel_size == 0 and Calibration().kv_convert_ops == 0.0
    assert dataclasses.replace(old, kv_group_rereads=0.0, fp8_speedup=trt.fp8_speedup) == trt
    compiled = Calibration.preset("torch-compile")
    assert compiled.dequant_convert_ops == 1.0 and Calibration().dequant_convert_ops == 0.0
    assert dataclasses.replace(compiled, dequant_convert_ops=0.0) == Calibration.preset("vllm")


def test_calibration_flag_takes_a_preset_or_a_file(tmp_path: Path) -> None:
    assert resolve_calibration(None) == Calibration()
    assert resolve_calibration("trtllm") == Calibration.preset("trtllm")
    path = _write(tmp_path, "mine.json", json.dumps({"preset": "torch-eager", "mbu": 0.6}))
    assert resolve_calibration(str(path)) == dataclasses.replace(Calibration.preset("torch-eager"), mbu=0.6)
    with pytest.raises(ConfigError, match="neither a preset"):
        resolve_calibration("tensorrt")
    with pytest.raises(ConfigError, match="cannot read"):
        resolve_calibration(str(tmp_path / "missing.yaml"))


@pytest.mark.parametrize(("content", "field"), [
    ({"graph_max_batch": 2.5}, "graph_max_batch"),
    ({"graph_max_batch": -1}, "graph_max_batch"),
    ({"kv_mbu": 0}, "kv_mbu"),
    ({"attention_mfu": 1.5}, "attention_mfu"),
    ({"expert_efficiency": 0}, "expert_efficiency"),
    ({"layer_overhead_s": -1e-6}, "layer_overhead_s"),
    ({"decode_step_overhead_s": "fast"}, "decode_step_overhead_s"),
    ({"activation_traffic": float("inf")}, "activation_traffic"),
    ({"kv_group_rereads": 1.5}, "kv_group_rereads"),
    ({"kv_group_rereads": -0.1}, "kv_group_rereads"),
    ({"dequant_convert_ops": -1}, "dequant_convert_ops"),
    ({"dequant_convert_ops": None}, "dequant_convert_ops"),
    ({"legacy_expert_kernels": 2}, "legacy_expert_kernels"),
    ({"expert_layer_overhead_s": -1e-6}, "expert_layer_overhead_s"),
    ({"kv_group_kernel_size": 4.5}, "kv_group_kernel_size"),
    ({"kv_group_kernel_size": -8}, "kv_group_kernel_size"),
    ({"kv_convert_ops": -1}, "kv_convert_ops"),
])
def test_the_new_fields_are_validated(tmp_path: Path, content: dict[str, object], field: str) -> None:
    _refused(_write(tmp_path, "cal.json", json.dumps(content)), repr(field))


def test_a_whole_graph_batch_from_json_is_an_int(tmp_path: Path) -> None:
    cal = Calibration.from_file(_write(tmp_path, "cal.json", json.dumps({"graph_max_batch": 256.0,
                                                                         "kv_group_kernel_size": 8.0})))
    assert cal.graph_max_batch == 256 and isinstance(cal.graph_max_batch, int)
    assert cal.kv_group_kernel_size == 8 and isinstance(cal.kv_group_kernel_size, int)
