"""``cancel_and_wait``: a task that loses a cancellation is cancelled again until it has ended."""

from __future__ import annotations

import asyncio

import pytest

from pdrouter.core.aio import cancel_and_wait


async def test_a_task_that_swallows_one_cancellation_is_cancelled_again() -> None:
    swallowed = 0

    async def loop() -> None:
        nonlocal swallowed
        while True:
            try:
                await asyncio.sleep(3600)
            except asyncio.CancelledError:
                if swallowed:
                    raise
                swallowed += 1  # as a contended connection pool was seen to do: the loop runs on

    task = asyncio.create_task(loop())
    await asyncio.sleep(0)
    await asyncio.wait_for(cancel_and_wait(task, recancel_s=0.05), 5)
    assert task.cancelled() and swallowed == 1


async def test_the_error_a_task_ended_with_is_raised() -> None:
    async def broken() -> None:
        raise RuntimeError("boom")

    task = asyncio.create_task(broken())
    await asyncio.sleep(0)
    with pytest.raises(RuntimeError, match="boom"):
        await cancel_and_wait(task)
    await cancel_and_wait(None)
