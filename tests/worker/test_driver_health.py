"""The driver's health: a step that raises stops the engine, says why, and tells its subscribers first.

A simulated engine (no torch) with an injected fault (``pdrouter.engine.faults``) behind the real driver.
"""

from __future__ import annotations

import asyncio

import pytest

from pdrouter.core.errors import ConfigError, UnavailableError
from pdrouter.core.gpu import get_gpu_preset
from pdrouter.core.ids import RequestId
from pdrouter.core.model_spec import get_model_preset
from pdrouter.core.sampling import SamplingParams
from pdrouter.engine.faults import EngineFault, FaultyStep, InjectedFault
from pdrouter.engine.sim.config import BYTE_TEXT_TOKENS, SimEngineConfig
from pdrouter.engine.sim.engine import SimEngine
from pdrouter.worker.driver import ENGINE_STOPPED, EngineDriver

FAULT = EngineFault("step-raises", 400)


def faulty_engine() -> SimEngine:
    engine = SimEngine(SimEngineConfig(spec=get_model_preset("tiny"), gpu=get_gpu_preset("h100"), time_scale=0.0,
                                       num_blocks=64, token_range=BYTE_TEXT_TOKENS))
    engine.model_step = FaultyStep(engine.model_step, FAULT)
    return engine


async def collect(driver: EngineDriver, rid: str, prompt: list[int]) -> list[int]:
    tokens: list[int] = []
    async for out in driver.generate(RequestId(rid), prompt, SamplingParams(max_tokens=4)):
        tokens.extend(out.new_token_ids)
    return tokens


async def test_a_failed_step_stops_the_engine_and_subscribers_hear_before_any_waiter() -> None:
    driver = EngineDriver(faulty_engine())
    heard: list[tuple[str, str]] = []
    driver.on_failure(lambda failure: heard.append(("subscriber", failure)))
    try:
        assert len(await collect(driver, "fine", [65, 66, 67])) == 4
        assert driver.failure is None and not driver.load().engine_failed

        async def doomed() -> None:
            try:
                await collect(driver, "doomed", [65, 400])
            except UnavailableError as exc:
                heard.append(("waiter", exc.message))

        await asyncio.wait_for(doomed(), 30)
        assert [who for who, _ in heard] == ["subscriber", "waiter"]
        assert driver.failure is not None and InjectedFault.__name__ in driver.failure
        assert heard[1][1] == ENGINE_STOPPED and "400" not in heard[1][1]  # callers get no internals
        assert driver.load().engine_failed
        with pytest.raises(UnavailableError, match="serves no more requests"):
            driver.generate(RequestId("late"), [65], SamplingParams(max_tokens=2))
        late: list[str] = []
        driver.on_failure(late.append)  # a late subscriber hears at once
        assert late == [driver.failure]
    finally:
        await driver.close()


@pytest.mark.parametrize("spec", ["", "step-raises", "step-raises:x", "explode:3", "step-raises:-1"])
def test_a_malformed_fault_is_refused(spec: str) -> None:
    with pytest.raises(ConfigError, match="PDROUTER_ENGINE_FAULT"):
        EngineFault.parse(spec)


def test_the_fault_fires_only_on_steps_holding_its_token() -> None:
    engine = faulty_engine()
    assert len(engine.generate([[65, 66]], SamplingParams(max_tokens=3))[0]) == 3
    with pytest.raises(InjectedFault):
        engine.generate([[65, 400]], SamplingParams(max_tokens=3))
