"""Engine fixtures: small random model folders (built once per session) and leak-checked engines.

``make_engine`` builds torch engines; ``make_any_engine`` is parametrised over both backends (the
torch engine and the simulated GPU, instant mode, on the same geometry): the engine contract suite.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from pdrouter.core.gpu import get_gpu_preset
from pdrouter.core.model_spec import get_model_preset
from pdrouter.engine.batch_engine import BatchEngine, SchedulingConfig
from pdrouter.engine.config import EngineConfig
from pdrouter.engine.model_folder import read_model_folder
from pdrouter.engine.model_io import make_model, write_random_model
from pdrouter.engine.sim.config import SimEngineConfig
from pdrouter.engine.sim.engine import SimEngine
from pdrouter.engine.torch_engine import TorchEngine

from .engine_testing import AnyEngineFactory, EngineFactory, assert_no_leak


@pytest.fixture(scope="module", autouse=True)
def single_torch_thread() -> Iterator[None]:
    """One intra-op thread: the tiny models gain nothing from more, and on a busy 2-core machine
    OpenMP barriers get very slow. Restored after each module."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The ``tiny`` preset (GQA 4/2 heads, tied embeddings), seed 0."""
    return make_model("tiny", 0, tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="session")
def mha_bias_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A second shape: multi-head (no GQA), q/k/v/o biases, untied head, 3 layers, head_dim 8."""
    spec = dataclasses.replace(get_model_preset("tiny"), name="mha-bias", num_layers=3, hidden_size=48,
                               num_heads=6, num_kv_heads=6, head_dim=8, intermediate_size=96,
                               tie_word_embeddings=False, attention_bias=True, rope_theta=500000.0,
                               rms_norm_eps=1e-6)
    return write_random_model(spec, 7, tmp_path_factory.mktemp("mha-bias"))


def sim_engine(model_dir: Path, *, event_sink: Any = None, block_size: int = 16, num_blocks: int = 64,
               max_num_seqs: int = 64, max_num_batched_tokens: int = 512, enable_prefix_caching: bool = True,
               time_scale: float = 0.0) -> SimEngine:
    """A simulated H100 on the folder's geometry, configured like ``EngineConfig`` would configure a torch one."""
    folder = read_model_folder(model_dir)
    scheduling = SchedulingConfig(max_num_seqs, max_num_batched_tokens, enable_prefix_caching)
    return SimEngine(SimEngineConfig(spec=folder.spec, gpu=get_gpu_preset("h100"), eos_token_ids=folder.eos_token_ids,
                                     model_dir=model_dir, time_scale=time_scale, block_size=block_size,
                                     num_blocks=num_blocks, scheduling=scheduling), event_sink=event_sink)


def _engines(kind: str, default_dir: Path) -> Iterator[Callable[..., Any]]:
    """A factory of ``kind`` engines (default: the tiny model, 64 blocks); each must end the test with no leak."""
    engines: list[BatchEngine] = []

    def factory(model_dir: Path | None = None, *, event_sink: Any = None, **overrides: Any) -> BatchEngine:
        overrides.setdefault("num_blocks", 64)
        engine: BatchEngine
        if kind == "sim":
            engine = sim_engine(model_dir or default_dir, event_sink=event_sink, **overrides)
        else:
            engine = TorchEngine(EngineConfig(model_dir or default_dir, **overrides), event_sink=event_sink)
        engines.append(engine)
        return engine

    yield factory
    for engine in engines:
        assert_no_leak(engine)


@pytest.fixture
def make_engine(tiny_dir: Path) -> Iterator[EngineFactory]:
    """Build torch engines."""
    yield from _engines("torch", tiny_dir)


@pytest.fixture(params=["torch", "sim"])
def make_any_engine(request: pytest.FixtureRequest, tiny_dir: Path) -> Iterator[AnyEngineFactory]:
    """Like ``make_engine``, once with the torch engine and once with the simulated one."""
    yield from _engines(request.param, tiny_dir)
