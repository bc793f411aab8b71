"""``pdrouter worker --backend vllm``: the KV pool it asks vLLM for follows the memory quota, and a utilization
above the quota is refused in one line before vLLM is imported. Pure configuration: no vLLM needed.

The source document's exam question, for vLLM: a 40 GiB quota on an 80 GiB card gives
``gpu_memory_utilization`` 0.5, never vLLM's default 0.9 (a 72 GiB plan: the pod would be killed
at start); 0.9 given explicitly is refused.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
from pathlib import Path

import pytest

from pdrouter.cli import worker_cmd
from pdrouter.cli.main import build_parser
from pdrouter.cli.vllm_worker import CPU_BLOCK_SIZE, machine_memory_bytes
from pdrouter.core.capacity import DEFAULT_OVERHEAD_BYTES, kv_pool_bytes, weight_bytes_per_rank
from pdrouter.core.errors import ConfigError
from pdrouter.core.gpu import GiB
from pdrouter.core.model_spec import get_model_preset
from pdrouter.engine.model_folder import write_config_folder
from pdrouter.engine.vllm.config import VllmEngineConfig


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Llama-3-8B's geometry (no weights): a GPU's model."""
    spec = get_model_preset("llama-3-8b").with_dtype("bfloat16")
    return write_config_folder(spec, tmp_path_factory.mktemp("vllm-sizing") / "llama-3-8b")


@pytest.fixture(scope="module")
def small(folder: Path) -> Path:
    """The small preset's geometry: a model the CPU holds."""
    return write_config_folder(get_model_preset("small").with_dtype("bfloat16"), folder.parent / "small")


def vllm_config(folder: Path, *flags: str, env: dict[str, str] | None = None,
                monkeypatch: pytest.MonkeyPatch | None = None) -> VllmEngineConfig:
    if monkeypatch is not None:
        for key in ("CUDA_DEVICE_MEMORY_LIMIT", "CUDA_DEVICE_MEMORY_LIMIT_0", "VLLM_CPU_KVCACHE_SPACE"):
            monkeypatch.delenv(key, raising=False)
        for key, value in (env or {}).items():
            monkeypatch.setenv(key, value)
    args: argparse.Namespace = build_parser().parse_args(["worker", "--backend", "vllm", "--model", str(folder),
                                                          *flags])
    config = worker_cmd.build_config(args).engine
    assert isinstance(config, VllmEngineConfig)
    return config


def test_a_hami_quota_gives_quota_over_physical(folder: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    config = vllm_config(folder, "--device", "cuda", "--gpu", "h100", env={"CUDA_DEVICE_MEMORY_LIMIT_0": "40g"},
                         monkeypatch=monkeypatch)
    assert config.gpu_memory_utilization == pytest.approx(0.5)
    spec = get_model_preset("llama-3-8b").with_dtype("bfloat16")
    assert config.predicted_pool_bytes == kv_pool_bytes(80 * GiB, 0.5, weight_bytes_per_rank(spec),
                                                        DEFAULT_OVERHEAD_BYTES)
    assert config.engine_kwargs()["gpu_memory_utilization"] == pytest.approx(0.5)
    assert "enforce_eager" not in config.engine_kwargs()  # a GPU keeps vLLM's CUDA graphs
    assert config.block_size == 16


def test_without_a_quota_the_default_is_said_out_loud(folder: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    config = vllm_config(folder, "--device", "cuda", "--gpu", "h100", monkeypatch=monkeypatch)
    assert config.gpu_memory_utilization == pytest.approx(0.9)


@pytest.mark.parametrize("flags", [["--utilization", "0.9"], ["--vllm-arg", "gpu_memory_utilization=0.9"]])
def test_a_utilization_above_the_quota_is_refused(folder: Path, monkeypatch: pytest.MonkeyPatch,
                                                  flags: list[str]) -> None:
    with pytest.raises(ConfigError, match=r"0\.90 × 80 GiB = 72\.0 GiB exceeds the 40\.0 GiB memory quota"):
        vllm_config(folder, "--device", "cuda", "--gpu", "h100", *flags, env={"CUDA_DEVICE_MEMORY_LIMIT_0": "40g"},
                    monkeypatch=monkeypatch)


def test_on_the_cpu_the_kv_space_follows_the_quota(small: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    spec = get_model_preset("small").with_dtype("bfloat16")
    config = vllm_config(small, "--quota-gb", "0.5", monkeypatch=monkeypatch)
    want = kv_pool_bytes(machine_memory_bytes(), 0.5 * GiB / machine_memory_bytes(), weight_bytes_per_rank(spec), 0)
    assert config.kv_cache_memory_bytes == want == config.predicted_pool_bytes
    assert abs(want - (0.5 * GiB - weight_bytes_per_rank(spec))) < 2  # quota − weights
    assert config.gpu_memory_utilization is None and config.engine_kwargs()["enforce_eager"] is True
    assert config.block_size == CPU_BLOCK_SIZE
    default = vllm_config(small, monkeypatch=monkeypatch)  # no quota: 1 GiB × 0.9 − weights, as the torch backend
    assert default.kv_cache_memory_bytes == kv_pool_bytes(GiB, 0.9, weight_bytes_per_rank(spec), 0)


def test_on_the_cpu_an_explicit_kv_space_above_the_quota_is_refused(small: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ConfigError, match=r"VLLM_CPU_KVCACHE_SPACE=8 asks for 8\.00 GiB of KV space"):
        vllm_config(small, "--quota-gb", "1", env={"VLLM_CPU_KVCACHE_SPACE": "8"}, monkeypatch=monkeypatch)
    with pytest.raises(ConfigError, match="kv_cache_memory_bytes asks for"):
        vllm_config(small, "--quota-gb", "1", "--vllm-arg", f"kv_cache_memory_bytes={4 * GiB}",
                    monkeypatch=monkeypatch)
    kept = vllm_config(small, env={"VLLM_CPU_KVCACHE_SPACE": "2"}, monkeypatch=monkeypatch)
    assert kept.kv_cache_memory_bytes is None and kept.predicted_pool_bytes == 2 * GiB  # vLLM reads the variable


@pytest.mark.parametrize(("flags", "message"), [
    (["--vllm-arg", "model=/elsewhere"], "--vllm-arg model: the worker sets it itself (use --model)"),
    (["--vllm-arg", "max_model_len"], "--vllm-arg takes KEY=VALUE"),
    (["--time-scale", "2"], "--time-scale only apply to --backend sim"),
])
def test_bad_flags_are_refused(folder: Path, monkeypatch: pytest.MonkeyPatch, flags: list[str], message: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(message)):
        vllm_config(folder, *flags, monkeypatch=monkeypatch)


def test_engine_arguments_pass_through(small: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    config = vllm_config(small, "--vllm-arg", "max-model-len=2048", "--vllm-arg", "enforce_eager=false",
                         "--vllm-arg", 'kv_transfer_config={"kv_connector": "X"}', "--tp", "2",
                         monkeypatch=monkeypatch)
    kw = config.engine_kwargs()
    assert kw["max_model_len"] == 2048 and kw["enforce_eager"] is False
    assert kw["kv_transfer_config"] == {"kv_connector": "X"} and kw["tensor_parallel_size"] == 2
    assert kw["skip_tokenizer_init"] is True and kw["model"] == str(small)


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_prefill_and_decode_workers_are_sized_before_vllm_starts(folder: Path, role: str) -> None:
    """A vLLM prefill or decode worker is planned as a colocated one: a pool that cannot fit is one
    line, exit code 2, before vLLM is imported (the command fails fast, vLLM installed or not)."""
    proc = subprocess.run([sys.executable, "-m", "pdrouter", role, "--backend", "vllm", "--model", str(folder)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"pdrouter {role}: error: the KV pool does not fit: "), lines


def test_the_utilization_refusal_is_one_line_and_starts_nothing(folder: Path) -> None:
    env = {"CUDA_DEVICE_MEMORY_LIMIT_0": "40g", "PATH": "/usr/bin:/bin"}
    proc = subprocess.run([sys.executable, "-m", "pdrouter", "worker", "--backend", "vllm", "--model", str(folder),
                           "--device", "cuda", "--gpu", "h100", "--utilization", "0.9"],
                          capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "exceeds the 40.0 GiB memory quota (CUDA_DEVICE_MEMORY_LIMIT_0=40g)" in lines[0]
    assert proc.stdout == ""
