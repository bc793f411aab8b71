"""The prefix index in Redis: which worker incarnation holds which chained block hashes.

Layout (every key carries the pool's hash tag, so each script touches one Cluster slot; see
``pdrouter/state/keys.py`` and docs/scale.md):

* ``pxb:<16 hash bytes>`` — per block, the set of the *member ids* of the incarnations holding it.
  A member id is a 62-bit integer hashed from the incarnation's name ``<worker_id>:<epoch>``
  (``member_id``), so these sets are Redis intsets (8 bytes per holder) and anyone can compute
  the id of an incarnation without asking Redis.
* ``px:<worker_id>:<epoch>`` — the incarnation's own set of the hashes it holds: its size, and
  what to remove when it goes.
* ``pxlive`` — sorted set ``<member id>:<worker_id>:<epoch>`` → liveness deadline (ms, Redis
  clock). Every write and every ``touch`` (each heartbeat) pushes it ``ttl_ms`` ahead.

Lookup is one script whose work follows the prompt, not the fleet: ``SCARD`` of the per-block
sets, bisecting the prompt for the blocks where the number of holders drops, then per drop one
``SDIFF`` naming the members that stop there. A miss is one ``SCARD``; a prompt the whole fleet
holds entirely is two and one set read, whatever the number of workers. Chained hashes make
block ``i`` imply the prompt's blocks before it, and a worker's cache evicts the tail of a
sequence first, so the holders of block ``i + 1`` are (almost always) among those of block ``i``
and the drops are exact. A member holding a block without the one before shows up as holder
counts that do not add up; then only the members holding block 1 are reported. The search stops
after ``lookup_budget`` work; the depths it has not found by then are returned as lower bounds.
The index is a placement hint: a worker's engine still matches its own cache exactly.

Fencing and expiry: the router passes the incarnations it considers live (the registry's worker
id and current epoch); entries of any other incarnation never match, whatever is still stored.
An incarnation that stops refreshing lapses after ``ttl_ms``; ``sweep`` (run by every worker's
publisher about once a second, and by anyone) removes the entries of lapsed incarnations in
batches, and ``clear`` removes one incarnation's at once (a worker stopping, a router seeing it
leave). A write or touch that finds its incarnation lapsed or unknown (swept, cleared, Redis
restarted empty) says so, and the worker republishes everything it holds.

Every write script changes at most ``SCRIPT_BATCH`` (``DROP_BATCH`` when removing a whole
incarnation) entries, so none holds Redis for long.
Needs Redis 6.2 or later (``SMISMEMBER``).
"""

from __future__ import annotations

import hashlib
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

from redis.exceptions import NoScriptError

from pdrouter.core.ids import BlockHash, Epoch, WorkerId
from pdrouter.state.client import RedisClient
from pdrouter.state.keys import PoolKeys

HASH_BYTES = 16

SCRIPT_BATCH = 64
"""The most entries one write script adds or removes (a larger change is sent as several, pipelined)."""

DROP_BATCH = 32
"""The most entries one ``clear`` or ``sweep`` script removes (popping from a set costs more than adding)."""

LOOKUP_BUDGET = 2048
"""The most work one lookup's search does, in set elements touched plus 16 per command (an ``SCARD``
costs 16, an ``SDIFF`` 16 and the size of the set it reads); past it the depths not yet found are
returned as lower bounds. A 32k-token prompt 256 workers hold to three depths costs about 700; one
held to 16 different depths, evenly spread, reaches it (the 2 shallowest come back as lower bounds)."""

_ID_CACHE = 65_536

_NOW = """
redis.replicate_commands()
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
"""

# KEYS: live, own set. ARGV: live member, member id, ttl ms, block key prefix, ops, hash size.
# ops: records of one byte ('+' stored, '-' removed) and the hash, applied in order (a run of one
# kind: one variadic SADD/SREM on the own set, then one call per block key).
# Returns 1 when the incarnation was known and live, 0 when it was new, lapsed or forgotten.
_APPLY = _NOW + """
local member, id, ttl, pre, ops, hs = ARGV[1], ARGV[2], tonumber(ARGV[3]), ARGV[4], ARGV[5], tonumber(ARGV[6])
local own = KEYS[2]
local deadline = redis.call('ZSCORE', KEYS[1], member)
local known = 1
if not deadline or tonumber(deadline) < now then known = 0 end
redis.call('ZADD', KEYS[1], now + ttl, member)
local run, kind = {}, nil
local function flush()
  if #run == 0 then return end
  local op = (kind == 43) and 'SADD' or 'SREM'
  redis.call(op, own, unpack(run))
  for _, h in ipairs(run) do redis.call(op, pre .. h, id) end
  run = {}
end
for i = 1, #ops, hs + 1 do
  local k = string.byte(ops, i)
  if k ~= kind then
    flush()
    kind = k
  end
  run[#run + 1] = string.sub(ops, i + 1, i + hs)
end
flush()
return known
"""

# KEYS: live. ARGV: live member, ttl ms. 1: refreshed; 0: unknown or lapsed (nothing changed).
_TOUCH = _NOW + """
local deadline = redis.call('ZSCORE', KEYS[1], ARGV[1])
if not deadline or tonumber(deadline) < now then return 0 end
redis.call('ZADD', KEYS[1], now + tonumber(ARGV[2]), ARGV[1])
return 1
"""

# Removes up to `batch` entries of the live member `member` (id `id`, own set `own`); forgets it
# when none is left. Returns {entries removed, 1 if done}.
_DROP = """
local function drop(live, member, id, own, pre, batch)
  local hs = redis.call('SPOP', own, batch)
  for _, h in ipairs(hs) do redis.call('SREM', pre .. h, id) end
  if redis.call('EXISTS', own) == 1 then return {#hs, 0} end
  redis.call('ZREM', live, member)
  return {#hs, 1}
end
"""

# KEYS: live, own set. ARGV: live member, member id, block key prefix, batch.
_CLEAR = "redis.replicate_commands()\n" + _DROP + """
return drop(KEYS[1], ARGV[1], ARGV[2], KEYS[2], ARGV[3], tonumber(ARGV[4]))
"""

# KEYS: live. ARGV: own set key prefix, block key prefix, batch. Works on the first lapsed
# incarnation. Returns {entries removed, 1 if a lapsed one was found}.
_SWEEP = _NOW + _DROP + """
local dead = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', '(' .. now, 'LIMIT', 0, 1)
if #dead == 0 then return {0, 0} end
local member = dead[1]
local sep = string.find(member, ':', 1, true)
local res = drop(KEYS[1], member, string.sub(member, 1, sep - 1), ARGV[1] .. string.sub(member, sep + 1),
                 ARGV[2], tonumber(ARGV[3]))
return {res[1], 1}
"""

# KEYS[1]: live (unused: it routes the call to the pool's slot). ARGV: block key prefix, the
# prompt's hashes concatenated, hash size, work budget. Returns {blocks, "id,id,...", ...}: the
# members holding the prompt's first block grouped by how many leading blocks they hold, deepest
# first (a member listed twice, which only a cache holding a block without the one before can
# cause, holds the smaller number). Work is counted in set elements touched plus CALL per command
# (an SCARD costs CALL, an SDIFF CALL and the size of its first set).
_LOOKUP = """
local pre, blob, hs, budget = ARGV[1], ARGV[2], tonumber(ARGV[3]), tonumber(ARGV[4])
local CALL = 16
local n = math.floor(#blob / hs)
local keys, card, work = {}, {}, 0
local function key(i)
  local k = keys[i]
  if not k then
    k = pre .. string.sub(blob, (i - 1) * hs + 1, i * hs)
    keys[i] = k
  end
  return k
end
local function c(i)
  local v = card[i]
  if not v then
    v = redis.call('SCARD', key(i))
    card[i] = v
    work = work + CALL
  end
  return v
end
if n == 0 or c(1) == 0 then return {} end
local groups, named, regular = {}, 0, true
local function settle(ids, blocks)
  if #ids > 0 then
    groups[#groups + 1] = {blocks, ids}
    named = named + #ids
  end
end
if c(n) > 0 then settle(redis.call('SMEMBERS', key(n)), n) end
-- Bisect [1, n] for the blocks whose holders are not those of the next block probed, deepest
-- first; each drop is named by one SDIFF (the members that stop there).
local stack = {}
if c(n) ~= c(1) then stack[1] = {1, n} end
while #stack > 0 do
  local top = stack[#stack]
  local lo, hi = top[1], top[2]
  if hi - lo == 1 then
    if work + CALL + card[lo] > budget then break end
    work = work + CALL + card[lo]
    local gone = redis.call('SDIFF', key(lo), key(hi))
    if #gone ~= card[lo] - card[hi] then regular = false end
    settle(gone, lo)
    stack[#stack] = nil
  else
    if work >= budget then break end
    stack[#stack] = nil
    local mid = math.floor((lo + hi) / 2)
    local cm = c(mid)
    if cm ~= card[lo] then stack[#stack + 1] = {lo, mid} end
    if cm ~= card[hi] then stack[#stack + 1] = {mid, hi} end
  end
end
if #stack > 0 then
  -- Out of budget. The search went deepest first, so everything above the top open interval is
  -- done: the members not named yet are those of block 1 without its upper end, and each stops
  -- inside an open interval, so holds at least the blocks up to the lowest one.
  local floor = n
  for _, iv in ipairs(stack) do
    if iv[1] < floor then floor = iv[1] end
  end
  settle(redis.call('SDIFF', key(1), key(stack[#stack][2])), floor)
end
if named ~= card[1] then regular = false end
local out = {}
for _, g in ipairs(groups) do
  local ids = g[2]
  if not regular then
    -- Holders of a block without the one before (not a chain's tail evicted first): keep only
    -- the members holding block 1.
    local kept = {}
    for s = 1, #ids, 1024 do
      local part = {unpack(ids, s, math.min(s + 1023, #ids))}
      local held = redis.call('SMISMEMBER', key(1), unpack(part))
      for j = 1, #part do
        if held[j] == 1 then kept[#kept + 1] = part[j] end
      end
    end
    ids = kept
  end
  if #ids > 0 then
    out[#out + 1] = g[1]
    out[#out + 1] = table.concat(ids, ',')
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


def member_id(worker_id: str, epoch: int) -> int:
    """The incarnation's member id in the per-block sets: 62 bits of a hash of ``<worker_id>:<epoch>``.

    Two incarnations sharing one (odds ~n²/2⁶³ for n incarnations alive at once) would see each
    other's entries as their own: a placement hint gone wrong, never a wrong answer.
    """
    digest = hashlib.blake2b(PoolKeys.incarnation(worker_id, epoch).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 2


class PrefixIndex:
    """One pool's prefix index. Safe to share between tasks of one event loop.

    ``ttl_ms``: how long an incarnation's entries stay live without a write or ``touch``; after it
    they are swept. ``lookup_budget``: see ``LOOKUP_BUDGET``.
    """

    def __init__(self, client: RedisClient, pool: str, namespace: str = "pdr",
                 ttl_ms: int = 10_000, lookup_budget: int = LOOKUP_BUDGET) -> None:
        self._r = client
        self.keys = PoolKeys(namespace, pool)
        self.ttl_ms = ttl_ms
        self.lookup_budget = lookup_budget
        self._block_prefix = self.keys.prefix_block_prefix.encode()
        self._ids: dict[tuple[str, int], bytes] = {}
        self._owners: dict[bytes, tuple[WorkerId, Epoch]] = {}
        self._known: dict[WorkerId, Epoch] = {}  # candidates whose member ids are all in _owners
        self._apply = client.register_script(_APPLY)
        self._touch = client.register_script(_TOUCH)
        self._clear = client.register_script(_CLEAR)
        self._sweep = client.register_script(_SWEEP)
        self._lookup = client.register_script(_LOOKUP)

    def _id(self, worker_id: str, epoch: int) -> bytes:
        """``member_id`` as Redis returns it (decimal bytes), cached both ways."""
        got = self._ids.get((worker_id, epoch))
        if got is None:
            if len(self._ids) >= _ID_CACHE:
                self._forget_ids()
            got = self._ids[(worker_id, epoch)] = str(member_id(worker_id, epoch)).encode()
            self._owners[got] = (WorkerId(worker_id), Epoch(epoch))
        return got

    def _forget_ids(self) -> None:
        self._ids.clear()
        self._owners.clear()
        self._known = {}

    def _member(self, worker_id: str, epoch: int) -> bytes:
        """The incarnation's member of the liveness set: ``<member id>:<worker_id>:<epoch>``."""
        return self._id(worker_id, epoch) + b":" + self.keys.incarnation(worker_id, epoch).encode()

    # -- writers (workers) ------------------------------------------------------------------
    async def add(self, worker_id: str, epoch: int, hashes: Sequence[bytes]) -> None:
        if hashes:
            await self.apply(worker_id, epoch, [(True, hashes)])

    async def remove(self, worker_id: str, epoch: int, hashes: Sequence[bytes]) -> None:
        if hashes:
            await self.apply(worker_id, epoch, [(False, hashes)])

    async def apply(self, worker_id: str, epoch: int,
                    events: Sequence[tuple[bool, Sequence[bytes]]]) -> bool:
        """Apply ordered (stored?, hashes) events and refresh the incarnation's liveness (one round trip).

        Returns False when the incarnation was not known and live before (its first write, or its
        entries were swept, cleared or lost with Redis): the caller should republish all it holds.
        Large changes go as several scripts of ``SCRIPT_BATCH`` entries, in order, pipelined.
        """
        ops = [(b"+" if stored else b"-") + h for stored, hashes in events for h in hashes]
        keys = [self.keys.prefix_live, self.keys.prefix_set(worker_id, epoch)]
        head = [self._member(worker_id, epoch), self._id(worker_id, epoch), self.ttl_ms, self._block_prefix]
        calls = [[*keys, *head, b"".join(ops[i:i + SCRIPT_BATCH]), HASH_BYTES]
                 for i in range(0, max(1, len(ops)), SCRIPT_BATCH)]
        results = await self._run_batch(self._apply, len(keys), calls)
        return bool(int(results[0]))

    async def touch(self, worker_id: str, epoch: int) -> bool:
        """Keep the incarnation's entries live for another TTL (called with every heartbeat).

        False when there is nothing to refresh: the incarnation is unknown or already lapsed (its
        entries may be partly swept); it stays so until its publisher writes again.
        """
        res = await self._touch(keys=[self.keys.prefix_live], args=[self._member(worker_id, epoch), self.ttl_ms])
        return bool(int(res))

    async def clear(self, worker_id: str, epoch: int) -> int:
        """Remove every entry of one incarnation and forget it; the number of entries removed."""
        keys = [self.keys.prefix_live, self.keys.prefix_set(worker_id, epoch)]
        args: list[bytes | int] = [self._member(worker_id, epoch), self._id(worker_id, epoch), self._block_prefix,
                                   DROP_BATCH]
        removed = 0
        while True:
            got, done = await self._clear(keys=keys, args=args)
            removed += int(got)
            if int(done):
                return removed

    async def sweep(self, max_calls: int = 64) -> int:
        """Remove entries of lapsed incarnations, at most ``max_calls`` scripts of ``DROP_BATCH``
        entries; the number of entries removed. Any process may call it, concurrently too."""
        args: list[str | bytes | int] = [self.keys.prefix_set_prefix, self._block_prefix, DROP_BATCH]
        removed = 0
        for _ in range(max_calls):
            got, found = await self._sweep(keys=[self.keys.prefix_live], args=args)
            removed += int(got)
            if not int(found):
                break
        return removed

    async def size(self, worker_id: str, epoch: int) -> int:
        """Blocks the incarnation has in the index."""
        return int(await self._r.scard(self.keys.prefix_set(worker_id, epoch)))

    # -- reader (router) --------------------------------------------------------------------
    async def lookup(self, hashes: Sequence[BlockHash],
                     workers: Sequence[tuple[WorkerId, Epoch]]) -> list[PrefixMatch]:
        """Per incarnation in ``workers``, the number of leading ``hashes`` it holds (one round trip).

        Only these incarnations can match: an entry of another epoch of the same worker never does.
        """
        depth = await self._depths(hashes) if workers else {}
        ids = self._id
        return [PrefixMatch(w, e, depth.get(ids(w, e), 0)) for w, e in workers]

    async def matched_blocks(self, hashes: Sequence[BlockHash],
                             workers: Sequence[tuple[WorkerId, Epoch]]) -> dict[WorkerId, int]:
        """``lookup`` for the hot path: worker id → blocks, for the incarnations of ``workers``
        (distinct worker ids) holding one block or more. Its Python work per worker holding
        nothing is one dict insertion (and, for a candidate list not seen before, one hash)."""
        depth = await self._depths(hashes) if workers else {}
        if not depth:
            return {}
        wanted = dict(workers)
        if wanted != self._known:  # a candidate list not seen before: learn its member ids
            if len(self._ids) + len(wanted) > _ID_CACHE:
                self._forget_ids()
            for w, e in wanted.items():
                self._id(w, e)
            self._known = wanted
        owners = self._owners
        held: dict[WorkerId, int] = {}
        for mid, blocks in depth.items():
            owner = owners.get(mid)
            if owner is not None and wanted.get(owner[0]) == owner[1]:
                held[owner[0]] = blocks
        return held

    async def _depths(self, hashes: Sequence[BlockHash]) -> dict[bytes, int]:
        """Member id (as Redis returns it) → leading blocks held, for every member holding block 1."""
        if not hashes:
            return {}
        flat = await self._lookup(keys=[self.keys.prefix_live],
                                  args=[self._block_prefix, b"".join(hashes), HASH_BYTES, self.lookup_budget])
        depth: dict[bytes, int] = {}
        for i in range(0, len(flat), 2):  # deepest first: a member listed again keeps the smaller depth
            depth.update(dict.fromkeys(_raw(flat[i + 1]).split(b","), int(flat[i])))
        return depth

    # -- helpers ----------------------------------------------------------------------------
    async def _run_batch(self, script: Any, num_keys: int, calls: list[list[Any]]) -> list[Any]:
        """Run ``script`` once per argument list (keys first), pipelined when more than one."""
        if len(calls) == 1:
            return [await script(keys=calls[0][:num_keys], args=calls[0][num_keys:])]

        async def send() -> list[Any]:
            # The raw EVALSHA: redis-py's cluster pipeline blocks its ``evalsha`` method, but routes
            # the command itself by its keys (all in the pool's slot, so one node, in order).
            async with self._r.pipeline(transaction=False) as pipe:
                for call in calls:
                    pipe.execute_command("EVALSHA", script.sha, num_keys, *call)
                return list(await pipe.execute())

        return await _loading(self._r, script, send)


async def _loading(client: RedisClient, script: Any, send: Callable[[], Awaitable[list[Any]]]) -> list[Any]:
    """``send()``; when Redis lost the script (it restarted), load it and send again (the writes are
    idempotent and in order, so resending a partly applied batch leaves the same state)."""
    try:
        return await send()
    except NoScriptError:
        script.sha = await client.script_load(script.script)
        return await send()


def _raw(value: bytes | str) -> bytes:
    return value if isinstance(value, bytes) else value.encode()
