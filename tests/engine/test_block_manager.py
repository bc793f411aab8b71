"""Block manager: exact block ids, reference counts, prefix reuse, eviction order, events."""

from __future__ import annotations

import subprocess
import sys

import pytest

from pdrouter.core.errors import ConfigError
from pdrouter.core.hashing import BlockHasher
from pdrouter.core.ids import BlockHash
from pdrouter.engine.block_manager import BlockManager
from pdrouter.engine.events import RecordingBlockEventSink


def hashes(tag: int, n: int) -> list[BlockHash]:
    """``n`` chained-looking hashes of a sequence called ``tag``."""
    return [BlockHash(bytes([tag, i]) * 8) for i in range(n)]


def make(num_blocks: int = 8, block_size: int = 4, **kw: object) -> tuple[BlockManager, RecordingBlockEventSink]:
    sink = RecordingBlockEventSink()
    return BlockManager(num_blocks, block_size, sink=sink, **kw), sink  # type: ignore[arg-type]


def test_fresh_allocation_takes_lowest_ids_in_order() -> None:
    bm, sink = make()
    a = bm.allocate(hashes(1, 2), num_tokens=10)
    assert a is not None
    assert (a.block_ids, a.num_cached_blocks) == ([0, 1, 2], 0)
    assert [bm.ref_count(b) for b in range(4)] == [1, 1, 1, 0]
    assert bm.num_free_blocks == 5
    assert sink.events == []


def test_commit_then_prefix_reuse_shares_blocks() -> None:
    bm, sink = make()
    ha = hashes(1, 3)
    a = bm.allocate(ha, 12)
    assert a is not None
    bm.commit(a.block_ids, ha[:2])
    assert sink.events == [("stored", tuple(ha[:2]))]
    assert [bm.block_hash(b) for b in a.block_ids] == [ha[0], ha[1], None]
    b = bm.allocate([ha[0], ha[1], BlockHash(b"x" * 16)], 14)
    assert b is not None
    assert (b.block_ids, b.num_cached_blocks) == ([0, 1, 3, 4], 2)
    assert [bm.ref_count(i) for i in range(5)] == [2, 2, 1, 1, 1]
    bm.commit(a.block_ids, ha, start=2)
    assert sink.events[-1] == ("stored", (ha[2],))
    bm.free(a.block_ids)
    bm.free(b.block_ids)
    assert bm.num_free_blocks == 8
    assert bm.num_cached_blocks == 3


def test_an_allocation_given_its_match_equals_one_that_matches_itself() -> None:
    results = []
    for given in (False, True):
        bm, _ = make()
        ha = hashes(1, 3)
        a = bm.allocate(ha, 12)
        assert a is not None
        bm.commit(a.block_ids, ha[:2])
        asked = [ha[0], ha[1], BlockHash(b"x" * 16)]
        matched = bm.match_prefix(asked)
        assert matched == [0, 1]
        b = bm.allocate(asked, 14, matched=matched if given else None)
        assert b is not None
        results.append((b.block_ids, b.num_cached_blocks, [bm.ref_count(i) for i in range(6)], bm.num_free_blocks))
    assert results[0] == results[1] == ([0, 1, 3, 4], 2, [2, 2, 1, 1, 1, 0], 3)


def test_hits_stop_at_the_first_miss() -> None:
    bm, _ = make()
    h = hashes(1, 3)
    a = bm.allocate(h, 12)
    assert a is not None
    bm.commit(a.block_ids, [h[0], h[2]])  # block 1 registered under h[2]: a chain cannot skip h[1]
    assert bm.match_prefix(h) == [0]
    bm.free(a.block_ids)


def test_release_is_tail_first_and_eviction_is_lru() -> None:
    bm, sink = make(num_blocks=4, block_size=2)
    h = hashes(1, 4)
    a = bm.allocate(h, 8)
    assert a is not None and a.block_ids == [0, 1, 2, 3]
    bm.commit(a.block_ids, h)
    bm.free(a.block_ids)
    assert bm.eviction_order() == [3, 2, 1, 0]
    assert bm.num_free_blocks == 4
    # An unrelated sequence evicts the least recently released block: the tail of `a`.
    b = bm.allocate([], 2)
    assert b is not None and b.block_ids == [3]
    assert sink.events[-1] == ("removed", (h[3],))
    assert bm.block_hash(3) is None and bm.cached_block(h[3]) is None
    # A hit takes blocks out of the LRU list; releasing them puts them back as most recent.
    c = bm.allocate(h[:2], 4)
    assert c is not None and (c.block_ids, c.num_cached_blocks) == ([0, 1], 2)
    assert bm.eviction_order() == [2]
    bm.free(c.block_ids)
    assert bm.eviction_order() == [2, 1, 0]
    bm.free(b.block_ids)  # uncached: back to the free queue, taken before any cached block
    d = bm.allocate([], 4)
    assert d is not None and d.block_ids == [3, 2]
    assert sink.events[-1] == ("removed", (h[2],))
    bm.free(d.block_ids)
    assert bm.num_free_blocks == 4


def test_free_blocks_are_taken_before_cached_ones() -> None:
    bm, sink = make(num_blocks=4, block_size=2)
    h = hashes(1, 1)
    a = bm.allocate(h, 2)
    assert a is not None
    bm.commit(a.block_ids, h)
    bm.free(a.block_ids)
    b = bm.allocate([], 6)
    assert b is not None and b.block_ids == [1, 2, 3]
    assert bm.cached_block(h[0]) == 0
    assert all(kind == "stored" for kind, _ in sink.events)
    bm.free(b.block_ids)


def test_max_cached_blocks_caps_the_hit() -> None:
    bm, _ = make()
    h = hashes(1, 2)
    a = bm.allocate(h, 8)
    assert a is not None
    bm.commit(a.block_ids, h)
    b = bm.allocate(h, 8, max_cached_blocks=1)
    assert b is not None and (b.block_ids, b.num_cached_blocks) == ([0, 2], 1)
    assert bm.ref_count(1) == 1
    bm.free(a.block_ids)
    bm.free(b.block_ids)


def test_failed_allocation_changes_nothing_and_counts_idle_hits() -> None:
    bm, sink = make(num_blocks=4, block_size=2)
    h = hashes(1, 2)
    a = bm.allocate(h, 4)
    assert a is not None
    bm.commit(a.block_ids, h)
    bm.free(a.block_ids)
    before = (bm.num_free_blocks, bm.eviction_order(), len(sink.events))
    # 2 idle hits + 3 new blocks = 5 > 4: refused although 4 blocks look free.
    assert bm.allocate(h, 10) is None
    assert (bm.num_free_blocks, bm.eviction_order(), len(sink.events)) == before
    assert [bm.ref_count(i) for i in range(4)] == [0, 0, 0, 0]
    # 2 idle hits + 2 new blocks = 4: fits exactly.
    c = bm.allocate(h, 8)
    assert c is not None and c.block_ids == [0, 1, 2, 3]
    assert bm.num_free_blocks == 0
    assert bm.allocate([], 1) is None
    bm.free(c.block_ids)


def test_grow_appends_in_place_or_changes_nothing() -> None:
    bm, _ = make(num_blocks=4, block_size=4)
    first = bm.allocate([], 4)
    assert first is not None
    blocks = first.block_ids
    assert bm.grow(blocks, 4) and blocks == [0]
    assert bm.grow(blocks, 9) and blocks == [0, 1, 2]
    assert not bm.grow(blocks, 20)
    assert blocks == [0, 1, 2] and bm.num_free_blocks == 1
    bm.free(blocks)
    assert bm.num_free_blocks == 4


def test_duplicate_hash_stays_private() -> None:
    bm, sink = make()
    h = hashes(1, 1)
    a = bm.allocate([], 4)
    b = bm.allocate([], 4)
    assert a is not None and b is not None
    bm.commit(a.block_ids, h)
    bm.commit(b.block_ids, h)  # same content computed twice: only the first is registered
    assert sink.events == [("stored", (h[0],))]
    assert bm.cached_block(h[0]) == 0 and bm.block_hash(1) is None
    bm.free(b.block_ids)
    bm.free(a.block_ids)
    assert bm.eviction_order() == [0]
    assert bm.num_free_blocks == 8


def test_double_free_is_an_error() -> None:
    bm, _ = make()
    a = bm.allocate([], 4)
    assert a is not None
    bm.free(a.block_ids)
    with pytest.raises(RuntimeError, match="freed more often"):
        bm.free(a.block_ids)


def test_reset_prefix_cache_drops_only_unused_blocks() -> None:
    bm, sink = make()
    h = hashes(1, 2)
    a = bm.allocate(h, 8)
    assert a is not None
    bm.commit(a.block_ids, h)
    bm.free(a.block_ids[1:])  # block 0 still in use
    assert bm.reset_prefix_cache() == 1
    assert sink.events[-1] == ("removed", (h[1],))
    assert bm.cached_block(h[0]) == 0 and bm.cached_block(h[1]) is None
    bm.free(a.block_ids[:1])
    assert sink.live == {h[0]}


def test_discard_forgets_and_returns_only_the_blocks_nobody_else_holds() -> None:
    bm, sink = make()
    h = hashes(1, 3)
    a = bm.allocate(h, 12)
    assert a is not None
    bm.commit(a.block_ids, h[:2])
    b = bm.allocate(h[:1], 8)  # shares block 0
    assert b is not None and b.block_ids == [0, 3]
    assert bm.discard(a.block_ids) == [2, 1]  # tail first; block 0 is b's too
    assert sink.events[-1] == ("removed", (h[1],))
    assert bm.cached_block(h[0]) == 0 and bm.cached_block(h[1]) is None
    assert [bm.ref_count(i) for i in range(4)] == [1, 0, 0, 1]
    assert bm.eviction_order() == [] and bm.num_free_blocks == 6
    c = bm.allocate(hashes(2, 0), 24)  # the discarded blocks are free again, after the untouched ones
    assert c is not None and c.block_ids == [4, 5, 6, 7, 2, 1]
    bm.free(c.block_ids)
    bm.free(b.block_ids)
    assert sink.live == {h[0]}


def test_disabled_prefix_caching_never_hits_or_emits() -> None:
    bm, sink = make(enable_prefix_caching=False)
    h = hashes(1, 2)
    a = bm.allocate(h, 8)
    assert a is not None
    bm.commit(a.block_ids, h)
    assert bm.match_prefix(h) == [] and sink.events == []
    bm.free(a.block_ids)


def test_real_chained_hashes_drive_reuse() -> None:
    hasher = BlockHasher(block_size=4, seed="model")
    bm, _ = make(block_size=4)
    shared = [1, 2, 3, 4, 5, 6, 7, 8]
    first = hasher.hash_blocks([*shared, 9, 9, 9, 9])
    a = bm.allocate(first, 12)
    assert a is not None
    bm.commit(a.block_ids, first)
    second = hasher.hash_blocks([*shared, 7, 7, 7, 7])
    assert bm.match_prefix(second) == [0, 1]
    assert bm.match_prefix(hasher.hash_blocks([0, *shared[1:]])) == []
    bm.free(a.block_ids)


def test_rejects_empty_pool() -> None:
    with pytest.raises(ConfigError):
        BlockManager(0, 16)


def test_block_manager_imports_no_torch() -> None:
    code = ("import sys, pdrouter.engine, pdrouter.engine.block_manager, pdrouter.engine.events; "
            "import pdrouter.core.tokenizer; "
            "assert 'torch' not in sys.modules, 'torch imported'")
    subprocess.run([sys.executable, "-c", code], check=True)
