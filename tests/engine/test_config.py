"""Engine configuration: pool sizing from the capacity math, devices, and refused settings."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from pdrouter.core.capacity import pool_blocks_for_budget
from pdrouter.core.errors import ConfigError
from pdrouter.core.gpu import GiB
from pdrouter.core.sampling import SamplingParams
from pdrouter.engine.config import EngineConfig
from pdrouter.engine.model_io import read_model_folder
from pdrouter.engine.torch_engine import TorchEngine


def test_pool_is_sized_by_the_capacity_math(tiny_dir: Path) -> None:
    config = EngineConfig(tiny_dir, memory_budget_bytes=8 * 1024 * 1024, memory_utilization=0.5, block_size=8)
    engine = TorchEngine(config)
    spec = read_model_folder(tiny_dir).spec
    expected = pool_blocks_for_budget(spec, 8 * 1024 * 1024, 0.5, block_size=8, overhead_bytes=0)
    # (4 MiB - weights) / (8 tokens x 512 bytes of KV per token)
    assert expected == (4 * 1024 * 1024 - spec.weight_bytes) // (8 * 512)
    assert engine.kv_layout.num_blocks == engine.block_manager.num_blocks == expected
    assert engine.kv_tensor.numel() * 4 == engine.kv_layout.pool_bytes
    explicit = TorchEngine(EngineConfig(tiny_dir, num_blocks=5, memory_budget_bytes=GiB))
    assert explicit.kv_layout.num_blocks == 5


def test_overhead_is_subtracted(tiny_dir: Path) -> None:
    small = TorchEngine(EngineConfig(tiny_dir, memory_budget_bytes=8 * 1024 * 1024, overhead_bytes=1024 * 1024))
    large = TorchEngine(EngineConfig(tiny_dir, memory_budget_bytes=8 * 1024 * 1024))
    assert large.kv_layout.num_blocks - small.kv_layout.num_blocks == 1024 * 1024 // (16 * 512)


def test_cpu_needs_an_explicit_pool_size(tiny_dir: Path) -> None:
    with pytest.raises(ConfigError, match="num_blocks or memory_budget_bytes"):
        TorchEngine(EngineConfig(tiny_dir))


def test_budget_that_leaves_no_room_is_refused(tiny_dir: Path) -> None:
    with pytest.raises(ConfigError, match="does not fit"):
        TorchEngine(EngineConfig(tiny_dir, memory_budget_bytes=100_000))


@pytest.mark.parametrize("bad", [{"block_size": 0}, {"num_blocks": 0}, {"max_num_seqs": 0},
                                 {"max_num_batched_tokens": -1}, {"memory_utilization": 1.5}])
def test_invalid_settings(tiny_dir: Path, bad: dict[str, Any]) -> None:
    with pytest.raises(ConfigError):
        EngineConfig(tiny_dir, **bad)


@pytest.mark.parametrize("device", ["tpu", "not a device"])
def test_unknown_devices_are_refused(tiny_dir: Path, device: str) -> None:
    with pytest.raises(ConfigError):
        TorchEngine(EngineConfig(tiny_dir, num_blocks=4, device=device))


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error when CUDA is absent")
def test_cuda_without_a_gpu_is_a_config_error(tiny_dir: Path) -> None:
    with pytest.raises(ConfigError, match="CUDA is not available"):
        TorchEngine(EngineConfig(tiny_dir, num_blocks=4, device="cuda"))


def test_unsupported_dtype(tiny_dir: Path) -> None:
    with pytest.raises(ConfigError):
        TorchEngine(EngineConfig(tiny_dir, num_blocks=4, dtype="float8"))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_engine_matches_cpu(tiny_dir: Path) -> None:
    prompts = [[1, 2, 3], list(range(40)), [7] * 17]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    cpu = TorchEngine(EngineConfig(tiny_dir, num_blocks=32)).generate(prompts, params)
    gpu = TorchEngine(EngineConfig(tiny_dir, num_blocks=32, device="cuda", max_num_batched_tokens=16))
    assert gpu.kv_tensor.is_cuda
    assert gpu.generate(prompts, params) == cpu


def test_the_torch_engine_refuses_a_mixture_of_experts() -> None:
    from pdrouter.core.model_spec import get_model_preset
    from pdrouter.engine.model import LlamaModel

    with pytest.raises(ConfigError, match="mixture of 8 experts"):
        LlamaModel(get_model_preset("mixtral-8x7b"))
