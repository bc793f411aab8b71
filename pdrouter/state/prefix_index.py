"""The prefix index in Redis: which worker incarnation holds which chained block hashes.

Layout (every key carries the pool's hash tag, so each script touches one Cluster slot; see
``pdrouter/state/keys.py`` and docs/scale.md):

* ``pxslots`` — each live incarnation ``<worker_id>:<epoch>`` has a *slot*, a small integer given
  at its first write (the lowest freed one, else the next never used) and freed once its entries
  are all gone; the hash maps both ways and carries a version (``~ver``) that changes with every
  slot given or freed. Freed slots wait in ``pxfree``.
* ``pxb:<16 hash bytes>`` — per block, a bitmap of the slots holding it (``SETBIT`` offset = slot):
  ``ceil(slots / 8)`` bytes, 32 for 256 workers. The key is gone when its last bit is cleared.
* ``px:<worker_id>:<epoch>`` — the incarnation's own set of the hashes it holds: its size, and
  what to clear when it goes.
* ``pxlive`` — sorted set ``<worker_id>:<epoch>`` → liveness deadline (ms, Redis clock). Every
  write and every ``touch`` (each heartbeat) pushes it ``ttl_ms`` ahead.

Lookup is one script whose work follows the prompt, not the fleet: it reads the bitmaps of the
blocks it probes, bisecting the prompt for the blocks where the holders change, and returns the
bitmaps of the blocks just before each change (a few dozen bytes each, whatever the number of
holders); the client reads each holder's depth off them. Chained hashes make block ``i`` imply
the prompt's blocks before it, and a worker's cache evicts the tail of a sequence first, so the
holders of block ``i + 1`` are among those of block ``i``: a slot's depth is the deepest block
returned whose bitmap has it, exact at every change found. A miss is one ``GET``; a prompt the
whole fleet holds entirely is two, whatever the number of workers. Only slots holding block 1
are reported (a cache holding a block without the one before cannot serve the prompt). The
search stops after ``lookup_budget`` reads; the depths it has not found by then are returned as
lower bounds. The index is a placement hint: a worker's engine still matches its own cache exactly.

Slots to incarnations: the router keeps the slot table, read again (``HGETALL``) when a lookup
returns a newer version than the one it holds. Each slot records the version it was given at, so
a slot given after the lookup ran (its bits then were a former owner's) is left out, never
attributed to its new owner.

Fencing and expiry: the router passes the incarnations it considers live (the registry's worker
id and current epoch); entries of any other incarnation never match, whatever is still stored.
An incarnation that stops refreshing lapses after ``ttl_ms``; ``sweep`` (run by every worker's
publisher about once a second, and by anyone) removes the entries of lapsed incarnations in
batches, and ``clear`` removes one incarnation's at once (a worker stopping, a router seeing it
leave). A slot is only given again once its last bit is cleared, so a bit always belongs to the
slot's current incarnation. A write or touch that finds its incarnation lapsed or unknown (swept,
cleared, Redis restarted empty) says so, and the worker republishes everything it holds.

Every write script changes at most ``SCRIPT_BATCH`` (``DROP_BATCH`` when removing a whole
incarnation) entries, so none holds Redis for long.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

from redis.exceptions import NoScriptError

from pdrouter.core.aio import BackgroundTasks
from pdrouter.core.ids import BlockHash, Epoch, WorkerId
from pdrouter.state.client import RedisClient
from pdrouter.state.keys import PoolKeys
from pdrouter.state.pipelined import Framed, PipelinedRedis

HASH_BYTES = 16

SCRIPT_BATCH = 32
"""The most entries one write script adds or removes (a larger change is sent as several, pipelined)."""

DROP_BATCH = 16
"""The most entries one ``clear`` or ``sweep`` script removes (clearing a bit costs more than setting it)."""

LOOKUP_BUDGET = 32
"""The most block bitmaps one lookup reads (the script's own work per read is nearly all of a
lookup's cost inside Redis, so fewer reads make a lookup cheap and the search bisects; figures in
``docs/benchmarks.md``); past it the depths not yet found are returned as lower bounds. A
32k-token prompt held to three depths reads 23, whatever the number of holders; one held to 256
different depths (every worker of a 256-worker fleet at its own depth) reaches it, and its deepest
holders come back exact."""

_NOW = """
redis.replicate_commands()
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
"""

# Slot bookkeeping shared by the write scripts. A new slot table starts its version at the clock
# (µs), so a Redis that lost its data never hands out a version a router cached before.
_SLOTS = """
local function slot_of(slots, free, member)
  local s = redis.call('HGET', slots, member)
  if s then return tonumber(s) end
  if redis.call('HEXISTS', slots, '~ver') == 0 then
    redis.call('HSET', slots, '~ver', t[1] .. string.format('%06d', tonumber(t[2])))
  end
  local got = redis.call('ZPOPMIN', free)
  if #got > 0 then s = tonumber(got[1]) else s = redis.call('HINCRBY', slots, '~next', 1) - 1 end
  local ver = redis.call('HINCRBY', slots, '~ver', 1)
  redis.call('HSET', slots, member, s, '#' .. s, string.format('%.0f', ver) .. ':' .. member)
  return s
end
local function unset(key, slot)
  redis.call('SETBIT', key, slot, 0)
  if redis.call('BITCOUNT', key) == 0 then redis.call('DEL', key) end
end
"""

# KEYS: live, own set, slots, free. ARGV: member (incarnation), ttl ms, block key prefix, ops, hash size.
# ops: records of one byte ('+' stored, '-' removed) and the hash, applied in order (a run of
# stores: one variadic SADD on the own set, then one SETBIT per block; a removal clears the bit
# only if the own set held the hash).
# Returns 1 when the incarnation was known and live, 0 when it was new, lapsed or forgotten.
_APPLY = _NOW + _SLOTS + """
local member, ttl, pre, ops, hs = ARGV[1], tonumber(ARGV[2]), ARGV[3], ARGV[4], tonumber(ARGV[5])
local own = KEYS[2]
local deadline = redis.call('ZSCORE', KEYS[1], member)
local known = 1
if not deadline or tonumber(deadline) < now then known = 0 end
redis.call('ZADD', KEYS[1], now + ttl, member)
local slot = slot_of(KEYS[3], KEYS[4], member)
local run = {}
local function flush()
  if #run == 0 then return end
  redis.call('SADD', own, unpack(run))
  for _, h in ipairs(run) do redis.call('SETBIT', pre .. h, slot, 1) end
  run = {}
end
for i = 1, #ops, hs + 1 do
  local h = string.sub(ops, i + 1, i + hs)
  if string.byte(ops, i) == 43 then
    run[#run + 1] = h
  else
    flush()
    if redis.call('SREM', own, h) == 1 then unset(pre .. h, slot) end
  end
end
flush()
return known
"""

# KEYS: live. ARGV: member, ttl ms. 1: refreshed; 0: unknown or lapsed (nothing changed).
_TOUCH = _NOW + """
local deadline = redis.call('ZSCORE', KEYS[1], ARGV[1])
if not deadline or tonumber(deadline) < now then return 0 end
redis.call('ZADD', KEYS[1], now + tonumber(ARGV[2]), ARGV[1])
return 1
"""

# Removes up to `batch` entries of `member` (own set `own`); once none is left, forgets it and
# frees its slot (and drops the slot table when no incarnation is left). Returns {removed, 1 if done}.
_DROP = _SLOTS + """
local function drop(live, slots, free, member, own, pre, batch)
  local s = redis.call('HGET', slots, member)
  local hs = redis.call('SPOP', own, batch)
  if s then
    local slot = tonumber(s)
    for _, h in ipairs(hs) do unset(pre .. h, slot) end
  end
  if redis.call('EXISTS', own) == 1 then return {#hs, 0} end
  redis.call('ZREM', live, member)
  if s then
    redis.call('HDEL', slots, member, '#' .. s)
    redis.call('ZADD', free, s, s)
    redis.call('HINCRBY', slots, '~ver', 1)
  end
  if redis.call('ZCARD', live) == 0 then redis.call('DEL', slots, free) end
  return {#hs, 1}
end
"""

# KEYS: live, own set, slots, free. ARGV: member, block key prefix, batch.
_CLEAR = _NOW + _DROP + """
return drop(KEYS[1], KEYS[3], KEYS[4], ARGV[1], KEYS[2], ARGV[2], tonumber(ARGV[3]))
"""

# KEYS: live, slots, free. ARGV: own set key prefix, block key prefix, batch. Works on the first
# lapsed incarnation. Returns {entries removed, 1 if a lapsed one was found}.
_SWEEP = _NOW + _DROP + """
local dead = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', '(' .. now, 'LIMIT', 0, 1)
if #dead == 0 then return {0, 0} end
local res = drop(KEYS[1], KEYS[2], KEYS[3], dead[1], ARGV[1] .. dead[1], ARGV[2], tonumber(ARGV[3]))
return {res[1], 1}
"""

# KEYS[1]: slots (``#<slot>`` → ``<version given at>:<incarnation>``). ARGV: block key prefix, the
# prompt's hashes concatenated, hash size, budget (GETs).
# Returns {} (nobody holds block 1) or {version, 1, bitmap, i, bitmap, ...}: the slot table's
# version, then block numbers and their bitmaps (trailing zero bytes cut): block 1, the last block
# if anyone holds it, the block before each change of holders found, and the lower end of each
# interval the budget left unsearched. Bitmaps of one prompt nest (holders only drop), so two
# blocks have the same holders exactly when their cut bitmaps are equal.
_LOOKUP = """
local pre, blob, hs, budget = ARGV[1], ARGV[2], tonumber(ARGV[3]), tonumber(ARGV[4])
local n = math.floor(#blob / hs)
if n == 0 then return {} end
local maps, work = {}, 0
local function m(i)
  local v = maps[i]
  if v == nil then
    v = redis.call('GET', pre .. string.sub(blob, (i - 1) * hs + 1, i * hs))
    if v then
      local e = #v
      while e > 0 and string.byte(v, e) == 0 do e = e - 1 end
      v = string.sub(v, 1, e)
    else
      v = ''
    end
    maps[i] = v
    work = work + 1
  end
  return v
end
if m(1) == '' then return {} end
local out, sent = {redis.call('HGET', KEYS[1], '~ver') or '0'}, {}
local function emit(i)
  if not sent[i] and maps[i] ~= '' then
    sent[i] = true
    out[#out + 1] = i
    out[#out + 1] = maps[i]
  end
end
emit(1)
m(n)
emit(n)
-- Bisect [1, n] deepest first; an interval whose ends have equal bitmaps has no change inside.
local stack = {}
if maps[n] ~= maps[1] then stack[1] = {1, n} end
while #stack > 0 do
  local top = stack[#stack]
  local lo, hi = top[1], top[2]
  if hi - lo == 1 then
    emit(lo)
    stack[#stack] = nil
  else
    if work >= budget then break end
    stack[#stack] = nil
    local mid = math.floor((lo + hi) / 2)
    local v = m(mid)
    if v ~= maps[lo] then stack[#stack + 1] = {lo, mid} end
    if v ~= maps[hi] then stack[#stack + 1] = {mid, hi} end
  end
end
for _, iv in ipairs(stack) do emit(iv[1]) end
return out
"""

_REVERSED = bytes(int(f"{b:08b}"[::-1], 2) for b in range(256))


def slots_in(bitmap: bytes) -> int:
    """A Redis bitmap as an integer whose bit ``s`` is the bitmap's ``SETBIT`` offset ``s``."""
    return int.from_bytes(bitmap.translate(_REVERSED), "little")


def depths_of(found: Sequence[tuple[int, bytes]]) -> dict[int, int]:
    """Slot → leading blocks held, from a lookup's (block, bitmap) pairs: each slot holding the
    first block gets the deepest block whose bitmap has it."""
    if not found:
        return {}
    remaining = slots_in(found[0][1])  # the first block's holders: nobody else can serve the prompt
    depth: dict[int, int] = {}
    for blocks, bitmap in sorted(found, reverse=True):
        hit = remaining & slots_in(bitmap)
        if not hit:
            continue
        remaining &= ~hit
        while hit:
            low = hit & -hit
            depth[low.bit_length() - 1] = blocks
            hit ^= low
    return depth


@dataclass(frozen=True)
class PrefixMatch:
    """How many leading blocks of a prompt one worker holds."""

    worker_id: WorkerId
    epoch: Epoch
    blocks: int


Incarnation = tuple[WorkerId, Epoch]


class PrefixIndex:
    """One pool's prefix index. Safe to share between tasks of one event loop.

    ``ttl_ms``: how long an incarnation's entries stay live without a write or ``touch``; after it
    they are swept. ``lookup_budget``: see ``LOOKUP_BUDGET``. ``pipelined``: a connection to the
    same Redis that lookups go over (``pdrouter.state.pipelined``; None: the client's own path).
    """

    def __init__(self, client: RedisClient, pool: str, namespace: str = "pdr",
                 ttl_ms: int = 10_000, lookup_budget: int = LOOKUP_BUDGET,
                 pipelined: PipelinedRedis | None = None) -> None:
        self._r = client
        self._pipe = pipelined
        self._tasks = BackgroundTasks()  # lookups started early over the client's path
        self.keys = PoolKeys(namespace, pool)
        self.ttl_ms = ttl_ms
        self.lookup_budget = lookup_budget
        self._block_prefix = self.keys.prefix_block_prefix.encode()
        self._slot_keys = [self.keys.prefix_slots, self.keys.prefix_free]
        self._table: dict[int, tuple[int, Incarnation]] = {}  # slot → (version it was given at, owner)
        self._version = -1
        self._apply = client.register_script(_APPLY)
        self._touch = client.register_script(_TOUCH)
        self._clear = client.register_script(_CLEAR)
        self._sweep = client.register_script(_SWEEP)
        self._lookup = client.register_script(_LOOKUP)
        self._lookup_framed: tuple[tuple[str, int], Framed] | None = None  # the pipelined lookup, encoded

    @staticmethod
    def _member(worker_id: str, epoch: int) -> bytes:
        return PoolKeys.incarnation(worker_id, epoch).encode()

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
        # Each op is its sign and its hash: ``sign.join`` puts the sign before every hash of an event
        # in one call (a worker's flush carries a few hundred ops every 10 ms).
        ops = b"".join([(b"+" if stored else b"-").join((b"", *hashes)) for stored, hashes in events])
        keys = [self.keys.prefix_live, self.keys.prefix_set(worker_id, epoch), *self._slot_keys]
        head = [self._member(worker_id, epoch), self.ttl_ms, self._block_prefix]
        step = SCRIPT_BATCH * (1 + HASH_BYTES)
        calls = [[*keys, *head, ops[i:i + step], HASH_BYTES] for i in range(0, max(1, len(ops)), step)]
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
        keys = [self.keys.prefix_live, self.keys.prefix_set(worker_id, epoch), *self._slot_keys]
        args: list[bytes | int] = [self._member(worker_id, epoch), self._block_prefix, DROP_BATCH]
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
            got, found = await self._sweep(keys=[self.keys.prefix_live, *self._slot_keys], args=args)
            removed += int(got)
            if not int(found):
                break
        return removed

    async def size(self, worker_id: str, epoch: int) -> int:
        """Blocks the incarnation has in the index."""
        return int(await self._r.scard(self.keys.prefix_set(worker_id, epoch)))

    async def slot(self, worker_id: str, epoch: int) -> int | None:
        """The incarnation's slot, or None when it has none (never wrote, or forgotten)."""
        got = await self._r.hget(self.keys.prefix_slots, self._member(worker_id, epoch))
        return None if got is None else int(got)

    async def footprint(self, incarnations: Sequence[tuple[str, int]]) -> int:
        """Entries of ``incarnations`` anywhere in the index: members of their own sets, their liveness
        members, the slots still given to them and those slots' bits in the block bitmaps. Reads only;
        a SCAN of every block key (one Redis), so for audits, not for a hot path."""
        left = sum([int(await self._r.scard(self.keys.prefix_set(w, e))) for w, e in incarnations])
        names = [PoolKeys.incarnation(w, e) for w, e in incarnations]
        members = await self._r.zrange(self.keys.prefix_live, 0, -1)
        live = {m.decode() if isinstance(m, bytes) else str(m) for m in members}
        left += sum(1 for name in names if name in live)
        slots = [int(s) for s in await self._r.hmget(self.keys.prefix_slots, names) if s is not None]
        left += len(slots)
        cursor, match = 0, self._block_prefix + b"*"
        while slots:  # one pipeline of GETBITs per page of block keys
            cursor, page = await self._r.scan(cursor, match=match, count=1000)
            if page:
                async with self._r.pipeline(transaction=False) as pipe:
                    for key in page:
                        for slot in slots:
                            pipe.getbit(key, slot)
                    left += sum(int(x) for x in await pipe.execute())
            if not cursor:
                break
        return left

    async def holders(self, block_hash: bytes) -> set[Incarnation]:
        """The incarnations holding one block (reads the slot table afresh)."""
        bitmap = await self._r.get(self.keys.prefix_block(block_hash))
        if not bitmap:
            return set()
        await self._read_table()
        bits = slots_in(_raw(bitmap))
        return {owner for slot, (_, owner) in self._table.items() if bits >> slot & 1}

    # -- reader (router) --------------------------------------------------------------------
    async def lookup(self, hashes: Sequence[BlockHash],
                     workers: Sequence[tuple[WorkerId, Epoch]]) -> list[PrefixMatch]:
        """Per incarnation in ``workers``, the number of leading ``hashes`` it holds (one round trip,
        and one more when the slot table changed since the last lookup).

        Only these incarnations can match: an entry of another epoch of the same worker never does.
        """
        depth = await self._depths(hashes) if workers else {}
        return [PrefixMatch(w, e, depth.get((w, e), 0)) for w, e in workers]

    async def matched_blocks(self, hashes: Sequence[BlockHash],
                             workers: Sequence[tuple[WorkerId, Epoch]]) -> dict[WorkerId, int]:
        """``lookup`` for the hot path: worker id → blocks, for the incarnations of ``workers``
        (distinct worker ids) holding one block or more. Its Python work follows the holders of
        the prompt's first block, not the candidates."""
        depth = await self._depths(hashes) if workers else {}
        return _of_workers(depth, workers)

    def lookup_soon(self, hashes: Sequence[BlockHash]) -> PendingLookup:
        """Start looking ``hashes`` up now; the answer is awaited later (``PendingLookup.matched_blocks``).

        Over the pipelined connection the script is sent at once and costs no task; otherwise a task
        runs the client's call meanwhile. A lookup nobody awaits costs nothing more: its reply, or its
        failure, is dropped.
        """
        if not hashes:
            return PendingLookup(self, hashes, None)
        reply: asyncio.Future[Any] = self._send_lookup(hashes) if self._pipe is not None else \
            self._tasks.spawn(self._call_lookup(hashes))
        reply.add_done_callback(_retrieved)
        return PendingLookup(self, hashes, reply)

    async def _depths(self, hashes: Sequence[BlockHash]) -> dict[Incarnation, int]:
        """Incarnation → leading blocks held, for every incarnation holding block 1."""
        if not hashes:
            return {}
        if self._pipe is not None:
            flat = await self._reply(self._send_lookup(hashes), hashes)
        else:
            flat = await self._call_lookup(hashes)
        return await self._depths_of(flat)

    def _lookup_args(self, hashes: Sequence[BlockHash]) -> list[bytes | int]:
        """The lookup script's arguments; the hashes second (``_send_lookup`` frames the rest once)."""
        return [self._block_prefix, b"".join(hashes), HASH_BYTES, self.lookup_budget]

    async def _call_lookup(self, hashes: Sequence[BlockHash]) -> Any:
        return await self._lookup(keys=[self.keys.prefix_slots], args=self._lookup_args(hashes))

    def _send_lookup(self, hashes: Sequence[BlockHash]) -> asyncio.Future[Any]:
        assert self._pipe is not None
        sha, budget = self._lookup.sha, self.lookup_budget
        framed = self._lookup_framed
        if framed is None or framed[0] != (sha, budget):  # the first lookup, or its hash or budget changed
            head = ["EVALSHA", sha, 1, self.keys.prefix_slots]
            framed = self._lookup_framed = ((sha, budget), Framed([*head, *self._lookup_args([])], len(head) + 1))
        return self._pipe.send(framed[1].with_arg(b"".join(hashes)))

    async def _depths_of(self, flat: Any) -> dict[Incarnation, int]:
        """Incarnation → leading blocks held, from a lookup's reply ``flat``."""
        if flat and int(flat[0]) > self._version:
            await self._read_table()
        return self._depths_in(flat)

    def _depths_in(self, flat: Any) -> dict[Incarnation, int]:
        """``_depths_of`` when the slot table is as new as the reply (no read of it needed)."""
        if not flat:
            return {}
        version = int(flat[0])
        table = self._table
        found = [(int(flat[i]), _raw(flat[i + 1])) for i in range(1, len(flat), 2)]
        depth: dict[Incarnation, int] = {}
        for slot, blocks in depths_of(found).items():
            given = table.get(slot)
            if given is not None and given[0] <= version:  # a slot given since the lookup had other bits
                depth[given[1]] = blocks
        return depth

    async def _reply(self, reply: Awaitable[Any], hashes: Sequence[BlockHash]) -> Any:
        """A pipelined lookup's reply; sent again once when Redis had lost the script (it restarted)."""
        try:
            return await reply
        except NoScriptError:
            return await self._resend(hashes)

    async def _resend(self, hashes: Sequence[BlockHash]) -> Any:
        """A pipelined lookup again, the script loaded first (Redis had lost it: it restarted)."""
        assert self._pipe is not None
        await self._pipe.load(self._lookup)
        return await self._send_lookup(hashes)

    async def _read_table(self) -> None:
        """Read the slot table and its version (one ``HGETALL``: one consistent view)."""
        raw = await self._r.hgetall(self.keys.prefix_slots)
        table: dict[int, tuple[int, Incarnation]] = {}
        version = 0
        for field, value in raw.items():
            name = _raw(field)
            if name[:1] == b"#":
                given, _, incarnation = _raw(value).decode().partition(":")
                worker, _, epoch = incarnation.rpartition(":")
                table[int(name[1:])] = (int(given), (WorkerId(worker), Epoch(int(epoch))))
            elif name == b"~ver":
                version = int(value)
        self._table, self._version = table, version

    # -- helpers ----------------------------------------------------------------------------
    async def _run_batch(self, script: Any, num_keys: int, calls: list[list[Any]]) -> list[Any]:
        """Run ``script`` once per argument list (keys first), pipelined when more than one."""
        if self._pipe is not None:  # the writes are idempotent and in order: resent whole after a NOSCRIPT
            return await self._pipe.evalsha_all(script, num_keys, calls)
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


class PendingLookup:
    """A lookup started by ``PrefixIndex.lookup_soon``; await ``matched_blocks`` once for its answer."""

    __slots__ = ("_hashes", "_index", "_reply")

    def __init__(self, index: PrefixIndex, hashes: Sequence[BlockHash], reply: asyncio.Future[Any] | None) -> None:
        self._index = index
        self._hashes = hashes
        self._reply = reply

    async def matched_blocks(self, workers: Sequence[tuple[WorkerId, Epoch]]) -> dict[WorkerId, int]:
        """As ``PrefixIndex.matched_blocks``: worker id → blocks, for the incarnations of ``workers``
        holding one block or more. Raises what the lookup raised (``RedisError``, ``OSError``)."""
        if self._reply is None or not workers:
            return {}
        index = self._index
        # ``PrefixIndex._reply`` and ``_depths_of`` written out: no coroutine of their own per lookup.
        if index._pipe is not None:
            try:
                flat = await self._reply
            except NoScriptError:
                flat = await index._resend(self._hashes)
        else:  # the client's call runs on in its task: a cancelled caller does not cut it off mid-reply
            flat = await asyncio.shield(self._reply)
        if flat and int(flat[0]) > index._version:
            await index._read_table()
        return _of_workers(index._depths_in(flat), workers)


def _of_workers(depth: dict[Incarnation, int], workers: Sequence[tuple[WorkerId, Epoch]]) -> dict[WorkerId, int]:
    """The depths of the incarnations in ``workers``, by worker id."""
    if not depth:
        return {}
    wanted = dict(workers)
    return {w: blocks for (w, e), blocks in depth.items() if wanted.get(w) == e}


def _retrieved(reply: asyncio.Future[Any]) -> None:
    """A lookup's failure is its awaiter's to handle; one nobody awaits is dropped here, not logged."""
    if not reply.cancelled():
        reply.exception()


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
