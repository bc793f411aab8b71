"""KV reservations in Redis: book decode blocks before any work starts, shared by every router.

Per decode worker incarnation ``(worker_id, epoch)`` three keys (all of a pool's bookings share one
hash tag, on a Redis Cluster one of their own: ``PoolKeys.bookings_tag``):
``kv:book`` (booking → blocks), ``kv:lease`` (booking → expiry, ms on the Redis clock) and
``kv:used`` (their sum). ``reserve`` is one script: it first drops expired leases on every
candidate, then picks a worker with room for the request (``most_free`` or ``best_fit``) and
books it, atomically, so routers sharing one Redis can never book more than a worker has. A
crashed router's bookings expire with their leases; a restarted worker has a new epoch and so
fresh, empty keys (its old bookings are never counted again and expire on their own).

A booking is keyed by a :data:`BookingId` its router assigns, unique to one admission: never by
the client's request id, which two requests may share. Every call that books or renews a lease
also extends the three keys' TTL to :func:`key_ttl_ms` (only ever extends it), so the keys of a
worker whose bookings are all long-running stay alive as long as those leases are renewed.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
from collections.abc import Coroutine, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple, NewType

from pdrouter.core.aio import BackgroundTasks
from pdrouter.core.errors import CapacityError, InvalidRequestError, RequestTooLargeError
from pdrouter.core.ids import Epoch, WorkerId
from pdrouter.state.client import RedisClient, is_cluster_client
from pdrouter.state.coalesce import Coalescer
from pdrouter.state.keys import PoolKeys
from pdrouter.state.pipelined import PipelinedRedis

BookingId = NewType("BookingId", str)
"""The ledger's key for one booking: assigned by the router that books it, unique to one admission
(a request's booking or a credit chunk). A client's request id is never one."""


def key_ttl_ms(lease_ms: int) -> int:
    """The TTL a booking or renewal gives a worker's three keys: four leases and a minute.

    Keys outlive every lease in them, and go once nobody has booked or renewed there for that long.
    """
    return lease_ms * 4 + 60_000


class PickPolicy(enum.Enum):
    MOST_FREE = "most_free"
    """The worker with the most free blocks (spreads load)."""
    BEST_FIT = "best_fit"
    """The worker whose free blocks exceed the request by the least (packs, keeps big holes)."""


@dataclass(frozen=True)
class DecodeCapacity:
    """A candidate decode worker and how many blocks it may have booked in all."""

    worker_id: WorkerId
    epoch: Epoch
    capacity_blocks: int


@dataclass(frozen=True)
class Reservation:
    """Blocks booked for one request (or one credit chunk) on one decode worker, until released
    or the lease expires."""

    booking_id: BookingId
    """The ledger's key (router-assigned, see :data:`BookingId`)."""
    worker_id: WorkerId
    epoch: Epoch
    blocks: int
    lease_ms: int


# One script for every change of bookings, so that a batch of releases can ride along with the
# next batch of reservations. KEYS: per worker 3 keys (book, lease, used). ARGV: lease_ms, policy,
# the number of candidates C, C pairs (worker index, capacity), the number of resizes R, R triples
# (worker index, booking id, new blocks; 0 = release), then per reservation its booking id and blocks.
# Resizes go first (their blocks are free for the reservations), then expired leases are dropped
# on the candidates, then the reservations are booked in order. Reply: per resize the blocks given
# back; per reservation {candidate index, used_after, 1 if it was booked already} or {0, max_free, 0}.
_ADMIT = """
redis.replicate_commands()
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local lease, policy, n = tonumber(ARGV[1]), ARGV[2], tonumber(ARGV[3])
local out = {}
local nres = tonumber(ARGV[4 + 2*n])
local first_resize = 5 + 2*n
for j = first_resize, first_resize + 3*nres - 1, 3 do
  local w, rid, new = tonumber(ARGV[j]), ARGV[j + 1], tonumber(ARGV[j + 2])
  local book = KEYS[3*w-2]
  local b = redis.call('HGET', book, rid)
  local freed = 0
  if b and new < tonumber(b) then
    freed = tonumber(b) - new
    if new == 0 then
      redis.call('HDEL', book, rid)
      redis.call('ZREM', KEYS[3*w-1], rid)
    else
      redis.call('HSET', book, rid, new)
    end
    redis.call('DECRBY', KEYS[3*w], freed)
  end
  out[#out+1] = freed
end
local first_reserve = first_resize + 3*nres
if first_reserve > #ARGV then return out end
local cap, used, wk = {}, {}, {}
for i = 1, n do
  local w = tonumber(ARGV[2 + 2*i])
  wk[i] = w
  cap[i] = tonumber(ARGV[3 + 2*i])
  local book, leases = KEYS[3*w-2], KEYS[3*w-1]
  for _, r in ipairs(redis.call('ZRANGEBYSCORE', leases, '-inf', now)) do
    local b = redis.call('HGET', book, r)
    if b then
      redis.call('DECRBY', KEYS[3*w], tonumber(b))
      redis.call('HDEL', book, r)
    end
    redis.call('ZREM', leases, r)
  end
  used[i] = tonumber(redis.call('GET', KEYS[3*w]) or '0')
end
local touched = {}
for j = first_reserve, #ARGV, 2 do
  local rid, need = ARGV[j], tonumber(ARGV[j + 1])
  local found = 0
  for i = 1, n do
    if redis.call('HEXISTS', KEYS[3*wk[i]-2], rid) == 1 then found = i break end
  end
  if found > 0 then
    redis.call('ZADD', KEYS[3*wk[found]-1], now + lease, rid)
    touched[wk[found]] = true
    out[#out+1] = found; out[#out+1] = used[found]; out[#out+1] = 1
  else
    local best, best_score, max_free = 0, nil, -1
    for i = 1, n do
      local free = cap[i] - used[i]
      if free > max_free then max_free = free end
      if free >= need then
        local score
        if policy == 'best_fit' then score = free - need else score = -free end
        if best_score == nil or score < best_score then best, best_score = i, score end
      end
    end
    if best == 0 then
      out[#out+1] = 0; out[#out+1] = max_free; out[#out+1] = 0
    else
      local w = wk[best]
      redis.call('HSET', KEYS[3*w-2], rid, need)
      redis.call('ZADD', KEYS[3*w-1], now + lease, rid)
      used[best] = redis.call('INCRBY', KEYS[3*w], need)
      touched[w] = true
      out[#out+1] = best; out[#out+1] = used[best]; out[#out+1] = 0
    end
  end
end
local ttl = lease * 4 + 60000
for w, _ in pairs(touched) do
  for k = 3*w-2, 3*w do
    local left = redis.call('PTTL', KEYS[k])
    if left ~= -2 and left < ttl then redis.call('PEXPIRE', KEYS[k], ttl) end
  end
end
return out
"""

# KEYS: book, lease, used. ARGV: booking id, lease_ms. Extends a lease (1) or says it is gone (0);
# a renewed lease extends the three keys' TTL (key_ttl_ms) too, so they outlive it.
_RENEW = """
redis.replicate_commands()
if not redis.call('HGET', KEYS[1], ARGV[1]) then return 0 end
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local lease = tonumber(ARGV[2])
redis.call('ZADD', KEYS[2], now + lease, ARGV[1])
local ttl = lease * 4 + 60000
for k = 1, 3 do
  local left = redis.call('PTTL', KEYS[k])
  if left ~= -2 and left < ttl then redis.call('PEXPIRE', KEYS[k], ttl) end
end
return 1
"""


# KEYS: book, lease, used. Drops expired leases; returns the blocks still booked.
_PURGE = """
redis.replicate_commands()
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
for _, r in ipairs(redis.call('ZRANGEBYSCORE', KEYS[2], '-inf', now)) do
  local b = redis.call('HGET', KEYS[1], r)
  if b then
    redis.call('DECRBY', KEYS[3], tonumber(b))
    redis.call('HDEL', KEYS[1], r)
  end
  redis.call('ZREM', KEYS[2], r)
end
return tonumber(redis.call('GET', KEYS[3]) or '0')
"""


class BookingHoldings(NamedTuple):
    """One incarnation's booking keys as Redis holds them."""

    entries: int
    """Bookings in its hash."""
    leases: int
    """Leases in its lease set."""
    blocks: int
    """Blocks its used counter says are booked."""


def _retrieve(fut: asyncio.Future[Any]) -> None:
    if not fut.cancelled():
        fut.exception()


class KvReservations:
    """Admission bookings for one pool's decode workers.

    Booking changes travel in batches, one script call each: concurrent ``reserve`` calls with the
    same candidates are coalesced (:class:`~pdrouter.state.coalesce.Coalescer`), and ``shrink`` /
    ``release`` wait up to ``resize_delay_s`` to ride along with the next batch of reservations
    (``urgent=True`` sends at once). A router under load pays one Redis round trip per batch
    instead of two per request.
    """

    def __init__(self, client: RedisClient, pool: str, namespace: str = "pdr",
                 policy: PickPolicy = PickPolicy.MOST_FREE, resize_delay_s: float = 0.002,
                 bookings_apart: bool | None = None, pipelined: PipelinedRedis | None = None) -> None:
        """``bookings_apart``: the bookings under a hash tag of their own (``PoolKeys.bookings_tag``);
        by default on a Redis Cluster (so they may live on another shard than the rest of the pool),
        not on one Redis (where the names stay those every version uses). ``pipelined``: a connection
        to the same Redis that the booking script goes over (``pdrouter.state.pipelined``; None: the
        client's own path)."""
        self._r = client
        self._pipe = pipelined
        apart = is_cluster_client(client) if bookings_apart is None else bookings_apart
        self.keys = PoolKeys(namespace, pool, bookings_apart=apart)
        self.policy = policy
        self.resize_delay_s = resize_delay_s
        self._admit = client.register_script(_ADMIT)
        self._renew = client.register_script(_RENEW)
        self._purge = client.register_script(_PURGE)
        self._reserves: Coalescer[tuple[tuple[DecodeCapacity, ...], int], tuple[str, int], tuple[int, int, int]] = \
            Coalescer(self._reserve_batch, abandoned=self._abandoned, interrupted=self._interrupted)
        self._resizes: list[tuple[Reservation, int, asyncio.Future[int]]] = []
        self._resize_timer: asyncio.TimerHandle | None = None
        self._tasks = BackgroundTasks()
        self.script_calls = 0

    @property
    def client(self) -> RedisClient:
        return self._r

    def _worker_keys(self, worker_id: str, epoch: int) -> list[str]:
        k = self.keys
        return [k.kv_bookings(worker_id, epoch), k.kv_leases(worker_id, epoch), k.kv_used(worker_id, epoch)]

    @property
    def round_trips(self) -> int:
        """Booking script calls sent so far (requests served per call = the coalescing)."""
        return self.script_calls

    async def reserve(self, booking_id: BookingId, blocks: int, candidates: Sequence[DecodeCapacity],
                      lease_ms: int) -> Reservation:
        """Book ``blocks`` on one candidate with room under ``booking_id``; idempotent per booking id.

        ``booking_id`` must be unique to this booking (see :data:`BookingId`): a second ``reserve``
        of the same id finds the first booking and only extends its lease.

        RequestTooLargeError when no candidate could ever hold it; CapacityError when none has room now.
        A caller cancelled while its booking is on the way has it released again.
        """
        if blocks <= 0 or lease_ms <= 0:
            raise InvalidRequestError(f"blocks and lease_ms must be > 0, got {blocks} and {lease_ms}")
        if not candidates:
            raise CapacityError("no decode worker is registered for this model")
        largest = max(c.capacity_blocks for c in candidates)
        if blocks > largest:
            raise RequestTooLargeError(f"the request needs {blocks} KV blocks but the largest decode worker holds "
                                       f"{largest}; shorten the prompt or max_tokens")
        group = (tuple(candidates), lease_ms)
        index, value, _existing = await self._reserves.submit(group, (booking_id, blocks))
        if index == 0:
            raise CapacityError(f"no decode worker has {blocks} free KV blocks now (most free: {max(value, 0)})")
        chosen = candidates[index - 1]
        return Reservation(booking_id, chosen.worker_id, chosen.epoch, blocks, lease_ms)

    async def _reserve_batch(self, group: tuple[tuple[DecodeCapacity, ...], int],
                             requests: Sequence[tuple[str, int]]) -> list[tuple[int, int, int]]:
        candidates, lease_ms = group
        flat = await self._call(candidates, lease_ms, requests, self._take_resizes())
        return [(flat[i], flat[i + 1], flat[i + 2]) for i in range(0, len(flat), 3)]

    async def _call(self, candidates: Sequence[DecodeCapacity], lease_ms: int, requests: Sequence[tuple[str, int]],
                    resizes: list[tuple[Reservation, int, asyncio.Future[int]]]) -> list[int]:
        """One script call: ``resizes`` (their futures get the blocks given back), then ``requests``."""
        workers: dict[tuple[str, int], int] = {}
        keys: list[str] = []

        def index(worker_id: str, epoch: int) -> int:
            if (worker_id, epoch) not in workers:
                workers[(worker_id, epoch)] = len(workers) + 1
                keys.extend(self._worker_keys(worker_id, epoch))
            return workers[(worker_id, epoch)]

        args: list[str | int] = [lease_ms, self.policy.value, len(candidates)]
        for c in candidates:
            args += [index(c.worker_id, c.epoch), c.capacity_blocks]
        args.append(len(resizes))
        for reservation, blocks, _ in resizes:
            args += [index(reservation.worker_id, reservation.epoch), reservation.booking_id, blocks]
        for booking_id, blocks in requests:
            args += [booking_id, blocks]
        self.script_calls += 1
        try:
            reply = await (self._admit(keys=keys, args=args) if self._pipe is None
                           else self._pipe.evalsha(self._admit, keys, args))
            flat = [int(x) for x in reply]
        except asyncio.CancelledError:
            # Resizes are idempotent: whether or not this call got through, they go again.
            if resizes:
                self._resizes.extend(resizes)
                asyncio.get_running_loop().call_soon(self._flush_resizes)
            raise
        except Exception as exc:
            for _, _, fut in resizes:
                if not fut.done():
                    fut.set_exception(exc)
            raise
        for (_, _, fut), freed in zip(resizes, flat, strict=False):
            if not fut.done():
                fut.set_result(freed)
        return flat[len(resizes):]

    def _abandoned(self, group: tuple[tuple[DecodeCapacity, ...], int], request: tuple[str, int],
                   result: tuple[int, int, int]) -> None:
        """A booking made for a caller that gave up meanwhile: give it back."""
        index, _, existing = result
        if index and not existing:
            chosen = group[0][index - 1]
            orphan = Reservation(BookingId(request[0]), chosen.worker_id, chosen.epoch, request[1], group[1])
            self._spawn(self.release(orphan, urgent=True))

    def _interrupted(self, group: tuple[tuple[DecodeCapacity, ...], int], request: tuple[str, int]) -> None:
        """A reservation cancelled on its way may or may not be booked: release it wherever it may be."""
        for c in group[0]:
            self._spawn(self.release(Reservation(BookingId(request[0]), c.worker_id, c.epoch, request[1], group[1]),
                                     urgent=True))

    def _spawn(self, coro: Coroutine[Any, Any, Any]) -> None:
        self._tasks.spawn(coro)

    async def shrink(self, reservation: Reservation, blocks: int, urgent: bool = False) -> int:
        """Lower a booking to ``blocks`` (tokens finished early); returns the blocks given back.

        The change rides along with the next reservations sent within ``resize_delay_s``, or goes
        alone then; ``urgent`` sends it at once (someone is waiting for the room).
        """
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[int] = loop.create_future()
        fut.add_done_callback(_retrieve)  # a cancelled caller's failure is not an unhandled error
        self._resizes.append((reservation, max(0, blocks), fut))
        if urgent or self.resize_delay_s <= 0:
            self._flush_resizes()
        elif self._resize_timer is None:
            self._resize_timer = loop.call_later(self.resize_delay_s, self._flush_resizes)
        return await asyncio.shield(fut)  # a cancelled caller does not take the change back

    def _take_resizes(self) -> list[tuple[Reservation, int, asyncio.Future[int]]]:
        taken, self._resizes = self._resizes, []
        if self._resize_timer is not None:
            self._resize_timer.cancel()
            self._resize_timer = None
        return taken

    def _flush_resizes(self) -> None:
        taken = self._take_resizes()
        if taken:
            self._spawn(self._send_resizes(taken))

    async def _send_resizes(self, taken: list[tuple[Reservation, int, asyncio.Future[int]]]) -> None:
        with contextlib.suppress(Exception):  # each caller's future carries the failure
            await self._call((), 1, (), taken)

    async def release(self, reservation: Reservation, urgent: bool = False) -> int:
        """Drop the booking; returns the blocks given back (0 when it was already gone)."""
        return await self.shrink(reservation, 0, urgent)

    async def flush(self) -> None:
        """Send pending releases now and wait for every booking call in flight (shutdown)."""
        self._flush_resizes()
        await self._reserves.drain()
        while self._tasks:
            await self._tasks.wait()

    async def renew(self, reservation: Reservation, lease_ms: int | None = None) -> bool:
        """Extend the lease, and the TTL of the worker's three keys; False when the booking already
        expired or was released."""
        keys = self._worker_keys(reservation.worker_id, reservation.epoch)
        return bool(await self._renew(keys=keys, args=[reservation.booking_id, lease_ms or reservation.lease_ms]))

    async def used(self, worker_id: str, epoch: int) -> int:
        """Blocks booked on a worker now, after dropping expired leases."""
        return int(await self._purge(keys=self._worker_keys(worker_id, epoch)))

    async def holdings(self, worker_id: str, epoch: int) -> BookingHoldings:
        """What Redis holds for one incarnation, as it is (expired leases included, nothing purged):
        for audits of what dead incarnations left behind."""
        k = self.keys
        return BookingHoldings(int(await self._r.hlen(k.kv_bookings(worker_id, epoch))),
                               int(await self._r.zcard(k.kv_leases(worker_id, epoch))),
                               int(await self._r.get(k.kv_used(worker_id, epoch)) or 0))

    async def bookings(self, worker_id: str, epoch: int) -> dict[str, int]:
        """The worker's bookings as Redis holds them: booking id → blocks (expired leases included)."""
        raw = await self._r.hgetall(self.keys.kv_bookings(worker_id, epoch))
        return {(k.decode() if isinstance(k, bytes) else k): int(v) for k, v in raw.items()}
