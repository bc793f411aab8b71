"""The dispatcher's decisions (``pdrouter.router.dispatch``, whose docstring says what each step
promises): admission and the KV booking, the prefix look-up started early, the ranked prefill
routes and the ``ServeOrder`` (a ``Placement``), what a prefill report settles, and whether a request
failed by a worker goes to another.

Apart from ``dispatch.py``, whose two worker calls are async generators (which mypyc does not
compile), so that ``scripts/compile_engine.py --router`` compiles this code; ``PoolDispatcher``
subclasses ``DispatchCore``.
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from mypy_extensions import mypyc_attr
from redis.exceptions import RedisError

from pdrouter.core.aio import BackgroundTasks
from pdrouter.core.capacity import blocks_for_tokens
from pdrouter.core.disaggregation import PrefillReport, PrefillRoute, ServeOrder, may_prefill_remotely
from pdrouter.core.errors import DeadlineExceededError, UnavailableError
from pdrouter.core.hashing import BlockHasher
from pdrouter.core.ids import Epoch, WorkerId
from pdrouter.core.tracing import Tracing
from pdrouter.core.workers import WorkerRole
from pdrouter.router.admission import Admission
from pdrouter.router.metrics import RouterMetrics
from pdrouter.router.placement.cache_aware import CacheAware
from pdrouter.router.placement.least_loaded import LeastLoaded
from pdrouter.router.placement.policy import PlacementPolicy
from pdrouter.router.placement.worker_pool import PrefillCharge, WorkerHandle, WorkerPool
from pdrouter.router.request import ModelInfo, RouterRequest
from pdrouter.router.transfer_stats import TransferStats
from pdrouter.state.prefix_index import PendingLookup, PrefixIndex
from pdrouter.state.reservations import DecodeCapacity, Reservation

log = logging.getLogger("pdrouter.router.dispatch")  # the dispatcher's logs, wherever the code lives


def engine_priority(priority_class: int, past_share: bool) -> int:
    """The engines' scheduling priority of a request (lower first, vLLM's convention): two values per
    priority class, a higher class lower (``interactive`` −2, ``standard`` 0, ``batch`` 2), and one
    more for a request of a tenant past its fair share by more than its credit (``Admission.past_share``).
    Without tenants every request is 0: first come, first served, as before."""
    return -2 * priority_class + (1 if past_share else 0)


DEFAULT_DEADLINE_S = 600.0
"""Ten minutes: the OpenAI Python client's own default timeout. A request still running then ends
with DEADLINE_EXCEEDED / 504, its KV freed on every worker."""


@dataclass(frozen=True)
class DispatchConfig:
    mode: Literal["disaggregated", "colocated"] = "disaggregated"
    local_prefill_tokens: int = 32
    """Prompts with at most this many uncached tokens are prefilled on the decode worker."""
    max_prefill_attempts: int = 3
    """Prefill workers a request may try (the decode worker moves on after a retryable failure)."""
    kv_backend: str = ""
    """KV transport to ask decode workers for ("" = each worker's default)."""
    default_deadline_s: float = DEFAULT_DEADLINE_S
    """The deadline of a request that brings none of its own (``--request-timeout-s``)."""
    max_worker_attempts: int = 2
    """Decode (or colocated) workers a request may be placed on when one fails it before anything came back."""

    def __post_init__(self) -> None:
        if self.default_deadline_s <= 0 or self.max_worker_attempts < 1:
            raise ValueError("default_deadline_s must be > 0 and max_worker_attempts >= 1")


@dataclass(slots=True)
class Placement:
    """Where one disaggregated request goes, decided before anything is sent: its decode worker (and
    the KV booked there), the prefill workers ranked best first with the prompt tokens each holds,
    and the order the decode worker gets."""

    decode: WorkerHandle
    reservation: Reservation | None
    prefill: list[tuple[WorkerHandle, int]]
    order: ServeOrder


class ServeCall:
    """One ``Serve`` call of a placement: what its prefill report settles (the best prefill worker
    is charged with the prompt until the report arrives), and how a failure reads."""

    __slots__ = ("answered", "charge", "charged", "dispatcher", "failed_role", "ok", "priority", "request", "span")

    def __init__(self, dispatcher: DispatchCore, request: RouterRequest, placement: Placement) -> None:
        self.dispatcher = dispatcher
        self.request = request
        self.answered = False
        self.ok = False
        """The call finished the request."""
        self.failed_role = "decode"
        self.span: Any = None
        """The call's span, when traced."""
        self.charged: WorkerHandle | None = None
        self.charge: PrefillCharge | None = None
        self.priority = placement.order.priority
        if placement.prefill:
            tokens = len(request.prompt_token_ids)
            self.charged, cached = placement.prefill[0]
            dispatcher.stats.placed(self.charged.worker_id, tokens, cached)
            self.charge = self.charged.charge_prefill(tokens, cached, self.priority)
            for handle, _ in placement.prefill:
                handle.breaker.on_attempt()

    def settle(self) -> None:
        if self.charged is not None and self.charge is not None:
            self.charged.settle_prefill(self.charge)
        self.charged = self.charge = None

    def on_report(self, report: PrefillReport) -> None:
        self.answered = True
        if report.all_failed:
            self.failed_role = "prefill"
        self.settle()
        self.dispatcher._on_report(report, self.request)
        if self.span is not None:
            self.dispatcher._reported(self.span, report)


class _Lookup:
    """One request's prefix-index lookup, started early (``DispatchCore._early_lookup``)."""

    __slots__ = ("dispatcher", "pending", "start", "workers")

    def __init__(self, dispatcher: DispatchCore, pending: PendingLookup,
                 workers: list[tuple[WorkerId, Epoch]], start: float) -> None:
        self.dispatcher = dispatcher
        self.pending = pending
        self.workers = workers
        self.start = start

    async def cached_tokens(self) -> dict[WorkerId, int]:
        """Per candidate, the prompt tokens its prefix cache holds; {} when the index cannot be read
        (placement then goes by load alone)."""
        d = self.dispatcher
        try:
            held = await self.pending.matched_blocks(self.workers)
        except (RedisError, OSError) as exc:
            if d.index_ok:
                log.warning("prefix index unreachable (%s): placing by load alone", exc)
            d.index_ok = False
            d.stats.index_errors += 1
            return {}
        if not d.index_ok:
            log.info("prefix index reachable again")
        d.index_ok = True
        d.stats.lookup_seconds += time.perf_counter() - self.start
        d.stats.lookups += 1
        block_size = d.model.block_size
        return {w: blocks * block_size for w, blocks in held.items()}


@mypyc_attr(allow_interpreted_subclasses=True)  # PoolDispatcher (dispatch.py) adds the worker calls
class DispatchCore:
    """What ``PoolDispatcher`` decides before and around its worker call: admission and booking,
    the prefix look-up, placement, the ``ServeOrder``, retries on another worker, spans."""

    def __init__(self, pool: WorkerPool, model: ModelInfo, config: DispatchConfig | None = None,
                 policy: PlacementPolicy | None = None, prefix_index: PrefixIndex | None = None,
                 admission: Admission | None = None, hash_seed: int | str | bytes = 0,
                 metrics: RouterMetrics | None = None, tracing: Tracing | None = None) -> None:
        """``tracing``: the router's tracer, for the spans of requests that carry one (``RouterRequest.trace``)."""
        self.pool = pool
        self.tracing = tracing
        self.model = model
        self.config = config or DispatchConfig()
        self.prefix_index = prefix_index
        self.admission = admission
        self.metrics = metrics
        self.policy = policy or (CacheAware() if prefix_index is not None else LeastLoaded())
        self.hasher = BlockHasher(model.block_size, hash_seed)
        self.index_ok = prefix_index is not None
        self.admission_ok = admission is not None
        self.stats = TransferStats(metrics, self.config.kv_backend or "tcp")
        self._background = BackgroundTasks()  # a release's failure: its lease expires on its own

    def models(self) -> list[ModelInfo]:
        return [self.model]

    # -- helpers ------------------------------------------------------------------------------
    def _timeout(self, request: RouterRequest) -> float:
        assert request.deadline is not None  # given in generate
        left = request.deadline - time.monotonic()
        if left <= 0:
            raise DeadlineExceededError(f"request {request.request_id} passed its deadline")
        return left

    def _retry_elsewhere(self, handle: WorkerHandle, tried: set[WorkerId], role: WorkerRole) -> bool:
        """After ``handle`` failed a request before anything came back: may it go to another worker?"""
        tried.add(handle.worker_id)
        if len(tried) >= self.config.max_worker_attempts:
            return False
        if not any(h.worker_id not in tried for h in self.pool.available(role)):
            return False
        self.stats.worker_retries += 1
        log.info("%s worker %s failed before answering; placing the request on another", role.value,
                 handle.worker_id)
        return True

    def _blocks_needed(self, request: RouterRequest) -> int:
        return blocks_for_tokens(len(request.prompt_token_ids) + request.sampling.max_tokens, self.model.block_size)

    def _unbook(self, reservation: Reservation) -> None:
        """Give a request's KV booking back; one that needs Redis goes on in the background."""
        assert self.admission is not None
        task = self.admission.release_soon(reservation)
        if task is not None:
            self._background.spawn(task, name=f"unbook-{reservation.booking_id}")

    async def drain(self, timeout: float = 15.0) -> None:
        """Wait for outstanding releases (shutdown); cancel what is still running after ``timeout``.

        A cancelled release is not lost: the decode worker's lease and the Redis booking's lease
        both expire on their own.
        """
        if not self._background:
            return
        _, pending = await asyncio.wait(set(self._background), timeout=timeout)
        if pending:
            log.warning("shutdown: %d background release(s) still running after %.1fs; cancelled: %s",
                        len(pending), timeout, sorted(t.get_name() for t in pending))
            for task in pending:
                task.cancel()
            await asyncio.wait(pending, timeout=1.0)

    def _early_lookup(self, request: RouterRequest,
                      candidates: Sequence[WorkerHandle] | None = None) -> _Lookup | None:
        """Start the prefix-index lookup of ``request`` among ``candidates`` (default: the prefill
        workers available) now, to run while admission books; None when it needs none.

        Only for prompts that can hit (one block or more); by default only for those that may need
        the prefill pool (longer than ``local_prefill_tokens``). The lookup never raises
        (``_Lookup.cached_tokens`` degrades to {}); one the request does not use (a local prefill,
        an early error) is left unread.
        """
        n = len(request.prompt_token_ids)
        if self.prefix_index is None or n < self.model.block_size:
            return None
        if candidates is None:
            if not may_prefill_remotely(n, self.config.local_prefill_tokens):
                return None
            candidates = self.pool.available(WorkerRole.PREFILL)
        if not candidates:
            return None
        start = time.perf_counter()
        hashes = self.hasher.hash_packed(request.prompt_token_bytes, self.hasher.salted_root(request.cache_salt))
        workers = [(h.worker_id, h.record.epoch) for h in candidates]
        return _Lookup(self, self.prefix_index.lookup_soon(hashes), workers, start)

    # -- tracing (only for requests with a span) ---------------------------------------------
    def _span(self, name: str, request: RouterRequest, attributes: dict[str, object] | None = None,
              kind: object = None) -> Any:
        assert self.tracing is not None
        return self.tracing.span(name, request.trace, attributes, kind)

    def _failed(self, span: Any, exc: BaseException) -> None:
        assert self.tracing is not None
        self.tracing.failed(span, exc)
        span.end()

    def _call_metadata(self, request: RouterRequest, span: Any = None) -> list[tuple[str, str]] | None:
        """The trace context a worker call carries (its own span's, else the request's); None untraced."""
        if request.trace is None or self.tracing is None:
            return None
        return list(self.tracing.headers(span if span is not None else request.trace).items())

    @staticmethod
    def _placed(span: Any, decode: WorkerHandle, routes: Sequence[tuple[WorkerHandle, int]]) -> None:
        """The placement's span gets where the request goes and how much of its prompt is cached there."""
        cached = routes[0][1] if routes else 0
        span.set_attribute("pdrouter.decode_worker", decode.worker_id)
        span.set_attribute("pdrouter.prefill_workers", [h.worker_id for h, _ in routes])
        span.set_attribute("pdrouter.prefix_cached_tokens", cached)
        span.set_attribute("pdrouter.local_prefill", not routes)
        span.end()

    @staticmethod
    def _reported(span: Any, report: PrefillReport) -> None:
        """The worker call's span gets the decode worker's prefill report (who computed the prompt,
        the prefix depth it found, the KV transfer)."""
        for name, value in (("pdrouter.prefill_worker", report.worker_id), ("pdrouter.local_prefill", report.local),
                            ("pdrouter.cached_tokens", report.cached_tokens),
                            ("pdrouter.decode_cached_tokens", report.decode_cached_tokens),
                            ("pdrouter.kv.bytes", report.bytes_sent), ("pdrouter.kv.transfer_ms", report.transfer_ms),
                            ("pdrouter.prefill_failures", len(report.failures))):
            span.set_attribute(name, value)

    def _first_token(self, request: RouterRequest) -> None:
        """The span from the request's arrival to its first token (its span's start to now)."""
        assert self.tracing is not None
        root = request.trace
        span = self.tracing.span("first_token", root, start_time_ns=getattr(root, "start_time", None))
        span.end()

    # -- disaggregated ------------------------------------------------------------------------
    async def _admit(self, request: RouterRequest, role: WorkerRole,
                     tried: Collection[WorkerId] = ()) -> tuple[WorkerHandle, Reservation | None, int]:
        """Pick the decode (or colocated) worker, not one of ``tried``; with admission, book its KV first.
        Also returns the request's ``engine_priority``.

        A colocated worker computes the prompt too, so its prefix cache counts: with the cache-aware
        policy, the worker prefill placement would pick (``_holder``) is booked whenever it has room."""
        candidates = self.pool.available(role)
        if tried:
            candidates = [h for h in candidates if h.worker_id not in tried]
        blocks = self._blocks_needed(request)
        prefer = await self._holder(request, candidates) if role is WorkerRole.COLOCATED else None
        if self.admission is None:
            if prefer is not None and prefer.load.free_blocks >= blocks:
                return prefer, None, engine_priority(request.priority, False)
            return self.policy.pick_decode(request, candidates, blocks), None, engine_priority(request.priority, False)
        if not candidates:
            raise UnavailableError(f"no {role.value} worker is available (none registered, or all failing)")
        by_id = {h.worker_id: h for h in candidates}
        caps = [DecodeCapacity(h.worker_id, h.record.epoch, h.record.capacity_blocks) for h in candidates]
        tenant = request.tenant
        span = None if request.trace is None else self._span("admission", request, {"pdrouter.kv_blocks": blocks})
        start = time.perf_counter()
        try:
            reservation = await self.admission.admit(
                request.request_id, blocks, caps, priority=request.priority, deadline=request.deadline,
                prefer=None if prefer is None else prefer.worker_id,
                flow=None if tenant is None else tenant.name, weight=1.0 if tenant is None else tenant.weight)
        except (RedisError, OSError) as exc:
            if span is not None:
                span.end()
            return (self._without_admission(request, candidates, blocks, exc), None,
                    engine_priority(request.priority, False))
        except BaseException as exc:
            if span is not None:
                self._failed(span, exc)
            raise
        waited = time.perf_counter() - start
        if span is not None:
            span.set_attribute("pdrouter.decode_worker", reservation.worker_id)
            span.set_attribute("pdrouter.queue_wait_ms", waited * 1e3)
            span.end()
        if not self.admission_ok:
            log.info("KV admission available again")
        self.admission_ok = True
        past = tenant is not None and self.admission.past_share(tenant.name, request.priority)
        if self.metrics is not None:
            self.metrics.observe_queue_time(waited, None if tenant is None else tenant.name, past)
        return by_id[reservation.worker_id], reservation, engine_priority(request.priority, past)

    async def _holder(self, request: RouterRequest, candidates: Sequence[WorkerHandle]) -> WorkerHandle | None:
        """The colocated worker to prefer for ``request``: the cache-aware policy's pick among those
        holding a prefix of it worth placing by (``min_hit_tokens`` or more), or None.

        One prefix-index lookup (a Redis round trip) before admission, for prompts long enough to
        hold such a prefix; shorter ones, and a pool of one worker, cost nothing."""
        if not isinstance(self.policy, CacheAware) or len(candidates) < 2 or \
                len(request.prompt_token_ids) < self.policy.config.min_hit_tokens:
            return None
        lookup = self._early_lookup(request, candidates)  # None: a prompt under a block cannot hit
        cached = {} if lookup is None else await lookup.cached_tokens()
        if max(cached.values(), default=0) < self.policy.config.min_hit_tokens:
            return None
        return self.policy.pick_prefill(request, candidates, cached)

    def _without_admission(self, request: RouterRequest, candidates: Sequence[WorkerHandle], blocks: int,
                           exc: BaseException) -> WorkerHandle:
        """Redis could not book the request: refuse it (``fail``), or place it by load alone (``local``).

        ``local`` serves without shared admission: routers may then book past a worker's pool, which
        the decode worker still guards itself (it refuses what does not fit, RESOURCE_EXHAUSTED).
        """
        assert self.admission is not None
        local = self.admission.config.on_redis_error == "local"
        self.stats.admission_redis_errors["local" if local else "refused"] += 1
        if self.admission_ok:
            log.warning("KV admission unavailable (Redis: %s): %s", exc,
                        "placing decode by load alone" if local else "refusing requests until Redis answers")
        self.admission_ok = False
        if not local:
            # The client is told what and when, not where: Redis's address stays in the router's log.
            raise UnavailableError("KV admission is unavailable: the router cannot reach Redis now; retry later")
        return self.policy.pick_decode(request, candidates, blocks)

    def _prefill_routes(self, request: RouterRequest, cached_tokens: dict[WorkerId, int],
                        priority: int | None) -> list[tuple[WorkerHandle, int]]:
        """Prefill workers to try, best first (up to ``max_prefill_attempts``), with their cached tokens;
        ``priority``: the prompt's engine priority (a worker's backlog counts what it would wait for)."""
        candidates = list(self.pool.available(WorkerRole.PREFILL))
        if len(candidates) == 1:
            return [(candidates[0], cached_tokens.get(candidates[0].worker_id, 0))]
        ranked: list[tuple[WorkerHandle, int]] = []
        while candidates and len(ranked) < self.config.max_prefill_attempts:
            # A policy picks the one candidate left (it mutates nothing): no need to ask it.
            handle = candidates[0] if len(candidates) == 1 else \
                self.policy.pick_prefill(request, candidates, cached_tokens, priority)
            candidates.remove(handle)
            ranked.append((handle, cached_tokens.get(handle.worker_id, 0)))
        return ranked

    def _on_report(self, report: PrefillReport, request: RouterRequest) -> None:
        """What the decode worker says of the prompt's computation: the prefill workers' breakers, and stats."""
        for failure in report.failures:
            failed = self.pool.get(WorkerId(failure.worker_id))
            if failed is not None and failure.code in ("UNAVAILABLE", "DEADLINE_EXCEEDED"):
                failed.breaker.on_failure()
            log.warning("prefill of %s on %s failed (%s: %s)", request.request_id, failure.worker_id,
                        failure.code, failure.message)
        if report.worker_id and not report.local:
            served = self.pool.get(WorkerId(report.worker_id))
            if served is not None:
                served.breaker.on_success()
        self.stats.reported(report)

    async def _place(self, request: RouterRequest, tried: Collection[WorkerId],
                     lookup: _Lookup | None, before: Placement | None) -> Placement:
        """Decide where ``request`` goes: admit it on a decode worker (not one of ``tried``), then (the
        first time; a placement on another decode worker keeps them) rank the prefill workers by the
        prefix ``lookup``'s answer and write the order. Nothing is sent."""
        decode, reservation, priority = await self._admit(request, WorkerRole.DECODE, tried)
        decode.inflight += 1  # from its admission on: the sender takes it off when the call ends
        if before is not None:
            return Placement(decode, reservation, before.prefill, before.order)
        try:
            placing = None if request.trace is None else self._span("placement", request)
            ranked: list[tuple[WorkerHandle, int]] = []
            if may_prefill_remotely(len(request.prompt_token_ids), self.config.local_prefill_tokens):
                cached_tokens = await lookup.cached_tokens() if lookup is not None else {}
                # Without tenants every priority is 0: placement by the whole backlog, at no extra cost.
                ranked = self._prefill_routes(request, cached_tokens, None if request.tenant is None else priority)
        except BaseException:
            decode.inflight -= 1
            if reservation is not None and self.admission is not None:
                self._unbook(reservation)
            raise
        order = ServeOrder(
            request_id=request.request_id, prompt_token_ids=request.prompt_token_ids,
            sampling=request.sampling, model_compat_hash=self.pool.model_compat_hash,
            backend=self.config.kv_backend, local_prefill_tokens=self.config.local_prefill_tokens,
            routes=[PrefillRoute(worker_id=h.worker_id, address=h.record.address,
                                 lane_address=h.record.lane_address if h.lane is not None else "",
                                 cached_tokens=cached)
                    for h, cached in ranked],
            whole=request.whole, cache_salt=request.cache_salt, priority=priority,
            prompt_token_bytes=request.prompt_token_bytes)
        if placing is not None:
            self._placed(placing, decode, ranked)
        return Placement(decode, reservation, ranked, order)
