"""The prefix index in Redis: which worker holds which chained block hashes.

Layout: one Redis set per worker incarnation, ``pdr:{pool}:px:<worker_id>:<epoch>``, holding the
16-byte hashes of the blocks in that worker's prefix cache. Workers add and remove members as
their block manager stores and evicts blocks, and refresh the set's TTL with every heartbeat; a
worker that dies stops refreshing and its set expires. A restarted worker has a new epoch and so a
new set: its old entries can never match again.

Lookup is one script call: for each worker it asks whether block 0 is present (a miss costs one
probe per worker, whatever the prompt length), then binary-searches for the longest present
prefix. Chained hashes make a hit on block ``i`` imply the prompt matches up to ``i``; a worker's
own cache evicts a sequence tail first, so presence is (almost) monotone and the search exact in
practice. The index is a placement hint: the worker's engine still matches its cache exactly.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import redis.asyncio as aioredis

from pdrouter.core.ids import BlockHash, Epoch, WorkerId
from pdrouter.state.keys import PoolKeys

HASH_BYTES = 16

# KEYS: one prefix set per worker. ARGV[1]: the prompt's block hashes concatenated; ARGV[2]: hash size.
# Returns, per worker, how many leading blocks it holds.
_LOOKUP = """
local blob = ARGV[1]
local hs = tonumber(ARGV[2])
local n = math.floor(#blob / hs)
local out = {}
for w = 1, #KEYS do
  local key = KEYS[w]
  if n == 0 or redis.call('SISMEMBER', key, string.sub(blob, 1, hs)) == 0 then
    out[w] = 0
  else
    local lo, hi = 1, n
    while lo < hi do
      local mid = math.floor((lo + hi + 1) / 2)
      if redis.call('SISMEMBER', key, string.sub(blob, (mid - 1) * hs + 1, mid * hs)) == 1 then
        lo = mid
      else
        hi = mid - 1
      end
    end
    out[w] = lo
  end
end
return out
"""


@dataclass(frozen=True)
class PrefixMatch:
    """How many leading blocks of a prompt one worker holds."""

    worker_id: WorkerId
    epoch: Epoch
    blocks: int


class PrefixIndex:
    """One pool's prefix index."""

    def __init__(self, client: aioredis.Redis, pool: str, namespace: str = "pdr",
                 ttl_ms: int = 10_000) -> None:
        self._r = client
        self.keys = PoolKeys(namespace, pool)
        self.ttl_ms = ttl_ms
        self._lookup = client.register_script(_LOOKUP)

    # -- writers (workers) ------------------------------------------------------------------
    async def add(self, worker_id: str, epoch: int, hashes: Sequence[bytes]) -> None:
        if not hashes:
            return
        key = self.keys.prefix_set(worker_id, epoch)
        async with self._r.pipeline(transaction=False) as pipe:
            pipe.sadd(key, *hashes)
            pipe.pexpire(key, self.ttl_ms)
            await pipe.execute()

    async def remove(self, worker_id: str, epoch: int, hashes: Sequence[bytes]) -> None:
        if hashes:
            await self._r.srem(self.keys.prefix_set(worker_id, epoch), *hashes)

    async def apply(self, worker_id: str, epoch: int,
                    events: Sequence[tuple[bool, Sequence[bytes]]]) -> None:
        """Apply ordered (stored?, hashes) events in one pipeline and refresh the TTL."""
        key = self.keys.prefix_set(worker_id, epoch)
        async with self._r.pipeline(transaction=False) as pipe:
            for stored, hashes in events:
                if hashes:
                    (pipe.sadd if stored else pipe.srem)(key, *hashes)
            pipe.pexpire(key, self.ttl_ms)
            await pipe.execute()

    async def touch(self, worker_id: str, epoch: int) -> None:
        """Keep the worker's entries alive for another TTL (called with every heartbeat)."""
        await self._r.pexpire(self.keys.prefix_set(worker_id, epoch), self.ttl_ms)

    async def clear(self, worker_id: str, epoch: int) -> None:
        await self._r.delete(self.keys.prefix_set(worker_id, epoch))

    async def size(self, worker_id: str, epoch: int) -> int:
        return int(await self._r.scard(self.keys.prefix_set(worker_id, epoch)))

    # -- reader (router) --------------------------------------------------------------------
    async def lookup(self, hashes: Sequence[BlockHash],
                     workers: Sequence[tuple[WorkerId, Epoch]]) -> list[PrefixMatch]:
        """Per worker, the number of leading ``hashes`` it holds (one round trip)."""
        if not workers:
            return []
        if not hashes:
            return [PrefixMatch(w, e, 0) for w, e in workers]
        keys = [self.keys.prefix_set(w, e) for w, e in workers]
        counts = await self._lookup(keys=keys, args=[b"".join(hashes), HASH_BYTES])
        return [PrefixMatch(w, e, int(c)) for (w, e), c in zip(workers, counts, strict=True)]
