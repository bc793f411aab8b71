"""Tenants' limits in Redis, shared by every router: one atomic script per request.

Per tenant three keys under one hash tag (``pdrouter.state.keys.TenantKeys``): the requests admitted
in the last minute (a sorted set scored by admission time, each member carrying its prompt and
output tokens), their sums, and the requests being served (booking → lease expiry).

:meth:`TenantLimiter.acquire` is one script: it drops what left the window (and its tokens from the
sums), then checks every limit against what is left and admits only if each holds, recording the
request in all three at once. Routers sharing one Redis therefore never admit past a limit however
they race: in any 60 s (on Redis's clock) a tenant at ``requests_per_minute`` N gets at most N
requests admitted, and exactly N when it sends more. The window slides: a refusal says when the
oldest request it waits on leaves it (``retry_after_ms``).

Tokens: a request is counted with its prompt tokens and, as output, its ``max_tokens`` (what it may
generate); :meth:`settle` corrects the output to what it did generate once it ends, and frees its
place among the running requests. So the prompt and output limits are never passed: a request that
would pass one waits until enough of the window's tokens leave it (one whose own tokens exceed a
limit is refused for good, ``retry_after_ms`` -1). A router that dies leaves its requests counted in
the window (they were admitted) and its running ones until their leases lapse (``renew`` keeps a
live router's).

The script is idempotent per booking: redis-py retries a command whose connection failed, and a
retry of a call that Redis ran (its reply lost) finds the booking already counted and admits it
without counting it again.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from pdrouter.core.tenants import LIMIT_NAMES, TenantLimits
from pdrouter.state.client import RedisClient
from pdrouter.state.keys import TenantKeys
from pdrouter.state.pipelined import PipelinedRedis

WINDOW_MS = 60_000
"""The limits are per minute, over a sliding window."""

# KEYS: window, totals, running. ARGV: member (booking|prompt|output), prompt, output, requests/min,
# prompt tokens/min, output tokens/min, max concurrent (0: no limit), window ms, lease ms, booking.
# Reply: {1} admitted, or {0, limit name, limit, used, retry after ms (-1: never)}.
_ACQUIRE = """
redis.replicate_commands()
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local member, prompt, output = ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[3])
local rpm, ptpm, otpm, maxc = tonumber(ARGV[4]), tonumber(ARGV[5]), tonumber(ARGV[6]), tonumber(ARGV[7])
local window, lease, booking = tonumber(ARGV[8]), tonumber(ARGV[9]), ARGV[10]
local windowed = rpm > 0 or ptpm > 0 or otpm > 0
-- Already admitted (a client's retry of a call whose reply was lost): admitted, counted once.
if windowed and redis.call('ZSCORE', KEYS[1], member) then return {1} end
if maxc > 0 and not windowed and redis.call('ZSCORE', KEYS[3], booking) then return {1} end
if ptpm > 0 and prompt > ptpm then return {0, 'prompt_tokens_per_minute', ptpm, prompt, -1} end
if otpm > 0 and output > otpm then return {0, 'output_tokens_per_minute', otpm, output, -1} end
local r, p, o = 0, 0, 0
if windowed then
  while true do
    local old = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', now - window, 'LIMIT', 0, 512)
    if #old == 0 then break end
    local dp, dout = 0, 0
    for _, m in ipairs(old) do
      local a, b = string.match(m, '|(%d+)|(%d+)$')
      dp = dp + tonumber(a); dout = dout + tonumber(b)
    end
    redis.call('ZREM', KEYS[1], unpack(old))
    redis.call('HINCRBY', KEYS[2], 'p', -dp)
    redis.call('HINCRBY', KEYS[2], 'o', -dout)
    if #old < 512 then break end
  end
  local sums = redis.call('HMGET', KEYS[2], 'p', 'o')
  r, p, o = redis.call('ZCARD', KEYS[1]), tonumber(sums[1] or '0'), tonumber(sums[2] or '0')
end
local function wait_for(excess, field)
  local got = 0
  local entries = redis.call('ZRANGE', KEYS[1], 0, 1023, 'WITHSCORES')
  for i = 1, #entries, 2 do
    local a, b = string.match(entries[i], '|(%d+)|(%d+)$')
    if field == 'p' then got = got + tonumber(a) else got = got + tonumber(b) end
    if got >= excess then return math.max(1, tonumber(entries[i + 1]) + window - now) end
  end
  return window
end
if rpm > 0 and r + 1 > rpm then
  local e = redis.call('ZRANGE', KEYS[1], r - rpm, r - rpm, 'WITHSCORES')
  local wait = window
  if #e == 2 then wait = math.max(1, tonumber(e[2]) + window - now) end
  return {0, 'requests_per_minute', rpm, r, wait}
end
if ptpm > 0 and p + prompt > ptpm then
  return {0, 'prompt_tokens_per_minute', ptpm, p, wait_for(p + prompt - ptpm, 'p')}
end
if otpm > 0 and o + output > otpm then
  return {0, 'output_tokens_per_minute', otpm, o, wait_for(o + output - otpm, 'o')}
end
if maxc > 0 then
  redis.call('ZREMRANGEBYSCORE', KEYS[3], '-inf', now)
  local n = redis.call('ZCARD', KEYS[3])
  if n >= maxc then return {0, 'max_concurrent', maxc, n, 1000} end
  redis.call('ZADD', KEYS[3], now + lease, booking)
  redis.call('PEXPIRE', KEYS[3], lease * 4 + 60000)
end
if windowed then
  redis.call('ZADD', KEYS[1], now, member)
  redis.call('HINCRBY', KEYS[2], 'p', prompt)
  redis.call('HINCRBY', KEYS[2], 'o', output)
  redis.call('PEXPIRE', KEYS[1], window + 60000)
  redis.call('PEXPIRE', KEYS[2], window + 60000)
end
return {1}
"""

# KEYS: window, totals, running. ARGV: member, member with the output corrected, output delta, booking.
# The request leaves the running set; its output is corrected if it is still in the window.
_SETTLE = """
redis.call('ZREM', KEYS[3], ARGV[4])
if ARGV[1] ~= '' then
  local score = redis.call('ZSCORE', KEYS[1], ARGV[1])
  if score then
    redis.call('ZREM', KEYS[1], ARGV[1])
    redis.call('ZADD', KEYS[1], score, ARGV[2])
    redis.call('HINCRBY', KEYS[2], 'o', tonumber(ARGV[3]))
  end
end
return 1
"""

# KEYS: running. ARGV: lease ms, then bookings. Extends the leases of those still running.
_RENEW = """
redis.replicate_commands()
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local lease = tonumber(ARGV[1])
local n = 0
for i = 2, #ARGV do
  -- Counted by presence: ZADD's CH counts a changed score only, and a renewal within the millisecond
  -- of the booking leaves the score as it was.
  if redis.call('ZSCORE', KEYS[1], ARGV[i]) then
    redis.call('ZADD', KEYS[1], 'XX', now + lease, ARGV[i])
    n = n + 1
  end
end
if n > 0 then redis.call('PEXPIRE', KEYS[1], lease * 4 + 60000) end
return n
"""


@dataclass(frozen=True, slots=True)
class LimitGrant:
    """A request admitted under its tenant's limits: what :meth:`TenantLimiter.settle` needs."""

    tenant: str
    booking: str
    prompt_tokens: int
    output_tokens: int
    """Output tokens it was counted with (its ``max_tokens``)."""
    windowed: bool
    """Counted in the window (the tenant has a per-minute limit)."""
    running: bool
    """Holds a place among the tenant's running requests (it has ``max_concurrent``)."""

    @property
    def member(self) -> str:
        return f"{self.booking}|{self.prompt_tokens}|{self.output_tokens}"


@dataclass(frozen=True, slots=True)
class LimitRefusal:
    """A limit that does not let the request in: which, its value, what is used, and when to retry."""

    limit: str
    """One of ``pdrouter.core.tenants.LIMIT_NAMES``."""
    value: int
    used: int
    retry_after_ms: int
    """When the window will have room for the request (-1: never, the request alone is over the limit)."""

    @property
    def retry_after_s(self) -> int:
        return 1 if self.retry_after_ms < 0 else max(1, math.ceil(self.retry_after_ms / 1000))


class TenantLimiter:
    """Every tenant's limits in one Redis (or cluster), for one router."""

    def __init__(self, client: RedisClient, namespace: str = "pdr", window_ms: int = WINDOW_MS,
                 lease_ms: int = 30_000, pipelined: PipelinedRedis | None = None) -> None:
        """``lease_ms``: how long a running request's place outlives this router's last renewal;
        ``pipelined``: a connection to the same Redis that each request's scripts go over
        (``pdrouter.state.pipelined``; None: the client's own path)."""
        self._r = client
        self._pipe = pipelined
        self.namespace = namespace
        self.window_ms = window_ms
        self.lease_ms = lease_ms
        self._acquire = client.register_script(_ACQUIRE)
        self._settle = client.register_script(_SETTLE)
        self._renew = client.register_script(_RENEW)

    def _keys(self, tenant: str) -> list[str]:
        k = TenantKeys(self.namespace, tenant)
        return [k.window, k.totals, k.running]

    async def acquire(self, tenant: str, limits: TenantLimits, booking: str, prompt_tokens: int,
                      output_tokens: int) -> LimitGrant | LimitRefusal:
        """Admit one request of ``tenant`` (``booking``: an id unique to it) under ``limits``, or say
        which limit refuses it. Redis errors propagate."""
        grant = LimitGrant(tenant, booking, prompt_tokens, output_tokens,
                           windowed=any(v is not None for v in (limits.requests_per_minute,
                                                                limits.prompt_tokens_per_minute,
                                                                limits.output_tokens_per_minute)),
                           running=limits.max_concurrent is not None)
        reply = await self._run(self._acquire, self._keys(tenant), [
            grant.member, prompt_tokens, output_tokens, limits.requests_per_minute or 0,
            limits.prompt_tokens_per_minute or 0, limits.output_tokens_per_minute or 0, limits.max_concurrent or 0,
            self.window_ms, self.lease_ms, booking])
        if int(reply[0]) == 1:
            return grant
        name = reply[1].decode() if isinstance(reply[1], bytes) else str(reply[1])
        assert name in LIMIT_NAMES, name
        return LimitRefusal(name, int(reply[2]), int(reply[3]), int(reply[4]))

    async def settle(self, grant: LimitGrant, output_tokens: int) -> None:
        """``grant``'s request ended having generated ``output_tokens``: correct its count in the
        window and free its place among the running requests."""
        if not grant.windowed and not grant.running:
            return
        corrected = f"{grant.booking}|{grant.prompt_tokens}|{output_tokens}"
        await self._run(self._settle, self._keys(grant.tenant), [
            grant.member if grant.windowed else "", corrected, output_tokens - grant.output_tokens, grant.booking])

    async def _run(self, script: Any, keys: list[str], args: list[str | int]) -> Any:
        """One request's script, over the pipelined connection when there is one."""
        if self._pipe is None:
            return await script(keys=keys, args=args)
        return await self._pipe.evalsha(script, keys, args)

    async def renew(self, grants: Iterable[LimitGrant]) -> int:
        """Extend the leases of running requests (per tenant, one call); the number still running."""
        by_tenant: dict[str, list[str]] = {}
        for grant in grants:
            if grant.running:
                by_tenant.setdefault(grant.tenant, []).append(grant.booking)
        renewed = 0
        for tenant, bookings in by_tenant.items():
            renewed += int(await self._renew(keys=[TenantKeys(self.namespace, tenant).running],
                                             args=[self.lease_ms, *bookings]))
        return renewed

    async def usage(self, tenant: str) -> dict[str, int]:
        """The tenant's counts as the next request would see them (requests, prompt and output tokens
        in the window, running requests whose lease holds), for tests and tools; nothing is swept."""
        window, totals, running = self._keys(tenant)
        seconds, micros = await self._r.time()
        now = int(seconds) * 1000 + int(micros) // 1000
        sums = await self._r.hmget(totals, ["p", "o"])
        return {"requests": int(await self._r.zcount(window, now - self.window_ms + 1, "+inf")),
                "prompt_tokens": int(sums[0] or 0), "output_tokens": int(sums[1] or 0),
                "running": int(await self._r.zcount(running, now + 1, "+inf"))}
