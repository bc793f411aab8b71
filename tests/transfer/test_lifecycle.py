from __future__ import annotations

import asyncio
import threading

import pytest

from pdrouter.core.errors import CancelledError, DeadlineExceededError
from pdrouter.transfer.lifecycle import IllegalTransitionError, Lifecycle, TransferState


def test_happy_path_and_terminal_states() -> None:
    life = Lifecycle()
    assert life.state is TransferState.WAITING
    assert life.advance(TransferState.TRANSFERRING)
    assert life.advance(TransferState.DONE)
    assert life.state.terminal and life.error is None
    assert not life.advance(TransferState.FAILED, CancelledError("late"))  # first terminal state wins
    assert life.state is TransferState.DONE


def test_first_failure_wins() -> None:
    life = Lifecycle()
    assert life.advance(TransferState.FAILED, DeadlineExceededError("first"))
    assert not life.advance(TransferState.FAILED, CancelledError("second"))
    assert isinstance(life.error, DeadlineExceededError)


def test_illegal_transitions() -> None:
    life = Lifecycle()
    life.advance(TransferState.TRANSFERRING)
    with pytest.raises(IllegalTransitionError):
        life.advance(TransferState.WAITING)
    with pytest.raises(IllegalTransitionError):
        life.advance(TransferState.FAILED)  # FAILED needs an error
    with pytest.raises(IllegalTransitionError):
        life.advance(TransferState.DONE, CancelledError("x"))  # only FAILED takes one


def test_waiting_from_another_thread() -> None:
    life = Lifecycle()
    timer = threading.Timer(0.05, life.advance, args=(TransferState.DONE,))
    timer.start()
    assert life.wait_for(lambda: life.state.terminal, timeout=10)
    timer.join()
    assert not Lifecycle().wait_for(lambda: False, timeout=0.01)


async def test_async_wait_is_woken_by_other_threads() -> None:
    life = Lifecycle()
    timer = threading.Timer(0.05, life.advance, args=(TransferState.DONE,))
    timer.start()
    assert await life.wait_for_async(lambda: life.state.terminal, timeout=10)
    timer.join()
    assert not await life.wait_for_async(lambda: False, timeout=0.01)
    # the loop stays responsive while waiting
    waiter = asyncio.create_task(Lifecycle().wait_for_async(lambda: False, timeout=0.2))
    await asyncio.sleep(0)
    assert not waiter.done()
    assert not await waiter
