"""The prefix index against a real Redis: exact prefix lengths, eviction, epochs, expiry and cleanup,
republishing, and lookups whose Redis work does not follow the number of workers."""

from __future__ import annotations

import asyncio
import math
from collections.abc import AsyncIterator, Awaitable

import pytest
import redis.asyncio as aioredis

from pdrouter.core.hashing import hash_blocks
from pdrouter.core.ids import BlockHash, Epoch, WorkerId
from pdrouter.state.pipelined import PipelinedRedis
from pdrouter.state.prefix_index import DROP_BATCH, SCRIPT_BATCH, PrefixIndex
from pdrouter.worker.block_publisher import RedisBlockPublisher

W0, W1, W2 = WorkerId("p0"), WorkerId("p1"), WorkerId("p2")
PROMPT = list(range(5000, 5000 + 16 * 40))  # 40 blocks
HASHES = hash_blocks(PROMPT, 16)


@pytest.fixture
async def client(redis_url: str) -> AsyncIterator[aioredis.Redis]:
    c = aioredis.Redis.from_url(redis_url)
    yield c
    await c.aclose()


@pytest.fixture(params=["client", "pipelined"])
async def index(client: aioredis.Redis, request: pytest.FixtureRequest) -> AsyncIterator[PrefixIndex]:
    """The index over the client's own path, and over a pipelined connection (a worker's writes, a
    router's lookups)."""
    pipe = PipelinedRedis.of(client) if request.param == "pipelined" else None
    assert request.param == "client" or pipe is not None
    yield PrefixIndex(client, pool="tiny", ttl_ms=400, pipelined=pipe)
    if pipe is not None:
        await pipe.aclose()


async def holders(client: aioredis.Redis, index: PrefixIndex, block: BlockHash) -> set[tuple[str, int]]:
    """The incarnations whose slots are set in one block's bitmap."""
    return await index.holders(block)


async def commands_in(client: aioredis.Redis, call: Awaitable[object]) -> int:
    """Redis commands run (those inside scripts included) while awaiting ``call``."""
    await client.config_resetstat()
    await call
    stats = await client.info("commandstats")
    return sum(int(row["calls"]) for name, row in stats.items()
               if name.removeprefix("cmdstat_") not in ("evalsha", "config", "info"))


async def test_longest_prefix_per_worker(index: PrefixIndex) -> None:
    await index.add(W0, 1, HASHES[:10])
    await index.add(W1, 1, HASHES)
    workers = [(W0, Epoch(1)), (W1, Epoch(1)), (W2, Epoch(1))]
    matches = await index.lookup(HASHES, workers)
    assert [(m.worker_id, m.epoch, m.blocks) for m in matches] == [("p0", 1, 10), ("p1", 1, 40), ("p2", 1, 0)]
    assert await index.matched_blocks(HASHES, workers) == {"p0": 10, "p1": 40}
    # A prompt sharing only the first 5 blocks.
    other = hash_blocks(PROMPT[:80] + [1] * 200, 16)
    assert [m.blocks for m in await index.lookup(other, workers)] == [5, 5, 0]
    # A prompt of which nobody holds anything, and one shorter than what the workers hold.
    assert await index.matched_blocks(hash_blocks([7] * 160, 16), workers) == {}
    assert await index.matched_blocks(HASHES[:3], workers) == {"p0": 3, "p1": 3}
    # Every prefix length is found exactly, beside workers holding other depths.
    for k in range(41):
        await index.clear(W2, 1)
        await index.add(W2, 1, HASHES[:k])
        assert [m.blocks for m in await index.lookup(HASHES, workers)] == [10, 40, k]


async def test_many_depths_at_once(index: PrefixIndex) -> None:
    """Every worker at its own depth: each one exact, within the default budget."""
    workers = [(WorkerId(f"w{i}"), Epoch(i + 1)) for i in range(24)]
    for i, (w, e) in enumerate(workers):
        await index.add(w, e, HASHES[:i + 1])
    assert [m.blocks for m in await index.lookup(HASHES[:24], workers)] == list(range(1, 25))


async def test_out_of_budget_depths_are_lower_bounds(client: aioredis.Redis) -> None:
    index = PrefixIndex(client, pool="tiny", lookup_budget=16)
    workers = [(WorkerId(f"w{i}"), Epoch(1)) for i in range(40)]
    for i, (w, e) in enumerate(workers):
        await index.add(w, e, HASHES[:i + 1])
    got = [m.blocks for m in await index.lookup(HASHES, workers)]
    assert all(1 <= g <= i + 1 for i, g in enumerate(got)), got
    assert got[-1] == 40  # the deepest holders are found first
    assert got != list(range(1, 41))  # the budget did cut the search short


async def test_holders_of_a_block_without_its_predecessor_are_not_reported(index: PrefixIndex) -> None:
    await index.add(W0, 1, HASHES[1:20])  # lacks block 0: its cache cannot serve the prompt
    await index.add(W1, 1, HASHES[:30])
    assert await index.matched_blocks(HASHES, [(W0, Epoch(1)), (W1, Epoch(1))]) == {"p1": 30}


async def test_eviction_removes_entries(client: aioredis.Redis, index: PrefixIndex) -> None:
    await index.add(W0, 1, HASHES[:20])
    await index.add(W1, 1, HASHES[:15])
    await index.apply(W0, 1, [(False, HASHES[12:20]), (True, HASHES[20:22]), (False, HASHES[20:22])])
    workers = [(W0, Epoch(1)), (W1, Epoch(1))]
    assert [m.blocks for m in await index.lookup(HASHES, workers)] == [12, 15]
    assert await index.size(W0, 1) == 12
    assert await holders(client, index, HASHES[13]) == {(W1, 1)}  # W0 left the block's set
    assert await holders(client, index, HASHES[17]) == set()
    assert not await client.exists(index.keys.prefix_block(HASHES[17]))  # an empty block key is gone


async def test_large_changes_are_applied_in_order(client: aioredis.Redis, index: PrefixIndex) -> None:
    many = hash_blocks(list(range(16 * 3 * SCRIPT_BATCH)), 16)  # three scripts' worth
    b = SCRIPT_BATCH
    await index.apply(W0, 1, [(True, many), (False, many[b:]), (True, many[b:b + 5])])
    assert await index.size(W0, 1) == b + 5
    assert (await index.lookup(many, [(W0, Epoch(1))]))[0].blocks == b + 5
    assert await holders(client, index, many[b + 4]) == {(W0, 1)}
    assert await holders(client, index, many[-1]) == set()
    # Redis lost its scripts (a restart): the next batch loads them again.
    await client.script_flush()
    await index.apply(W0, 1, [(False, many)])
    assert await index.size(W0, 1) == 0
    assert await holders(client, index, many[0]) == set()


async def test_old_epoch_entries_never_match(client: aioredis.Redis, index: PrefixIndex) -> None:
    await index.add(W0, 1, HASHES)  # the old incarnation, never cleared
    await index.add(W0, 2, HASHES[:5])  # its restart
    assert (await index.lookup(HASHES, [(W0, Epoch(2))]))[0].blocks == 5
    assert await index.matched_blocks(HASHES, [(W0, Epoch(2))]) == {"p0": 5}
    assert (await index.lookup(HASHES, [(W0, Epoch(3))]))[0].blocks == 0
    # Both are stored, side by side, until the old one lapses and is swept.
    assert await holders(client, index, HASHES[30]) == {(W0, 1)}
    assert await holders(client, index, HASHES[0]) == {(W0, 1), (W0, 2)}


async def test_lapsed_entries_are_swept_and_memory_is_bounded(client: aioredis.Redis,
                                                              index: PrefixIndex) -> None:
    other = hash_blocks(list(range(9000, 9000 + 16 * 10)), 16)
    await index.add(W0, 1, HASHES)
    await index.add(W1, 1, HASHES[:10] + other)
    before = await client.dbsize()  # 40 + 10 block keys, 2 own sets, the liveness set, the slots
    assert before == 40 + 10 + 2 + 1 + 1
    for _ in range(3):
        await asyncio.sleep(0.2)
        assert await index.touch(W1, 1)
    assert not await index.touch(W0, 1)  # lapsed: nothing to refresh
    assert await index.sweep() == 40
    assert await index.sweep() == 0
    assert await index.size(W0, 1) == 0
    assert await index.size(W1, 1) == 20
    # W1's blocks, its own set, the liveness set, the slots, the freed slot
    assert await client.dbsize() == 10 + 10 + 1 + 1 + 1 + 1
    assert await index.slot(W0, 1) is None
    assert await holders(client, index, HASHES[0]) == {(W1, 1)}
    assert await client.zcard(index.keys.prefix_live) == 1
    workers = [(W0, Epoch(1)), (W1, Epoch(1))]
    assert [m.blocks for m in await index.lookup(HASHES, workers)] == [0, 10]
    # A lapsed incarnation that writes again is told so (it must republish).
    assert not await index.apply(W0, 1, [(True, HASHES[:3])])
    assert await index.apply(W0, 1, [(True, HASHES[3:4])])


async def test_sweeping_is_done_in_bounded_batches(client: aioredis.Redis) -> None:
    index = PrefixIndex(client, pool="tiny", ttl_ms=50)
    many = hash_blocks(list(range(16 * 1000)), 16)
    await index.add(W0, 1, many)
    await index.add(W1, 1, many[:10])
    await asyncio.sleep(0.1)
    assert await index.sweep(max_calls=2) == 2 * DROP_BATCH  # at most max_calls batches per call
    removed = 2 * DROP_BATCH
    while (got := await index.sweep()) > 0:
        removed += got
    assert removed == 1000 + 10
    assert await client.dbsize() == 0


async def test_clear_removes_everything(client: aioredis.Redis, index: PrefixIndex) -> None:
    many = hash_blocks(list(range(16 * 600)), 16)
    await index.add(W0, 1, many)
    await index.add(W1, 1, many[:100])
    assert await index.clear(W0, 1) == 600
    assert await index.clear(W0, 1) == 0
    assert await index.clear(W2, 7) == 0  # unknown: nothing to do
    assert await client.dbsize() == 100 + 1 + 1 + 1 + 1  # W1's blocks, own set, live, slots, free
    assert await holders(client, index, many[0]) == {(W1, 1)}
    assert not await index.touch(W0, 1)


async def test_lookup_work_does_not_grow_with_the_workers(client: aioredis.Redis) -> None:
    """The Redis commands a lookup runs, for 4 and for 64 workers: the same."""
    prompt = hash_blocks(list(range(16 * 2048)), 16)  # 32k tokens
    counts: dict[tuple[int, str], int] = {}
    for n in (4, 64):
        await client.flushall()
        index = PrefixIndex(client, pool="tiny")
        workers = [(WorkerId(f"w{i}"), Epoch(1)) for i in range(n)]
        for w, e in workers:  # each holds 300 blocks of its own prompts, none of this one
            await index.add(w, e, hash_blocks([int(w[1:]), *range(16 * 300)], 16))
        counts[(n, "miss")] = await commands_in(client, index.matched_blocks(prompt, workers))
        assert await index.matched_blocks(prompt, workers) == {}
        for w, e in workers:  # now each holds the first 256 blocks too (a shared system prompt)
            await index.add(w, e, prompt[:256])
        counts[(n, "shared")] = await commands_in(client, index.matched_blocks(prompt, workers))
        assert await index.matched_blocks(prompt, workers) == {w: 256 for w, _ in workers}
        await index.add(workers[1][0], 1, prompt[:1500])  # and one of them a longer conversation
        counts[(n, "one deeper")] = await commands_in(client, index.matched_blocks(prompt, workers))
        assert (await index.matched_blocks(prompt, workers))[workers[1][0]] == 1500
    for kind in ("miss", "shared", "one deeper"):
        assert counts[(4, kind)] == counts[(64, kind)], counts
    assert counts[(4, "miss")] == 1
    assert counts[(4, "one deeper")] <= 3 * math.ceil(math.log2(2048)), counts


async def test_publisher_republishes_after_redis_lost_the_index(client: aioredis.Redis) -> None:
    index = PrefixIndex(client, pool="tiny", ttl_ms=10_000)
    publisher = RedisBlockPublisher(index, W0, 1)
    publisher.blocks_stored(HASHES[:30])
    publisher.blocks_removed(HASHES[20:30])
    await publisher.flush()
    assert await index.matched_blocks(HASHES, [(W0, Epoch(1))]) == {"p0": 20}
    await client.flushall()  # Redis restarted empty
    await publisher.maintain()  # the liveness refresh finds the incarnation gone...
    await publisher.flush()  # ...and everything the worker holds is published again
    assert await index.matched_blocks(HASHES, [(W0, Epoch(1))]) == {"p0": 20}
    assert publisher.republishes == 1
    # Lost again, found by the next write this time.
    await client.flushall()
    publisher.blocks_stored(HASHES[20:25])
    await publisher.flush()
    await publisher.flush()
    assert await index.matched_blocks(HASHES, [(W0, Epoch(1))]) == {"p0": 25}
    assert await index.size(W0, 1) == 25
    await publisher.stop(clear=True)
    assert await client.dbsize() == 0


async def test_publisher_republishes_after_its_entries_were_swept(client: aioredis.Redis) -> None:
    """A worker that stalled past the TTL (swept meanwhile) comes back whole; its sweeps clean
    up after a dead one."""
    index = PrefixIndex(client, pool="tiny", ttl_ms=100)
    alive = RedisBlockPublisher(index, W0, 1)
    alive.blocks_stored(HASHES)
    await alive.flush()
    await PrefixIndex(client, pool="tiny", ttl_ms=100).add(W1, 5, HASHES[:10])  # dies at once
    await asyncio.sleep(0.15)
    await alive.maintain()  # lapsed itself: republish; and W1's entries are swept
    assert alive.swept_entries == 40 + 10
    await alive.flush()
    assert await index.matched_blocks(HASHES, [(W0, Epoch(1)), (W1, Epoch(5))]) == {"p0": 40}
    assert await index.size(W1, 5) == 0
    assert await client.dbsize() == 40 + 1 + 1 + 1  # W0's blocks, own set, live, slots


async def test_empty_inputs(index: PrefixIndex) -> None:
    assert await index.lookup(HASHES, []) == []
    assert await index.matched_blocks(HASHES, []) == {}
    assert [m.blocks for m in await index.lookup([], [(W0, Epoch(1))])] == [0]
    assert await index.apply(W0, 1, []) is False  # registers the incarnation, nothing else
    assert await index.touch(W0, 1)
    assert await index.size(W0, 1) == 0


async def test_slots_are_given_again_only_once_empty(client: aioredis.Redis, index: PrefixIndex) -> None:
    """A freed slot goes to the next new incarnation, and a router holding the old slot table
    attributes its bits to the new owner only (also after Redis lost everything)."""
    router = PrefixIndex(client, pool="tiny")
    await index.add(W0, 1, HASHES[:20])
    await index.add(W1, 1, HASHES[:5])
    assert (await index.slot(W0, 1), await index.slot(W1, 1)) == (0, 1)
    workers = [(W0, Epoch(1)), (W1, Epoch(1)), (W2, Epoch(1))]
    assert await router.matched_blocks(HASHES, workers) == {"p0": 20, "p1": 5}  # the router reads the table
    await index.clear(W0, 1)
    await index.add(W2, 1, HASHES[:3])
    assert await index.slot(W2, 1) == 0  # W0's, freed once its bits were all cleared
    assert await router.matched_blocks(HASHES, workers) == {"p1": 5, "p2": 3}
    await index.add(W0, 2, HASHES[:30])  # a restart of W0 gets a new slot
    assert await index.slot(W0, 2) == 2
    assert await router.matched_blocks(HASHES, [(W0, Epoch(2)), *workers[1:]]) == {"p0": 30, "p1": 5, "p2": 3}
    await client.flushall()  # Redis restarted empty: slots start again from 0, under a newer version
    await index.add(W1, 1, HASHES[:7])
    assert await router.matched_blocks(HASHES, workers) == {"p1": 7}


async def test_bitmaps_stay_small_and_lookups_name_holders_in_one_reply(client: aioredis.Redis,
                                                                      index: PrefixIndex) -> None:
    workers = [(WorkerId(f"w{i}"), Epoch(1)) for i in range(200)]
    for i, (w, e) in enumerate(workers):
        await index.add(w, e, HASHES[:10 if i % 2 else 40])
    assert await client.strlen(index.keys.prefix_block(HASHES[0])) == 25  # 200 slots: 25 bytes
    got = await index.matched_blocks(HASHES, workers)
    assert got == {w: 10 if i % 2 else 40 for i, (w, _) in enumerate(workers)}
    for w, e in workers[100:]:
        await index.clear(w, e)
    left = {w: 10 if i % 2 else 40 for i, (w, _) in enumerate(workers[:100])}
    assert await index.matched_blocks(HASHES, workers) == left
    assert await holders(client, index, HASHES[39]) == {(w, e) for w, e in workers[:100:2]}


async def test_publishers_of_one_process_take_turns_sweeping(client: aioredis.Redis) -> None:
    index = PrefixIndex(client, pool="tiny", ttl_ms=10_000)
    second = RedisBlockPublisher(index, W0, 1, sweep_turn=(1, 3))  # sweeps on rounds 2, 5, 8, ...
    second.blocks_stored(HASHES[:4])
    await second.flush()
    await PrefixIndex(client, pool="tiny", ttl_ms=1).add(W1, 5, HASHES[:10])  # lapses at once
    await asyncio.sleep(0.01)
    await second.maintain()
    assert second.swept_entries == 0 and await index.size(W1, 5) == 10  # not its turn
    await second.maintain()
    assert second.swept_entries == 10 and await index.size(W1, 5) == 0
    with pytest.raises(ValueError, match="sweep_turn"):
        RedisBlockPublisher(index, W0, 1, sweep_turn=(3, 3))
    await second.stop(clear=True)
