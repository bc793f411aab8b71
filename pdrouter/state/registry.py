"""The worker registry in Redis: register, heartbeat with load, list live workers.

A worker is *live* while its heartbeat key exists (it carries a TTL, refreshed by every
heartbeat) and names the epoch that is registered. A restarted worker takes a new, larger epoch
(``new_epoch``); heartbeats carrying an older epoch are refused, so a zombie incarnation cannot
keep itself or its old state counted.
"""

from __future__ import annotations

from pdrouter.core.errors import StaleEpochError
from pdrouter.core.ids import Epoch, WorkerId
from pdrouter.core.workers import DEFAULT_HEARTBEAT_TTL_MS, LiveWorker, WorkerLoad, WorkerRecord, WorkerRole
from pdrouter.state.client import RedisClient
from pdrouter.state.keys import PoolKeys

# KEYS: workers hash, heartbeat key. ARGV: worker_id, epoch, load JSON, ttl ms.
# Refreshes the heartbeat only when the registered record has this epoch.
_HEARTBEAT = """
local raw = redis.call('HGET', KEYS[1], ARGV[1])
if not raw then return -1 end
local rec = cjson.decode(raw)
if tonumber(rec['epoch']) ~= tonumber(ARGV[2]) then return -2 end
redis.call('SET', KEYS[2], ARGV[2] .. ' ' .. ARGV[3], 'PX', tonumber(ARGV[4]))
return 1
"""

# KEYS: workers hash, heartbeat key. ARGV: worker_id, record JSON, epoch, ttl ms.
# Registers unless a newer epoch is already registered.
_REGISTER = """
local raw = redis.call('HGET', KEYS[1], ARGV[1])
if raw then
  local rec = cjson.decode(raw)
  if tonumber(rec['epoch']) > tonumber(ARGV[3]) then return -2 end
end
redis.call('HSET', KEYS[1], ARGV[1], ARGV[2])
redis.call('SET', KEYS[2], ARGV[3] .. ' {}', 'PX', tonumber(ARGV[4]))
return 1
"""

# KEYS: workers hash, heartbeat key. ARGV: worker_id, epoch.
_DEREGISTER = """
local raw = redis.call('HGET', KEYS[1], ARGV[1])
if not raw then return 0 end
local rec = cjson.decode(raw)
if tonumber(rec['epoch']) ~= tonumber(ARGV[2]) then return -2 end
redis.call('HDEL', KEYS[1], ARGV[1])
redis.call('DEL', KEYS[2])
return 1
"""


class WorkerRegistry:
    """Registry of one pool's workers. Safe to share between tasks of one event loop."""

    def __init__(self, client: RedisClient, pool: str, namespace: str = "pdr",
                 heartbeat_ttl_ms: int = DEFAULT_HEARTBEAT_TTL_MS) -> None:
        self._r = client
        self.keys = PoolKeys(namespace, pool)
        self.heartbeat_ttl_ms = heartbeat_ttl_ms
        self._heartbeat = client.register_script(_HEARTBEAT)
        self._register = client.register_script(_REGISTER)
        self._deregister = client.register_script(_DEREGISTER)

    async def new_epoch(self) -> Epoch:
        """A strictly increasing epoch for a new worker incarnation (shared counter in Redis)."""
        return Epoch(int(await self._r.incr(self.keys.epoch_counter)))

    async def register(self, record: WorkerRecord) -> None:
        """Publish ``record`` and mark it live; StaleEpochError if a newer epoch is registered."""
        res = await self._register(keys=[self.keys.workers, self.keys.heartbeat(record.worker_id)],
                                   args=[record.worker_id, record.to_json(), record.epoch,
                                         self.heartbeat_ttl_ms])
        if int(res) == -2:
            raise StaleEpochError(f"worker {record.worker_id}: epoch {record.epoch} is older than the "
                                  f"registered one; a newer incarnation is running")

    async def heartbeat(self, worker_id: WorkerId, epoch: Epoch, load: WorkerLoad) -> None:
        """Refresh liveness and load; StaleEpochError when ``epoch`` is not the registered one."""
        res = int(await self._heartbeat(
            keys=[self.keys.workers, self.keys.heartbeat(worker_id)],
            args=[worker_id, epoch, load.to_json(),
                  self.heartbeat_ttl_ms]))
        if res == -1:
            raise StaleEpochError(f"worker {worker_id} is not registered (Redis restarted?): register again")
        if res == -2:
            raise StaleEpochError(f"worker {worker_id}: epoch {epoch} was superseded by a newer incarnation")

    async def deregister(self, worker_id: WorkerId, epoch: Epoch) -> bool:
        """Remove the worker if ``epoch`` is still the registered one; True when removed."""
        res = int(await self._deregister(keys=[self.keys.workers, self.keys.heartbeat(worker_id)],
                                         args=[worker_id, epoch]))
        return res == 1

    async def records(self) -> list[WorkerRecord]:
        """Every registered record, live or not."""
        raw = await self._r.hgetall(self.keys.workers)
        return [WorkerRecord.from_json(v) for v in raw.values()]

    async def live_workers(self, role: WorkerRole | None = None) -> list[LiveWorker]:
        """Workers whose heartbeat is current and names their registered epoch."""
        records = [r for r in await self.records() if role is None or r.role == role]
        if not records:
            return []
        beats = await self._r.mget([self.keys.heartbeat(r.worker_id) for r in records])
        live = []
        for record, beat in zip(records, beats, strict=True):
            if beat is None:
                continue
            epoch_s, _, load_json = (beat.decode() if isinstance(beat, bytes) else beat).partition(" ")
            if int(epoch_s) != record.epoch:
                continue
            load = WorkerLoad.from_json(load_json)
            live.append(LiveWorker(record, load))
        live.sort(key=lambda w: w.record.worker_id)
        return live
