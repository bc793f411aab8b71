"""The workers one router knows: discovered from the Redis registry and/or a static address list.

Each ``WorkerHandle`` holds the client of one worker (``pdrouter.wire.worker_client``: its worker
lane where it serves one, else gRPC), its last reported load,
the requests this router has in flight on it, and its circuit breaker. ``refresh`` re-reads the
registry (live workers only: heartbeat current, epoch fenced) and asks static workers for their
info; a worker that disappears from both is dropped after ``missing_grace_s`` (long enough for every
worker to re-register after a Redis restart) and its channel closed once no request uses it. With Redis down, the
last known set is kept and ``registry_ok`` turns false. A worker whose heartbeat says its engine failed
(``WorkerLoad.engine_failed``) stays known but is never ``available``: it serves nothing until it is
restarted, and then comes back as a new incarnation.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Callable, Coroutine, Sequence
from dataclasses import dataclass, field
from typing import Any

import grpc
from redis.exceptions import RedisError

from pdrouter.core.aio import BackgroundTasks, cancel_and_wait
from pdrouter.core.ids import WorkerId
from pdrouter.core.workers import WorkerLoad, WorkerRecord, WorkerRole
from pdrouter.router.placement.circuit_breaker import CircuitBreaker
from pdrouter.state.registry import WorkerRegistry
from pdrouter.wire.lane import LaneChannel
from pdrouter.wire.security import OPEN, PeerSecurity
from pdrouter.wire.worker_client import WorkerClient

log = logging.getLogger(__name__)


KEEP_REPORTED_S = 10.0
"""The longest ``OwnPrefills`` keeps a reported prompt: well past a heartbeat's life
(``DEFAULT_HEARTBEAT_TTL_MS``, 3 s), so that no load taken before the report is still read after it."""


class PrefillCharge:
    """A prompt this router placed on a worker, from its placement to its prefill report (``OwnPrefills``)."""

    __slots__ = ("placed_at", "priority", "settled_at", "tokens")

    def __init__(self, tokens: int, priority: int, placed_at: float) -> None:
        self.tokens = tokens
        self.priority = priority
        self.placed_at = placed_at
        self.settled_at = 0.0


class OwnPrefills:
    """The prompts this router placed on one worker, so that its heartbeat does not count them twice.

    Placement adds to a worker's reported backlog (``WorkerLoad.queued_prefill_tokens``) the prompts
    this router placed there that have not reported (``WorkerHandle.inflight_prefill_tokens``). A
    prompt that was queued when the load was taken would count twice until its report, and once more
    until a later load is read: a second or two after it finished. ``adjust`` takes out of a load the
    prompts of this router it may hold: placed before the load was taken (``WorkerLoad.taken_at``)
    and not reported by then. Other routers' prompts stay as the worker reported them. A load without
    ``taken_at`` (a static worker's, asked over gRPC) is used as it is. The clocks are the worker's and
    this router's; a load taken "later" than now counts as taken now. A reported prompt is kept until
    a load taken after its report is read, so none is taken out of a load twice or missed, and for
    ``KEEP_REPORTED_S`` at most (the same load read again and again, while the registry is unreachable,
    keeps nothing longer).
    """

    __slots__ = ("_charges", "_timed")

    def __init__(self) -> None:
        self._charges: dict[PrefillCharge, None] = {}
        self._timed = False
        """A load with ``taken_at`` was read: reported prompts are kept for the next one."""

    def __len__(self) -> int:
        return len(self._charges)

    def charge(self, tokens: int, priority: int, now: float) -> PrefillCharge:
        charge = PrefillCharge(tokens, priority, now)
        self._charges[charge] = None
        return charge

    def settle(self, charge: PrefillCharge, now: float) -> None:
        if self._timed:
            charge.settled_at = now
        else:
            self._charges.pop(charge, None)

    def adjust(self, load: WorkerLoad, now: float) -> WorkerLoad:
        """``load`` without the prompts of this router it may hold (see the class docstring)."""
        taken_at = min(load.taken_at, now)
        self._timed = taken_at > 0
        own = 0
        own_by: dict[int, int] = {}
        forget = max(taken_at, now - KEEP_REPORTED_S)
        for charge in list(self._charges):
            if charge.settled_at and (not self._timed or charge.settled_at <= forget):
                del self._charges[charge]  # reported before the load was taken: not in it, nor in a later one
            elif self._timed and charge.placed_at <= taken_at:
                own += charge.tokens
                own_by[charge.priority] = own_by.get(charge.priority, 0) + charge.tokens
        if not own:
            return load
        by = tuple((p, max(0, tokens - own_by.get(p, 0))) for p, tokens in load.queued_prefill_by_priority)
        return dataclasses.replace(load, queued_prefill_tokens=max(0, load.queued_prefill_tokens - own),
                                   queued_prefill_by_priority=by)


@dataclass
class WorkerHandle:
    """A connection to one worker incarnation and this router's view of it.

    ``load`` is what placement reads: the worker's last reported load (``reported``) without the
    prompts of this router it may hold, which ``inflight_prefill_tokens`` counts (``OwnPrefills``)."""

    record: WorkerRecord
    load: WorkerLoad
    client: WorkerClient
    breaker: CircuitBreaker = field(default_factory=CircuitBreaker)
    inflight: int = 0
    inflight_prefill_tokens: int = 0
    inflight_prefill_by_priority: dict[int, int] = field(default_factory=dict)
    """``inflight_prefill_tokens`` by the prompts' engine priorities."""
    assigned_tokens: int = 0
    worker_id: WorkerId = field(init=False)
    """The record's, kept as a plain attribute: placement reads it several times per candidate."""
    role: WorkerRole = field(init=False)
    reported: WorkerLoad = field(init=False)
    """The worker's last reported load, as it reported it (``load`` is placement's view of it)."""
    own: OwnPrefills = field(init=False)

    def __post_init__(self) -> None:
        self.worker_id = self.record.worker_id  # the record of an incarnation never changes
        self.role = self.record.role
        self.reported = self.load
        self.own = OwnPrefills()
        self.load = self.own.adjust(self.load, time.time())  # nothing to take out yet: notes whether it is timed

    def set_load(self, load: WorkerLoad) -> None:
        """The worker's latest report."""
        self.reported = load
        self.load = self.own.adjust(load, time.time())

    @property
    def schedules_by_priority(self) -> bool:
        return self.record.schedules_by_priority

    def charge_prefill(self, prompt_tokens: int, cached_tokens: int, priority: int = 0) -> PrefillCharge:
        """This router placed a prompt's prefill here, at engine ``priority``: it counts as queued on
        the worker until settled (``settle_prefill`` with what this returns)."""
        self.inflight += 1
        self.inflight_prefill_tokens += prompt_tokens
        by = self.inflight_prefill_by_priority
        by[priority] = by.get(priority, 0) + prompt_tokens
        self.assigned_tokens += prompt_tokens - cached_tokens
        return self.own.charge(prompt_tokens, priority, time.time())

    def settle_prefill(self, charge: PrefillCharge) -> None:
        """The prefill charged by ``charge_prefill`` is over (its report came, or the request ended)."""
        prompt_tokens, priority = charge.tokens, charge.priority
        self.inflight -= 1
        self.inflight_prefill_tokens -= prompt_tokens
        by = self.inflight_prefill_by_priority
        left = by.get(priority, 0) - prompt_tokens
        if left > 0:
            by[priority] = left
        else:
            by.pop(priority, None)
        self.own.settle(charge, time.time())

    @property
    def lane(self) -> LaneChannel | None:
        """The worker lane, when the worker serves one and the router uses it: request RPCs go there."""
        return self.client.lane

    async def close(self) -> None:
        await self.client.close()


class WorkerPool:
    """The set of workers serving one model."""

    def __init__(self, model: str, registry: WorkerRegistry | None = None,
                 static_addresses: Sequence[str] = (), refresh_interval_s: float = 1.0,
                 breaker_threshold: int = 3, breaker_cooldown_s: float = 5.0,
                 missing_grace_s: float = 2.0,
                 on_leave: Callable[[WorkerRecord], Coroutine[Any, Any, None]] | None = None,
                 use_lane: bool = True, security: PeerSecurity = OPEN, block_size: int | None = None) -> None:
        """``on_leave(record)`` runs when a worker incarnation leaves the pool (e.g. drop its index entries).

        ``block_size``: the KV block size this router hashes prompts and books KV in; a worker that
        registers another one is left out (its index entries and its pool would be read wrongly), with
        a warning naming the router's ``--block-size`` (once per worker incarnation).

        ``use_lane``: send requests over a worker's lane when its record names one (else gRPC);
        ``security``: the credentials every call to a worker presents (internal secret, TLS).
        """
        self.use_lane = use_lane
        self.security = security
        self.model = model
        self.registry = registry
        self.static_addresses = list(static_addresses)
        self.refresh_interval_s = refresh_interval_s
        self._breaker_args = (breaker_threshold, breaker_cooldown_s)
        self._handles: dict[WorkerId, WorkerHandle] = {}
        self._missing: dict[WorkerId, float] = {}
        self._closing = BackgroundTasks(log, "closing a departed worker failed")
        self.missing_grace_s = missing_grace_s
        self.on_leave = on_leave
        self._task: asyncio.Task[None] | None = None
        self.registry_ok = registry is not None
        self.model_compat_hash = ""
        self.block_size = block_size
        self._warned_block_size: set[tuple[WorkerId, int]] = set()

    def workers(self, role: WorkerRole | None = None) -> list[WorkerHandle]:
        return [h for h in self._handles.values() if role is None or h.role is role]

    def get(self, worker_id: WorkerId) -> WorkerHandle | None:
        """The handle of a worker in the pool now, or None."""
        return self._handles.get(worker_id)

    def available(self, role: WorkerRole) -> list[WorkerHandle]:
        """Workers of ``role`` whose engine serves and whose circuit breaker lets a request through now.

        A worker missing from the registry stops counting at once, unless every worker of the role
        is missing (Redis restarted or is unreachable: better the last known workers than none).
        """
        allowed = [h for h in self._handles.values()
                   if h.role is role and not h.load.engine_failed and h.breaker.allows()]
        if not self._missing:
            return allowed
        present = [h for h in allowed if h.worker_id not in self._missing]
        return present or allowed

    async def start(self) -> None:
        await self.refresh()
        self._task = asyncio.create_task(self._loop(), name=f"worker-pool-{self.model}")

    async def stop(self) -> None:
        await cancel_and_wait(self._task)
        self._task = None
        await self._closing.cancel_all()  # departed workers: cancelling closes their channels
        for handle in self._handles.values():
            await handle.close()
        self._handles.clear()

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(self.refresh_interval_s)
            try:
                await self.refresh()
            except Exception:  # keep refreshing whatever one round hit
                log.exception("worker pool refresh failed")

    async def refresh(self) -> None:
        seen: dict[WorkerId, tuple[WorkerRecord, WorkerLoad]] = {}
        if self.registry is not None:
            try:
                for live in await self.registry.live_workers():
                    seen[live.record.worker_id] = (live.record, live.load)
                if not self.registry_ok:
                    log.info("worker registry reachable again")
                self.registry_ok = True
            except (RedisError, OSError) as exc:
                if self.registry_ok:
                    log.warning("worker registry unreachable (%s); keeping the last known workers", exc)
                self.registry_ok = False
                seen.update({h.worker_id: (h.record, h.reported) for h in self._handles.values()
                             if h.record.address not in self.static_addresses})
        for address in self.static_addresses:
            found = await self._probe_static(address)
            if found is not None:
                seen[found[0].worker_id] = found
        self._apply(seen)

    async def _probe_static(self, address: str) -> tuple[WorkerRecord, WorkerLoad] | None:
        client = WorkerClient(address, security=self.security)
        try:
            return await client.info(timeout=2.0)
        except grpc.RpcError as exc:
            log.warning("static worker %s unreachable: %s", address, exc.code())
            return None
        finally:
            await client.close()

    def _apply(self, seen: dict[WorkerId, tuple[WorkerRecord, WorkerLoad]]) -> None:
        now = time.monotonic()
        for worker_id in list(self._handles):
            handle = self._handles[worker_id]
            found = seen.get(worker_id)
            if found is not None and (found[0].epoch, found[0].address) == (handle.record.epoch,
                                                                             handle.record.address):
                self._missing.pop(worker_id, None)
                continue
            if found is None:
                # Missing from the registry: gone, or Redis restarted and it has not re-registered
                # yet. Keep it a moment; a dead one fails fast and its breaker opens meanwhile.
                first = self._missing.setdefault(worker_id, now)
                if now - first < self.missing_grace_s:
                    continue
            self._missing.pop(worker_id, None)
            log.info("worker %s (epoch %s) left the pool", worker_id, handle.record.epoch)
            del self._handles[worker_id]
            if self.on_leave is not None:
                self._closing.spawn(self.on_leave(handle.record))
            self._closing.spawn(self._close_when_idle(handle))
        for worker_id, (record, load) in seen.items():
            if record.model != self.model:
                continue
            if self.block_size is not None and record.block_size != self.block_size:
                if (worker_id, record.epoch) not in self._warned_block_size:
                    self._warned_block_size.add((worker_id, record.epoch))
                    log.warning("worker %s registers KV blocks of %d tokens, this router hashes and books blocks "
                                "of %d: ignored (start the router with --block-size %d)", worker_id,
                                record.block_size, self.block_size, record.block_size)
                continue
            if self.model_compat_hash and record.model_compat_hash != self.model_compat_hash:
                log.warning("worker %s serves %s with compat hash %s, not %s: ignored", worker_id,
                            record.model, record.model_compat_hash, self.model_compat_hash)
                continue
            existing = self._handles.get(worker_id)
            if existing is not None:
                if load.engine_failed and not existing.load.engine_failed:
                    log.warning("worker %s (epoch %s) reports its engine failed: nothing more is placed there",
                                worker_id, record.epoch)
                existing.set_load(load)
                continue
            client = WorkerClient(record.address, record.lane_address if self.use_lane else "", self.security)
            self._handles[worker_id] = WorkerHandle(record, load, client, CircuitBreaker(*self._breaker_args))
            self.model_compat_hash = self.model_compat_hash or record.model_compat_hash
            lane = client.lane
            log.info("worker %s (%s, epoch %s) joined at %s%s", worker_id, record.role.value,
                     record.epoch, record.address, f" (lane {lane.address})" if lane is not None else "")

    @staticmethod
    async def _close_when_idle(handle: WorkerHandle, limit_s: float = 60.0) -> None:
        """Close a departed worker's channel once no request of this router uses it any more."""
        deadline = time.monotonic() + limit_s
        try:
            while handle.inflight > 0 and time.monotonic() < deadline:
                await asyncio.sleep(0.1)
        finally:  # also when the pool stops: the channel closes either way
            await handle.close()
