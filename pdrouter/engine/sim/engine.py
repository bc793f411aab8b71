"""``SimEngine``: the shared batching engine on a simulated GPU (no torch, no KV tensors).

Everything but the model is the torch engine's own code (``pdrouter.engine.batch_engine``): the
scheduler, block manager, prefix cache, chunked prefill, preemption, request lifecycle, block
events and input checks, so a simulated worker accepts, rejects and schedules exactly what a real
one does. The pool is block accounting only, with the real geometry's ``KvLayout`` (its blocks
are the capacity math's). The step is ``pdrouter.engine.sim.model_step.SimModelStep``.
"""

from __future__ import annotations

from functools import cached_property

from pdrouter.core.kv_layout import KvLayout
from pdrouter.core.tokenizer import ByteTokenizer, Tokenizer, load_tokenizer
from pdrouter.engine.batch_engine import BatchEngine
from pdrouter.engine.events import BlockEventSink
from pdrouter.engine.sim.config import SimEngineConfig
from pdrouter.engine.sim.model_step import SimModelStep, SimStepStats
from pdrouter.engine.sim.timing import TimingModel


class SimEngine(BatchEngine):
    """A simulated GPU worker's engine, built from a ``SimEngineConfig``."""

    def __init__(self, config: SimEngineConfig, *, event_sink: BlockEventSink | None = None) -> None:
        self.config = config
        spec = config.spec
        layout = KvLayout.for_model(spec, config.pool_blocks(), config.block_size, spec.dtype, tp=config.tp)
        self.timing = TimingModel(spec, config.gpu, tp=config.tp, calibration=config.calibration,
                                  profile=config.profile)
        self.sim_step = SimModelStep(self.timing, config.token_range or (0, spec.vocab_size), config.time_scale)
        super().__init__(spec, config.eos_token_ids, layout, config.scheduling, self.sim_step,
                         event_sink=event_sink)

    @property
    def device_name(self) -> str:
        return self.config.name

    def wait_for_work(self, timeout: float | None = None) -> bool:
        with self._wake:
            if self._has_work():
                return True
            self.sim_step.idle()
            return self._wake.wait_for(self._has_work, timeout)

    def sim_stats(self) -> SimStepStats:
        return self.sim_step.stats()

    @cached_property
    def tokenizer(self) -> Tokenizer:
        if self.config.model_dir is not None:
            return load_tokenizer(self.config.model_dir)
        return ByteTokenizer(self.spec.vocab_size)
