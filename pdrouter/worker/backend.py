"""Which engine a worker runs, and what its KV transport moves: the torch engine, a simulated GPU or vLLM.

* ``EngineConfig`` → ``pdrouter.engine.torch_engine.TorchEngine`` (torch; the transport moves its pool tensor);
* ``SimEngineConfig`` → ``pdrouter.engine.sim.engine.SimEngine`` (no torch; the transport moves a
  one-byte-per-block-and-layer stand-in pool, ``pdrouter.transfer.pool_bytes.StandinPool``, and
  the prefill side paces each transfer to the modeled time of the real bytes, ``TransferPacing``);
* ``VllmEngineConfig`` → ``pdrouter.engine.vllm.VllmEngine`` (vLLM's async engine client; colocated
  workers only for now: its KV moves through a vLLM KV connector, not this transport).

:func:`start_engine` gives the worker its engine behind the one contract the roles program against
(``pdrouter.worker.engine_contract``): the project's engine through ``EngineDriver``, vLLM as it is.

The torch engine's module is imported only when a torch engine is built, so a simulated worker
process never loads torch (tens of them fit on one machine); vLLM only when a vLLM engine starts.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from importlib.metadata import PackageNotFoundError, version

from pdrouter.core.workers import EngineIdentity
from pdrouter.engine.batch_engine import BatchEngine
from pdrouter.engine.config import EngineConfig
from pdrouter.engine.events import BlockEventSink
from pdrouter.engine.faults import EngineFault, FaultyStep
from pdrouter.engine.sim.config import SimEngineConfig
from pdrouter.engine.sim.engine import SimEngine
from pdrouter.engine.sim.link import SharedLink
from pdrouter.engine.vllm.config import VllmEngineConfig
from pdrouter.transfer.pool_bytes import PoolBytes, StandinPool
from pdrouter.worker.driver import EngineDriver
from pdrouter.worker.engine_contract import ServingEngine

EngineSettings = EngineConfig | SimEngineConfig | VllmEngineConfig
"""A worker's engine configuration: the project's (real or simulated) or vLLM."""


async def start_engine(config: EngineSettings, event_sink: BlockEventSink | None = None,
                       fault: EngineFault | None = None) -> ServingEngine:
    """The engine ``config`` describes, started, behind the worker's engine contract (call on the
    worker's event loop; the blocking parts run on threads). ``fault``: a fault to inject into the
    project's engine's model step (tests; vLLM's faults are real ones)."""
    if isinstance(config, VllmEngineConfig):
        from pdrouter.engine.vllm.engine import VllmEngine  # vLLM only for a vLLM worker

        return await VllmEngine.start(config, event_sink)
    engine = await asyncio.to_thread(build_engine, config, event_sink, fault)
    return EngineDriver(engine, engine_identity(engine))


def engine_identity(engine: BatchEngine) -> EngineIdentity:
    """The project's engine as a registry record names it: ``torch`` or ``sim``, pd-router's version, the device."""
    try:
        own = version("pd-router")
    except PackageNotFoundError:  # running from a source tree that was never installed
        own = "unknown"
    return EngineIdentity("sim" if isinstance(engine, SimEngine) else "torch", own, device_name(engine))


def build_engine(config: EngineConfig | SimEngineConfig, event_sink: BlockEventSink | None = None,
                 fault: EngineFault | None = None) -> BatchEngine:
    """The project's engine ``config`` describes (blocking: the torch engine loads its weights), its model
    step wrapped to inject ``fault`` when one is given (tests)."""
    engine: BatchEngine
    if isinstance(config, SimEngineConfig):
        engine = SimEngine(config, event_sink=event_sink)
    else:
        from pdrouter.engine.torch_engine import TorchEngine  # torch, for the real engine only

        engine = TorchEngine(config, event_sink=event_sink)
    if fault is not None:
        engine.model_step = FaultyStep(engine.model_step, fault)
    return engine


def kv_pool(engine: BatchEngine) -> PoolBytes:
    """What the worker's KV sender or receiver moves: a view of the pool tensor, or a simulated
    worker's stand-in pool (``pool.layout`` is the layout the transport sees)."""
    if isinstance(engine, SimEngine):
        return StandinPool.for_layout(engine.kv_layout)
    from pdrouter.engine.torch_engine import TorchEngine
    from pdrouter.transfer.pool_view import PoolView

    assert isinstance(engine, TorchEngine)
    return PoolView(engine.kv_tensor, engine.kv_layout)


def device_name(engine: BatchEngine) -> str:
    """What the worker runs on, as its registry record names it: ``cpu``, ``cuda:0``, ``sim:h100-80g``…"""
    if isinstance(engine, SimEngine):
        return engine.device_name
    from pdrouter.engine.torch_engine import TorchEngine

    assert isinstance(engine, TorchEngine)
    return str(engine.device)


class TransferPacing:
    """When a simulated prefill worker may let a transfer finish: the real bytes' time on its link.

    The link's queue runs in simulated seconds (wall seconds ÷ the time scale); ``deadline``
    answers on the wall clock. Time scale 0 never waits.
    """

    def __init__(self, link: SharedLink, block_bytes: int, time_scale: float,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.link = link
        self.block_bytes = block_bytes
        self.time_scale = time_scale
        self._clock = clock

    def modeled_s(self, blocks: int) -> float:
        """Simulated seconds one transfer of ``blocks`` blocks takes on an idle link."""
        return self.link.spec.transfer_s(blocks * self.block_bytes)

    def deadline(self, blocks: int) -> float:
        """Wall-clock time at which a transfer of ``blocks`` blocks starting now completes."""
        now = self._clock()
        if self.time_scale <= 0:
            return now
        done = self.link.reserve(blocks * self.block_bytes, now / self.time_scale)
        return done * self.time_scale

    @classmethod
    def for_engine(cls, engine: BatchEngine) -> TransferPacing | None:
        if not isinstance(engine, SimEngine):
            return None
        cfg = engine.config
        return cls(SharedLink(cfg.link, shared=cfg.link_shared), engine.kv_layout.block_bytes, cfg.time_scale)
