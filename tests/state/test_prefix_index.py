"""The prefix index against a real Redis: exact prefix lengths, eviction, epochs, expiry."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest
import redis.asyncio as aioredis

from pdrouter.core.hashing import hash_blocks
from pdrouter.core.ids import Epoch, WorkerId
from pdrouter.state.prefix_index import PrefixIndex

W0, W1, W2 = WorkerId("p0"), WorkerId("p1"), WorkerId("p2")
PROMPT = list(range(5000, 5000 + 16 * 40))  # 40 blocks
HASHES = hash_blocks(PROMPT, 16)


@pytest.fixture
async def index(redis_url: str) -> AsyncIterator[PrefixIndex]:
    client = aioredis.Redis.from_url(redis_url)
    yield PrefixIndex(client, pool="tiny", ttl_ms=400)
    await client.aclose()


async def test_longest_prefix_per_worker(index: PrefixIndex) -> None:
    await index.add(W0, 1, HASHES[:10])
    await index.add(W1, 1, HASHES)
    workers = [(W0, Epoch(1)), (W1, Epoch(1)), (W2, Epoch(1))]
    matches = await index.lookup(HASHES, workers)
    assert [(m.worker_id, m.blocks) for m in matches] == [("p0", 10), ("p1", 40), ("p2", 0)]
    # A prompt sharing only the first 5 blocks.
    other = hash_blocks(PROMPT[:80] + [1] * 200, 16)
    assert [m.blocks for m in await index.lookup(other, workers)] == [5, 5, 0]
    # Every prefix length is found exactly.
    for k in range(41):
        await index.clear(W2, 1)
        await index.add(W2, 1, HASHES[:k])
        assert (await index.lookup(HASHES, [(W2, Epoch(1))]))[0].blocks == k


async def test_eviction_removes_entries(index: PrefixIndex) -> None:
    await index.add(W0, 1, HASHES[:20])
    await index.apply(W0, 1, [(False, HASHES[12:20]), (True, HASHES[20:22]), (False, HASHES[20:22])])
    assert (await index.lookup(HASHES, [(W0, Epoch(1))]))[0].blocks == 12
    assert await index.size(W0, 1) == 12


async def test_old_epoch_entries_do_not_count(index: PrefixIndex) -> None:
    await index.add(W0, 1, HASHES)
    assert (await index.lookup(HASHES, [(W0, Epoch(2))]))[0].blocks == 0


async def test_entries_expire_without_refresh(index: PrefixIndex) -> None:
    await index.add(W0, 1, HASHES)
    await index.add(W1, 1, HASHES)
    for _ in range(3):
        await asyncio.sleep(0.2)
        await index.touch(W1, 1)
    assert await index.size(W0, 1) == 0
    assert await index.size(W1, 1) == 40


async def test_empty_inputs(index: PrefixIndex) -> None:
    assert await index.lookup(HASHES, []) == []
    assert [m.blocks for m in await index.lookup([], [(W0, Epoch(1))])] == [0]
