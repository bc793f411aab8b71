"""Paged KV block manager: allocation, reference counts, prefix reuse and LRU eviction.

Pure Python (no torch): blocks are the integers ``0 .. num_blocks - 1`` that index the block axis
of the pool tensor. Every block is in exactly one of three places:

* **in use**: ``ref_count > 0``, held by one or more sequences (shared prefix blocks have > 1);
* **free**: ``ref_count == 0`` and no hash; kept in a FIFO queue, initially ``0, 1, 2, …``;
* **cached**: ``ref_count == 0`` with a registered hash; kept in LRU order, least recent first.

A block in use may also carry a hash (a full block whose KV is complete). Hashes are the chained
block hashes of ``pdrouter.core.hashing``, so a hit on hash ``i`` means the whole prefix up to block
``i`` matches. Allocation takes free blocks first and only then evicts the least recently released
cached block (emitting ``blocks_removed``). Releasing a sequence returns its blocks tail first, so
the head of a prompt, the part most likely to be shared, is evicted last.

Every method is O(1) per block it touches. Failed allocations change nothing.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Sequence
from dataclasses import dataclass

from pdrouter.core.capacity import blocks_for_tokens
from pdrouter.core.errors import ConfigError
from pdrouter.core.ids import BlockHash
from pdrouter.engine.events import BlockEventSink, NullBlockEventSink


@dataclass(frozen=True)
class Allocation:
    """Blocks given to a new sequence: ``block_ids[:num_cached_blocks]`` came from the prefix cache."""

    block_ids: list[int]
    num_cached_blocks: int


class BlockManager:
    """Owns the block ids of one pool; see the module docstring for the invariants."""

    def __init__(self, num_blocks: int, block_size: int, *, enable_prefix_caching: bool = True,
                 sink: BlockEventSink | None = None) -> None:
        if num_blocks <= 0 or block_size <= 0:
            raise ConfigError(f"block manager needs num_blocks > 0 and block_size > 0, "
                              f"got {num_blocks} and {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self._sink: BlockEventSink = sink or NullBlockEventSink()
        self._ref = [0] * num_blocks
        self._hash: list[BlockHash | None] = [None] * num_blocks
        self._by_hash: dict[BlockHash, int] = {}
        self._free: deque[int] = deque(range(num_blocks))
        self._evictable: OrderedDict[int, None] = OrderedDict()

    # -- queries ------------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        """Blocks an allocation may take now: free plus cached-but-unused (evictable)."""
        return len(self._free) + len(self._evictable)

    @property
    def num_cached_blocks(self) -> int:
        """Blocks with a registered hash, in use or not."""
        return len(self._by_hash)

    def ref_count(self, block_id: int) -> int:
        return self._ref[block_id]

    def block_hash(self, block_id: int) -> BlockHash | None:
        return self._hash[block_id]

    def cached_block(self, block_hash: BlockHash) -> int | None:
        """The block holding ``block_hash``, or None."""
        return self._by_hash.get(block_hash)

    def eviction_order(self) -> list[int]:
        """Cached unused blocks, the next one to be evicted first."""
        return list(self._evictable)

    def match_prefix(self, hashes: Sequence[BlockHash]) -> list[int]:
        """Blocks of the longest cached prefix of ``hashes`` (no side effects)."""
        if not self.enable_prefix_caching:
            return []
        hits: list[int] = []
        for h in hashes:
            block = self._by_hash.get(h)
            if block is None:
                break
            hits.append(block)
        return hits

    def blocks_needed(self, num_tokens: int) -> int:
        return blocks_for_tokens(num_tokens, self.block_size)

    # -- allocation ---------------------------------------------------------------------------
    def allocate(self, hashes: Sequence[BlockHash], num_tokens: int,
                 max_cached_blocks: int | None = None, matched: list[int] | None = None) -> Allocation | None:
        """Blocks for a new sequence of ``num_tokens`` tokens, reusing cached prefix blocks.

        ``hashes`` are the sequence's full-block hashes; at most ``max_cached_blocks`` leading
        blocks are taken from the cache. ``matched``: what ``match_prefix(hashes)`` just returned,
        when the caller asked it (under the same lock): not matched again. Returns None, changing
        nothing, when the pool is short.
        """
        hits = self.match_prefix(hashes) if matched is None else matched
        if max_cached_blocks is not None:
            hits = hits[:max(0, max_cached_blocks)]
        total = self.blocks_needed(num_tokens)
        hits = hits[:total]
        refs = self._ref
        idle = [b for b in hits if refs[b] == 0]
        if total - len(hits) > self.num_free_blocks - len(idle):
            return None
        for block in idle:
            del self._evictable[block]
        for block in hits:
            refs[block] += 1
        block_ids = list(hits)
        block_ids.extend(self._take(total - len(hits)))
        return Allocation(block_ids=block_ids, num_cached_blocks=len(hits))

    def grow(self, block_ids: list[int], num_tokens: int) -> bool:
        """Append blocks to ``block_ids`` (in place) until they hold ``num_tokens`` tokens.

        Returns False, changing nothing, when the pool is short.
        """
        missing = self.blocks_needed(num_tokens) - len(block_ids)
        if missing <= 0:
            return True
        if missing > self.num_free_blocks:
            return False
        block_ids.extend(self._take(missing))
        return True

    def _take(self, count: int) -> list[int]:
        taken: list[int] = []
        evicted: list[BlockHash] = []
        for _ in range(count):
            if self._free:
                block = self._free.popleft()
            else:
                block, _ = self._evictable.popitem(last=False)
                old = self._hash[block]
                assert old is not None
                del self._by_hash[old]
                self._hash[block] = None
                evicted.append(old)
            self._ref[block] = 1
            taken.append(block)
        if evicted:
            self._sink.blocks_removed(evicted)
        return taken

    # -- caching and release ------------------------------------------------------------------
    def commit(self, block_ids: Sequence[int], hashes: Sequence[BlockHash], start: int = 0) -> None:
        """Register ``block_ids[i]`` under ``hashes[i]`` for ``i >= start``: their KV is now complete.

        Blocks already registered are skipped; a hash some other block already holds is not
        registered twice (the duplicate block stays private and is freed uncached).
        """
        if not self.enable_prefix_caching:
            return
        stored: list[BlockHash] = []
        for i in range(start, min(len(hashes), len(block_ids))):
            block, h = block_ids[i], hashes[i]
            if self._hash[block] is not None or h in self._by_hash:
                continue
            self._hash[block] = h
            self._by_hash[h] = block
            stored.append(h)
        if stored:
            self._sink.blocks_stored(stored)

    def free(self, block_ids: Sequence[int]) -> None:
        """Drop one reference to each block, tail first; unreferenced blocks become free or cached."""
        # The reference count inlined, with locals: this loop runs once per block of every request.
        refs, hashes, unused, evictable = self._ref, self._hash, self._free, self._evictable
        for block in reversed(block_ids):
            ref = refs[block]
            if ref <= 0:
                raise RuntimeError(f"block {block} freed more often than it was allocated")
            refs[block] = ref - 1
            if ref == 1:
                if hashes[block] is None:
                    unused.append(block)
                else:
                    evictable[block] = None

    def _unref(self, block: int) -> bool:
        """Drop one reference; True when none is left."""
        ref = self._ref[block]
        if ref <= 0:
            raise RuntimeError(f"block {block} freed more often than it was allocated")
        self._ref[block] = ref - 1
        return ref == 1

    def discard(self, block_ids: Sequence[int]) -> list[int]:
        """``free``, except that a block left unreferenced loses its hash (emits ``blocks_removed``)
        and goes to the free queue: its KV is not to be trusted. Returns those blocks, for the
        caller to clear before anyone allocates them again."""
        dropped: list[BlockHash] = []
        unused: list[int] = []
        for block in reversed(block_ids):
            if self._unref(block):
                h = self._hash[block]
                if h is not None:
                    del self._by_hash[h]
                    self._hash[block] = None
                    dropped.append(h)
                self._free.append(block)
                unused.append(block)
        if dropped:
            self._sink.blocks_removed(dropped)
        return unused

    def reset_prefix_cache(self) -> int:
        """Forget every cached block that is not in use (emits ``blocks_removed``); returns how many."""
        dropped: list[BlockHash] = []
        while self._evictable:
            block, _ = self._evictable.popitem(last=False)
            h = self._hash[block]
            assert h is not None
            del self._by_hash[h]
            self._hash[block] = None
            self._free.append(block)
            dropped.append(h)
        if dropped:
            self._sink.blocks_removed(dropped)
        return len(dropped)
