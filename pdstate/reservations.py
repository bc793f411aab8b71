"""KV reservations in Redis: book decode blocks before any work starts, shared by every router.

Per decode worker incarnation ``(worker_id, epoch)`` three keys (one hash tag per pool):
``kv:book`` (request → blocks), ``kv:lease`` (request → expiry, ms on the Redis clock) and
``kv:used`` (their sum). ``reserve`` is one script: it first drops expired leases on every
candidate, then picks a worker with room for the request (``most_free`` or ``best_fit``) and
books it, atomically, so routers sharing one Redis can never book more than a worker has. A
crashed router's bookings expire with their leases; a restarted worker has a new epoch and so
fresh, empty keys (its old bookings are never counted again and expire on their own).
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass

import redis.asyncio as aioredis

from pdcommon.errors import CapacityError, InvalidRequestError, RequestTooLargeError
from pdcommon.ids import Epoch, RequestId, WorkerId
from pdstate.keys import PoolKeys


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
    """Blocks booked for one request on one decode worker, until released or the lease expires."""

    request_id: RequestId
    worker_id: WorkerId
    epoch: Epoch
    blocks: int
    lease_ms: int


# KEYS: per candidate 3 keys (book, lease, used). ARGV: request_id, blocks, lease_ms, policy,
# then per candidate its capacity. Returns {index, used_after} or {0, max_free}.
_RESERVE = """
redis.replicate_commands()
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local rid, need, lease = ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[3])
local policy = ARGV[4]
local n = #KEYS / 3
local best, best_score, max_free = 0, nil, -1
for i = 1, n do
  local book, leases, used = KEYS[3*i-2], KEYS[3*i-1], KEYS[3*i]
  local expired = redis.call('ZRANGEBYSCORE', leases, '-inf', now)
  for _, r in ipairs(expired) do
    local b = redis.call('HGET', book, r)
    if b then
      redis.call('DECRBY', used, tonumber(b))
      redis.call('HDEL', book, r)
    end
    redis.call('ZREM', leases, r)
  end
  local cap = tonumber(ARGV[4 + i])
  local existing = redis.call('HGET', book, rid)
  if existing then
    redis.call('ZADD', leases, now + lease, rid)
    return {i, tonumber(redis.call('GET', used) or '0'), 1}
  end
  local free = cap - tonumber(redis.call('GET', used) or '0')
  if free > max_free then max_free = free end
  if free >= need then
    local score
    if policy == 'best_fit' then score = free - need else score = -free end
    if best_score == nil or score < best_score then
      best, best_score = i, score
    end
  end
end
if best == 0 then return {0, max_free, 0} end
local book, leases, used = KEYS[3*best-2], KEYS[3*best-1], KEYS[3*best]
redis.call('HSET', book, rid, need)
redis.call('ZADD', leases, now + lease, rid)
local after = redis.call('INCRBY', used, need)
local ttl = lease * 4 + 60000
redis.call('PEXPIRE', book, ttl)
redis.call('PEXPIRE', leases, ttl)
redis.call('PEXPIRE', used, ttl)
return {best, after, 0}
"""

# KEYS: book, lease, used. ARGV: request_id, new blocks (0 = release). Returns blocks freed.
_RESIZE = """
local b = redis.call('HGET', KEYS[1], ARGV[1])
if not b then return 0 end
local old, new = tonumber(b), tonumber(ARGV[2])
if new >= old then return 0 end
if new == 0 then
  redis.call('HDEL', KEYS[1], ARGV[1])
  redis.call('ZREM', KEYS[2], ARGV[1])
else
  redis.call('HSET', KEYS[1], ARGV[1], new)
end
redis.call('DECRBY', KEYS[3], old - new)
return old - new
"""

# KEYS: book, lease. ARGV: request_id, lease_ms. Extends a lease (1) or says it is gone (0).
_RENEW = """
redis.replicate_commands()
if not redis.call('HGET', KEYS[1], ARGV[1]) then return 0 end
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
redis.call('ZADD', KEYS[2], now + tonumber(ARGV[2]), ARGV[1])
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


class KvReservations:
    """Admission bookings for one pool's decode workers."""

    def __init__(self, client: aioredis.Redis, pool: str, namespace: str = "pdr",
                 policy: PickPolicy = PickPolicy.MOST_FREE) -> None:
        self._r = client
        self.keys = PoolKeys(namespace, pool)
        self.policy = policy
        self._reserve = client.register_script(_RESERVE)
        self._resize = client.register_script(_RESIZE)
        self._renew = client.register_script(_RENEW)
        self._purge = client.register_script(_PURGE)

    def _worker_keys(self, worker_id: str, epoch: int) -> list[str]:
        k = self.keys
        return [k.kv_bookings(worker_id, epoch), k.kv_leases(worker_id, epoch), k.kv_used(worker_id, epoch)]

    async def reserve(self, request_id: RequestId, blocks: int, candidates: Sequence[DecodeCapacity],
                      lease_ms: int) -> Reservation:
        """Book ``blocks`` on one candidate with room; idempotent per request id.

        RequestTooLargeError when no candidate could ever hold it; CapacityError when none has room now.
        """
        if blocks <= 0 or lease_ms <= 0:
            raise InvalidRequestError(f"blocks and lease_ms must be > 0, got {blocks} and {lease_ms}")
        if not candidates:
            raise CapacityError("no decode worker is registered for this model")
        largest = max(c.capacity_blocks for c in candidates)
        if blocks > largest:
            raise RequestTooLargeError(f"the request needs {blocks} KV blocks but the largest decode worker holds "
                                       f"{largest}; shorten the prompt or max_tokens")
        keys = [k for c in candidates for k in self._worker_keys(c.worker_id, c.epoch)]
        args: list[str | int] = [request_id, blocks, lease_ms, self.policy.value,
                                 *(c.capacity_blocks for c in candidates)]
        index, value, _existing = (int(x) for x in await self._reserve(keys=keys, args=args))
        if index == 0:
            raise CapacityError(f"no decode worker has {blocks} free KV blocks now (most free: {max(value, 0)})")
        chosen = candidates[index - 1]
        return Reservation(request_id, chosen.worker_id, chosen.epoch, blocks, lease_ms)

    async def shrink(self, reservation: Reservation, blocks: int) -> int:
        """Lower a booking to ``blocks`` (tokens finished early); returns the blocks given back."""
        keys = self._worker_keys(reservation.worker_id, reservation.epoch)
        return int(await self._resize(keys=keys, args=[reservation.request_id, max(0, blocks)]))

    async def release(self, reservation: Reservation) -> int:
        """Drop the booking; returns the blocks given back (0 when it was already gone)."""
        return await self.shrink(reservation, 0)

    async def renew(self, reservation: Reservation, lease_ms: int | None = None) -> bool:
        """Extend the lease; False when the booking already expired or was released."""
        keys = self._worker_keys(reservation.worker_id, reservation.epoch)[:2]
        return bool(await self._renew(keys=keys, args=[reservation.request_id, lease_ms or reservation.lease_ms]))

    async def used(self, worker_id: str, epoch: int) -> int:
        """Blocks booked on a worker now, after dropping expired leases."""
        return int(await self._purge(keys=self._worker_keys(worker_id, epoch)))

    async def bookings(self, worker_id: str, epoch: int) -> dict[str, int]:
        raw = await self._r.hgetall(self.keys.kv_bookings(worker_id, epoch))
        return {(k.decode() if isinstance(k, bytes) else k): int(v) for k, v in raw.items()}
