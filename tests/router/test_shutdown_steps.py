"""Router shutdown steps are bounded: a stuck step is abandoned with a warning, never waited on."""

from __future__ import annotations

import asyncio
import logging

import pytest

from pdrouter.router.server import _bounded


async def test_a_finished_step_is_quiet(caplog: pytest.LogCaptureFixture) -> None:
    async def quick() -> int:
        await asyncio.sleep(0)
        return 1

    with caplog.at_level(logging.WARNING):
        await _bounded("quick step", quick(), 1.0)
    assert not caplog.records


async def test_a_step_that_ignores_cancellation_cannot_hold_shutdown(caplog: pytest.LogCaptureFixture) -> None:
    release = asyncio.Event()

    async def stubborn() -> None:
        while not release.is_set():
            try:
                await asyncio.sleep(0.01)
            except asyncio.CancelledError:
                continue  # swallows every cancel

    loop = asyncio.get_running_loop()
    start = loop.time()
    with caplog.at_level(logging.WARNING):
        await _bounded("stubborn step", stubborn(), 0.1)
    assert loop.time() - start < 5
    assert "stubborn step did not finish within 0.1s" in caplog.text
    release.set()  # let it end before the test's loop closes
    await asyncio.sleep(0.05)


async def test_a_failing_step_is_logged_not_raised(caplog: pytest.LogCaptureFixture) -> None:
    async def broken() -> None:
        raise ConnectionError("redis went away")

    with caplog.at_level(logging.WARNING):
        await _bounded("broken step", broken(), 1.0)
    assert "broken step failed: redis went away" in caplog.text
