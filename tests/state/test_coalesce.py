"""The call coalescer's batching, ordering, failure and cancellation rules (pure logic)."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import pytest

from pdrouter.state.coalesce import Coalescer


class Recorder:
    def __init__(self, fail: bool = False) -> None:
        self.batches: list[tuple[str, list[int]]] = []
        self.release = asyncio.Event()
        self.release.set()
        self.fail = fail

    async def send(self, key: str, items: Sequence[int]) -> list[int]:
        self.batches.append((key, list(items)))
        await asyncio.sleep(0)  # a real call always waits for its answer
        await self.release.wait()
        if self.fail:
            raise ConnectionError("redis went away")
        return [i * 10 for i in items]


async def test_a_lone_call_goes_at_once_and_calls_made_meanwhile_share_the_next_batch() -> None:
    rec = Recorder()
    c: Coalescer[str, int, int] = Coalescer(rec.send)
    assert await c.submit("k", 1) == 10
    assert await asyncio.gather(*(c.submit("k", i) for i in range(5))) == [0, 10, 20, 30, 40]
    # The first of the burst went alone; the rest queued behind it and went together.
    assert rec.batches == [("k", [1]), ("k", [0]), ("k", [1, 2, 3, 4])]


async def test_calls_made_while_a_batch_is_in_flight_form_the_next_batch() -> None:
    rec = Recorder()
    rec.release.clear()
    c: Coalescer[str, int, int] = Coalescer(rec.send, max_batch=3)
    first = asyncio.ensure_future(c.submit("k", 1))
    await asyncio.sleep(0.01)
    later = [asyncio.ensure_future(c.submit("k", i)) for i in range(2, 7)]
    other = asyncio.ensure_future(c.submit("j", 9))  # another key does not wait
    await asyncio.sleep(0.01)
    assert rec.batches == [("k", [1]), ("j", [9])]
    rec.release.set()
    assert await first == 10 and await asyncio.gather(*later) == [20, 30, 40, 50, 60] and await other == 90
    assert rec.batches[2:] == [("k", [2, 3, 4]), ("k", [5, 6])]  # max_batch splits the backlog
    await c.drain()


async def test_a_failure_reaches_every_caller_of_the_batch_and_the_next_batch_still_goes() -> None:
    rec = Recorder(fail=True)
    c: Coalescer[str, int, int] = Coalescer(rec.send)
    results = await asyncio.gather(*(c.submit("k", i) for i in range(3)), return_exceptions=True)
    assert all(isinstance(r, ConnectionError) for r in results)
    rec.fail = False
    assert await c.submit("k", 4) == 40


async def test_cancelled_callers_are_skipped_reported_or_handed_their_result_back() -> None:
    rec = Recorder()
    rec.release.clear()
    returned: list[tuple[str, int, int]] = []
    unknown: list[tuple[str, int]] = []
    c: Coalescer[str, int, int] = Coalescer(rec.send, abandoned=lambda k, i, r: returned.append((k, i, r)),
                                            interrupted=lambda k, i: unknown.append((k, i)))
    on_its_way = asyncio.ensure_future(c.submit("k", 1))
    await asyncio.sleep(0.01)  # [1] in flight
    never_sent = asyncio.ensure_future(c.submit("k", 2))
    queued = asyncio.ensure_future(c.submit("k", 3))
    await asyncio.sleep(0)
    on_its_way.cancel()  # cancelled on its way: the outcome is unknown
    never_sent.cancel()  # cancelled before its batch went: skipped
    for t in (on_its_way, never_sent):
        with pytest.raises(asyncio.CancelledError):
            await t
    assert unknown == [("k", 1)]
    await asyncio.sleep(0)  # the next batch, [3], is on its way now
    assert rec.batches == [("k", [1]), ("k", [3])]
    queued.cancel()  # cancelled while its batch is on the way: the result comes back
    rec.release.set()
    with pytest.raises(asyncio.CancelledError):
        await queued
    await c.drain()
    assert returned == [("k", 3, 30)]
