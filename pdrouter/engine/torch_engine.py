"""The torch engine: a Llama-family model over a paged KV tensor, behind the shared batching engine.

``TorchEngine`` is a :class:`pdrouter.engine.batch_engine.BatchEngine` (its module docstring is the
contract: threading, the three ways in, aborts, errors, block events) whose model step is
:class:`TorchModelStep`: it builds the step's tensors (``pdrouter.engine.model_runner``), runs the
model and samples (``pdrouter.engine.sampler``). The pool tensor, ``kv_tensor``, is what the KV
transfer reads and writes.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import cached_property
from typing import cast

import torch

from pdrouter.core.kv_layout import KvLayout
from pdrouter.core.model_spec import normalize_dtype
from pdrouter.core.tokenizer import Tokenizer, load_tokenizer
from pdrouter.engine.batch_engine import BatchEngine, RequestFault, StepWork
from pdrouter.engine.config import EngineConfig
from pdrouter.engine.device import device_memory_bytes, resolve_device, torch_dtype
from pdrouter.engine.events import BlockEventSink
from pdrouter.engine.kv_cache import KvCache
from pdrouter.engine.model import LlamaModel
from pdrouter.engine.model_folder import read_model_folder
from pdrouter.engine.model_runner import ModelRunner, WorkItem
from pdrouter.engine.sampler import make_generator, sample

NON_FINITE_LOGITS = RequestFault("the model's output for this request held values that are not finite")


class TorchModelStep:
    """One model step on the torch model: tensors in, logits out, one token sampled per sampling row.

    A row whose logits are not finite (an overflow in the model, KV that was not checked) is that
    request's fault, not the step's: the others are sampled as usual.
    """

    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner

    def kv_finite(self, block_ids: Sequence[int]) -> bool:
        return self.runner.kv_cache.blocks_finite(block_ids)

    def clear_kv(self, block_ids: Sequence[int]) -> None:
        self.runner.kv_cache.clear_blocks(block_ids)

    def run(self, work: Sequence[StepWork]) -> list[int | RequestFault]:
        items = [WorkItem(w.token_ids, w.start, w.block_ids, w.samples) for w in work]
        sampling = [w.request for w in work if w.samples]
        generators: list[torch.Generator | None] = []
        for req in sampling:
            if req.sampler_state is None and not req.sampling.greedy:
                req.sampler_state = make_generator(req.sampling)
            generators.append(cast("torch.Generator | None", req.sampler_state))
        logits = self.runner.run(items)
        tokens = sample(logits, [r.sampling for r in sampling], generators)
        return [NON_FINITE_LOGITS if t is None else t for t in tokens]


class TorchEngine(BatchEngine):
    """The torch engine of one worker: loads the folder's weights and sizes the KV pool from ``config``."""

    def __init__(self, config: EngineConfig, *, event_sink: BlockEventSink | None = None) -> None:
        self.config = config
        self.device = resolve_device(config.device)
        folder = read_model_folder(config.model_dir)
        dtype = normalize_dtype(config.dtype or folder.spec.dtype)
        spec = folder.spec.with_dtype(dtype)
        self.model = LlamaModel.load(folder, torch_dtype(dtype), self.device)
        num_blocks = config.pool_blocks(spec, device_memory_bytes(self.device))
        layout = KvLayout.for_model(spec, num_blocks, config.block_size, dtype)
        self.kv_cache = KvCache(layout, self.device)
        self.runner = ModelRunner(self.model, self.kv_cache)
        super().__init__(spec, folder.eos_token_ids, layout, config.scheduling, TorchModelStep(self.runner),
                         event_sink=event_sink)

    @property
    def kv_tensor(self) -> torch.Tensor:
        """The pool, shaped ``kv_layout.shape``; touch blocks of live requests only as documented."""
        return self.kv_cache.tensor

    @cached_property
    def tokenizer(self) -> Tokenizer:
        return load_tokenizer(self.config.model_dir)
