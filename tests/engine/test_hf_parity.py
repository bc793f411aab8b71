"""Logits of the engine's model equal HF ``transformers`` LlamaForCausalLM from the same folder."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from pdrouter.core.kv_layout import KvLayout
from pdrouter.engine.attention import AttentionMetadata, PrefillSegment
from pdrouter.engine.device import torch_dtype
from pdrouter.engine.kv_cache import KvCache
from pdrouter.engine.model import LlamaModel
from pdrouter.engine.model_io import read_model_folder
from pdrouter.engine.model_runner import ModelRunner, WorkItem

transformers = pytest.importorskip("transformers")

TOLERANCE = 1e-5
"""fp32 logits: the random models' logits have a std of about 0.15 (max |logit| about 0.5); seen: ~3e-7."""


def hf_logits(model_dir: Path, tokens: list[int]) -> torch.Tensor:
    hf = transformers.LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        return hf(torch.tensor([tokens])).logits[0].float()


def load(model_dir: Path) -> LlamaModel:
    return LlamaModel.load(read_model_folder(model_dir), torch.float32, torch.device("cpu"))


@pytest.fixture(params=["tiny_dir", "mha_bias_dir"])
def model_dir(request: pytest.FixtureRequest) -> Path:
    path: Path = request.getfixturevalue(request.param)
    return path


def test_the_two_shapes_differ_as_intended(tiny_dir: Path, mha_bias_dir: Path) -> None:
    gqa, mha = read_model_folder(tiny_dir).spec, read_model_folder(mha_bias_dir).spec
    assert gqa.num_heads == 2 * gqa.num_kv_heads and gqa.tie_word_embeddings
    assert mha.num_heads == mha.num_kv_heads and mha.attention_bias and not mha.tie_word_embeddings


def test_full_prompt_logits_match_hf(model_dir: Path) -> None:
    tokens = [random.Random(3).randrange(512) for _ in range(45)]
    model = load(model_dir)
    spec = model.spec
    kv = torch.zeros(spec.num_layers, 2, 4, 16, spec.num_kv_heads, spec.head_dim)
    meta = AttentionMetadata(torch.arange(45), (PrefillSegment(0, 45, 45, None, None),), None)
    ours = model.logits(model(torch.tensor(tokens), torch.arange(45), meta, kv))
    ref = hf_logits(model_dir, tokens)
    assert ref.std() > 0.05
    assert (ours - ref).abs().max().item() < TOLERANCE


def test_paged_chunked_and_decode_logits_match_hf(model_dir: Path) -> None:
    """Prefill in two chunks over scattered blocks, then decode token by token: every row matches HF."""
    tokens = [random.Random(4).randrange(512) for _ in range(40)]
    model = load(model_dir)
    spec = model.spec
    layout = KvLayout.for_model(spec, num_blocks=16, block_size=8, dtype="float32")
    cache = KvCache(layout, torch.device("cpu"))
    assert cache.tensor.dtype == torch_dtype("float32") and tuple(cache.tensor.shape) == layout.shape
    runner = ModelRunner(model, cache)
    blocks = [13, 2, 9, 0, 7]
    rows = [runner.run([WorkItem(tokens[:11], 0, blocks, True)])[0],
            runner.run([WorkItem(tokens[11:30], 11, blocks, True)])[0]]
    positions = [10, 29]
    for p in range(30, 40):
        rows.append(runner.run([WorkItem(tokens[p:p + 1], p, blocks, True)])[0])
        positions.append(p)
    ref = hf_logits(model_dir, tokens)
    diff = (torch.stack(rows) - ref[positions]).abs().max().item()
    assert diff < TOLERANCE
