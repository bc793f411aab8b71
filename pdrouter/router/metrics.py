"""The router's Prometheus metrics, on a registry owned by one router (never the process default).

Front doors record what a client sees (time to first token, inter-token latency, end-to-end
latency, outcome, tokens); the dispatcher records what happens behind them (queue time, worker
load; KV transfers and prefix-cache hits from a decode worker's prefill report, through
``pdrouter.router.transfer_stats.TransferStats.reported``) through the small ``observe_*`` / ``set_*``
methods below.

Every name starts with ``pdrouter_`` and carries its unit (``_seconds``, ``_bytes``, ``_tokens``);
counters end in ``_total``. Label sets are small and bounded: ``frontdoor`` (``http`` | ``grpc``),
``outcome`` (see :func:`outcome_of`), ``worker`` and ``role`` for per-worker gauges (``direction``,
``sent`` | ``received``, for their KV bytes), ``backend`` for KV transfers, ``code`` (a gRPC status
name) for failed prefill attempts, ``tenant`` (a name from the tenants file, or ``default``: never a
key) and ``reason`` (a limit's name, or admission's ``queue_full`` / ``timeout`` / ``capacity``) for
the per-tenant metrics (:class:`TenantMetrics`, only on a router with a tenants file).
"""

from __future__ import annotations

import asyncio
import bisect
import contextlib
import functools
from collections.abc import Callable, Iterable
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from prometheus_client.values import MutexValue

from pdrouter.core import build
from pdrouter.core.errors import (
    CancelledError,
    CapacityError,
    DeadlineExceededError,
    FailedPreconditionError,
    InvalidRequestError,
    NotFoundError,
    UnavailableError,
)

METRICS_CONTENT_TYPE = CONTENT_TYPE_LATEST

OUTCOMES = ("ok", "invalid", "not_found", "capacity", "unavailable", "deadline", "cancelled", "error")

# Latency buckets: the router's own overhead is sub-millisecond, generation runs to minutes.
_TTFT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75,
                 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0)
_ITL_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1,
                0.15, 0.2, 0.3, 0.5, 1.0, 2.5)
_E2E_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 60.0, 120.0, 300.0,
                600.0)
_QUEUE_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
                  30.0, 60.0)
_TRANSFER_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)


def outcome_of(exc: BaseException | None) -> str:
    """The ``outcome`` label for a request that ended with ``exc`` (None: it succeeded)."""
    if exc is None:
        return "ok"
    if isinstance(exc, InvalidRequestError | FailedPreconditionError):
        return "invalid"
    if isinstance(exc, NotFoundError):
        return "not_found"
    if isinstance(exc, CapacityError):
        return "capacity"
    if isinstance(exc, UnavailableError):
        return "unavailable"
    if isinstance(exc, DeadlineExceededError):
        return "deadline"
    if isinstance(exc, CancelledError | asyncio.CancelledError):
        return "cancelled"
    return "error"


class _PlainValue:
    """A metric value without a lock. prometheus_client guards every value with a mutex; the
    router updates and scrapes its per-request metrics on its event loop's thread alone, where
    the lock is pure cost (about ten acquisitions per request)."""

    __slots__ = ("_value",)

    def __init__(self, value: float = 0.0) -> None:
        self._value = value

    def inc(self, amount: float = 1.0) -> None:
        self._value += amount

    def set(self, value: float, timestamp: float | None = None) -> None:
        self._value = value

    def set_exemplar(self, exemplar: Any) -> None:
        pass

    def get(self) -> float:
        return self._value

    def get_exemplar(self) -> None:
        return None


def _unlocked(child: Any) -> Any:
    """``child`` (a labelled counter, gauge or histogram) with plain values, when it has the
    values this prometheus_client version is known to have; else unchanged."""
    for attr in ("_value", "_sum"):
        value = getattr(child, attr, None)
        if type(value) is MutexValue:
            setattr(child, attr, _PlainValue(value.get()))
    buckets = getattr(child, "_buckets", None)
    if buckets and all(type(b) is MutexValue for b in buckets):
        child._buckets = [_PlainValue(b.get()) for b in buckets]
    return child


class _FastCount:
    """``inc`` (and a gauge's ``dec``) of a labelled counter or gauge, made lock-free (``_unlocked``) and
    bound straight to its value: prometheus_client's own ``inc`` checks each amount and its exemplar
    first, about a microsecond a call, and the router calls five of them per request. The amounts
    here are never negative (token counts, one request); a child whose value could not be made plain
    keeps its own methods. A counter has no ``dec``, as in prometheus_client."""

    __slots__ = ("dec", "inc")
    inc: Callable[..., None]
    dec: Callable[..., None]

    def __init__(self, child: Any) -> None:
        child = _unlocked(child)
        value: Any = getattr(child, "_value", None)
        plain = type(value) is _PlainValue
        self.inc = value.inc if plain else child.inc
        if hasattr(child, "dec"):
            self.dec = functools.partial(value.inc, -1.0) if plain else child.dec


class _FastHistogram:
    """``observe`` for a labelled histogram: a binary search for the bucket instead of a scan."""

    __slots__ = ("_bounds", "_buckets", "_sum", "observe")

    def __init__(self, child: Any) -> None:
        self._bounds: list[float] = list(getattr(child, "_upper_bounds", ()))
        self._buckets: Any = getattr(child, "_buckets", None)
        self._sum: Any = getattr(child, "_sum", None)
        plain = isinstance(self._sum, _PlainValue) and self._buckets is not None and \
            len(self._buckets) == len(self._bounds) and self._bounds and self._bounds[-1] == float("inf")
        self.observe: Callable[[float], None] = self._observe if plain else child.observe

    def _observe(self, amount: float) -> None:
        self._sum.inc(amount)
        self._buckets[bisect.bisect_left(self._bounds, amount)].inc(1)


class FrontdoorMetrics:
    """The children of one front door's metrics, resolved once so the hot path skips label lookups."""

    def __init__(self, metrics: RouterMetrics, frontdoor: str) -> None:
        self.ttft = _FastHistogram(_unlocked(metrics.ttft_seconds.labels(frontdoor)))
        self.itl = _FastHistogram(_unlocked(metrics.inter_token_latency_seconds.labels(frontdoor)))
        self.e2e = _FastHistogram(_unlocked(metrics.request_duration_seconds.labels(frontdoor)))
        self.in_flight = _FastCount(metrics.requests_in_flight.labels(frontdoor))
        self.prompt_tokens = _FastCount(metrics.prompt_tokens_total.labels(frontdoor))
        self.generation_tokens = _FastCount(metrics.generation_tokens_total.labels(frontdoor))
        self._outcomes = {o: _FastCount(metrics.requests_total.labels(frontdoor, o)) for o in OUTCOMES}

    def finished(self, exc: BaseException | None, duration_s: float) -> None:
        """Count one finished request by outcome and, when it succeeded, observe its latency."""
        self._outcomes[outcome_of(exc)].inc()
        if exc is None:
            self.e2e.observe(duration_s)


class TenantFamilies:
    """The per-tenant metrics (registered only on a router with tenants)."""

    def __init__(self, r: CollectorRegistry) -> None:
        self.tenant_requests_total = Counter(
            "pdrouter_tenant_requests_total", "Finished requests per tenant and outcome (refusals by the "
            "tenant's limits included).", ["tenant", "outcome"], registry=r)
        self.tenant_prompt_tokens_total = Counter(
            "pdrouter_tenant_prompt_tokens_total", "Prompt tokens of each tenant's requests that passed its limits.",
            ["tenant"], registry=r)
        self.tenant_generation_tokens_total = Counter(
            "pdrouter_tenant_generation_tokens_total", "Tokens the workers generated for each tenant.",
            ["tenant"], registry=r)
        self.tenant_rejections_total = Counter(
            "pdrouter_tenant_rejections_total", "Requests refused per tenant: over one of its limits (reason: "
            "the limit) or by KV admission (queue_full, timeout, capacity).", ["tenant", "reason"], registry=r)
        self.tenant_requests_in_flight = Gauge(
            "pdrouter_tenant_requests_in_flight", "Requests of each tenant past its limits and not finished.",
            ["tenant"], registry=r)
        self.tenant_queue_wait_seconds = Histogram(
            "pdrouter_tenant_queue_wait_seconds", "Time a tenant's requests waited for KV admission.",
            ["tenant"], buckets=_QUEUE_BUCKETS, registry=r)
        self.tenant_past_share_total = Counter(
            "pdrouter_tenant_past_share_total", "Requests admitted while their tenant was past its fair share by "
            "more than its credit: they run at a lower engine priority on the workers.", ["tenant"], registry=r)


class TenantCounts:
    """The children of one tenant's metrics, resolved once (no label lookups per request)."""

    __slots__ = ("_outcomes", "_rejections", "_rejections_family", "_tenant", "generation_tokens", "in_flight",
                 "past_share", "prompt_tokens", "queue_wait")

    def __init__(self, metrics: TenantFamilies, tenant: str) -> None:
        self._outcomes = {o: _FastCount(metrics.tenant_requests_total.labels(tenant, o)) for o in OUTCOMES}
        self._rejections_family = metrics.tenant_rejections_total
        self._rejections: dict[str, Any] = {}
        self.prompt_tokens = _FastCount(metrics.tenant_prompt_tokens_total.labels(tenant))
        self.generation_tokens = _FastCount(metrics.tenant_generation_tokens_total.labels(tenant))
        self.in_flight = _FastCount(metrics.tenant_requests_in_flight.labels(tenant))
        self.queue_wait = _FastHistogram(_unlocked(metrics.tenant_queue_wait_seconds.labels(tenant)))
        self.past_share = _unlocked(metrics.tenant_past_share_total.labels(tenant))
        self._tenant = tenant

    def finished(self, exc: BaseException | None, prompt_tokens: int, generation_tokens: int) -> None:
        """One request of the tenant ended (``exc``: how, None when it succeeded)."""
        self._outcomes[outcome_of(exc)].inc()
        self.prompt_tokens.inc(prompt_tokens)
        self.generation_tokens.inc(generation_tokens)

    def rejected(self, reason: str) -> None:
        """One request refused: over one of the tenant's limits (its name), or by admission."""
        child = self._rejections.get(reason)
        if child is None:
            child = self._rejections[reason] = _unlocked(self._rejections_family.labels(self._tenant, reason))
        child.inc()


class RouterMetrics:
    """All of one router's metrics on its own ``CollectorRegistry``."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry(auto_describe=True)
        r = self.registry
        self.ttft_seconds = Histogram(
            "pdrouter_time_to_first_token_seconds",
            "From request arrival at the front door to the first generated token leaving it.",
            ["frontdoor"], buckets=_TTFT_BUCKETS, registry=r)
        self.inter_token_latency_seconds = Histogram(
            "pdrouter_inter_token_latency_seconds",
            "Gap between consecutive stream deltas divided by the tokens the later one carries.",
            ["frontdoor"], buckets=_ITL_BUCKETS, registry=r)
        self.request_duration_seconds = Histogram(
            "pdrouter_request_duration_seconds",
            "End-to-end latency of successful requests, arrival to last token.",
            ["frontdoor"], buckets=_E2E_BUCKETS, registry=r)
        self.requests_total = Counter(
            "pdrouter_requests_total", "Finished requests by front door and outcome.",
            ["frontdoor", "outcome"], registry=r)
        self.requests_in_flight = Gauge(
            "pdrouter_requests_in_flight", "Requests accepted by a front door and not finished yet.",
            ["frontdoor"], registry=r)
        self.prompt_tokens_total = Counter(
            "pdrouter_prompt_tokens_total", "Prompt tokens of requests sent to the dispatcher.",
            ["frontdoor"], registry=r)
        self.generation_tokens_total = Counter(
            "pdrouter_generation_tokens_total", "Tokens generated and streamed to clients.",
            ["frontdoor"], registry=r)
        self.queue_time_seconds = Histogram(
            "pdrouter_queue_time_seconds", "Time a request waited for KV admission on a decode worker.",
            buckets=_QUEUE_BUCKETS, registry=r)
        self.worker_running_requests = Gauge(
            "pdrouter_worker_running_requests", "Requests running on a worker (last heartbeat).",
            ["worker", "role"], registry=r)
        self.worker_waiting_requests = Gauge(
            "pdrouter_worker_waiting_requests",
            "Requests queued in a worker's engine, not running yet (last heartbeat).",
            ["worker", "role"], registry=r)
        self.worker_kv_cache_usage = Gauge(
            "pdrouter_worker_kv_cache_usage_ratio",
            "Fraction of a worker's KV blocks held by requests, 0 to 1 (last heartbeat; vLLM's kv_cache_usage "
            "on a vLLM worker).", ["worker", "role"], registry=r)
        self.worker_queued_prefill_tokens = Gauge(
            "pdrouter_worker_queued_prefill_tokens", "Uncached prompt tokens queued on a worker.",
            ["worker", "role"], registry=r)
        self.worker_free_kv_blocks = Gauge(
            "pdrouter_worker_free_kv_blocks", "Allocatable KV blocks on a worker (free + evictable).",
            ["worker", "role"], registry=r)
        self.worker_info = Gauge(
            "pdrouter_worker_info", "1 for every worker in the pool; what it runs on (cpu, cuda:0, sim:h100-80g…) "
            "and with which engine (torch, sim, vllm) of which version.",
            ["worker", "role", "device", "engine", "version"], registry=r)
        self._worker_devices: dict[tuple[str, str], tuple[str, str, str]] = {}
        self.build_info = Gauge(
            "pdrouter_build_info", "1; the router's pd-router version and how many of its modules run compiled "
            "(0: the sources; the images compile the request path).", ["version", "compiled_modules"], registry=r)
        self.build_info.labels(build.version(), str(build.compiled_modules())).set(1)
        self.worker_sim_modeled_seconds = Gauge(
            "pdrouter_worker_sim_modeled_seconds",
            "A simulated GPU's modeled step time so far, in simulated seconds (last heartbeat; cumulative).",
            ["worker", "role"], registry=r)
        self.worker_sim_late_seconds = Gauge(
            "pdrouter_worker_sim_late_seconds",
            "Simulated seconds by which a simulated GPU's steps ended after their modeled end because this "
            "machine was too slow (last heartbeat; cumulative). Near 0 against the modeled seconds: the "
            "simulated timings hold.", ["worker", "role"], registry=r)
        self.worker_kv_transfer_bytes = Gauge(
            "pdrouter_worker_kv_transfer_bytes",
            "KV bytes a worker sent (prefill) or received into its blocks (decode) since it started "
            "(last heartbeat; cumulative).", ["worker", "role", "direction"], registry=r)
        self.worker_kv_transfer_seconds = Gauge(
            "pdrouter_worker_kv_transfer_seconds",
            "Wall time of a worker's KV transfers since it started, summed (last heartbeat; cumulative).",
            ["worker", "role"], registry=r)
        self.worker_kv_transfer_failures = Gauge(
            "pdrouter_worker_kv_transfer_failures",
            "KV transfers that failed on a worker since it started (last heartbeat; cumulative).",
            ["worker", "role"], registry=r)
        self.kv_transfer_failures_total = Counter(
            "pdrouter_kv_transfer_failures_total",
            "Prefill attempts a decode worker reported failed (the prefill call or its KV transfer), by "
            "gRPC status code; the request went on with the next prefill worker or on the decode worker.",
            ["code"], registry=r)
        self.kv_transfer_bytes_total = Counter(
            "pdrouter_kv_transfer_bytes_total", "KV cache bytes moved from prefill to decode workers.",
            ["backend"], registry=r)
        self.kv_transfer_duration_seconds = Histogram(
            "pdrouter_kv_transfer_duration_seconds", "Duration of one request's KV transfer.",
            ["backend"], buckets=_TRANSFER_BUCKETS, registry=r)
        self._transfer_children: dict[str, tuple[Any, _FastHistogram]] = {}
        self.prefix_query_tokens_total = Counter(
            "pdrouter_prefix_cache_query_tokens_total",
            "Prompt tokens looked up in the prefix index for placement.", registry=r)
        self.prefix_hit_tokens_total = Counter(
            "pdrouter_prefix_cache_hit_tokens_total",
            "Prompt tokens found cached on the chosen prefill worker.", registry=r)
        self.tenant_families: TenantFamilies | None = None
        self._tenants: dict[str, TenantCounts] = {}
        self._frontdoors: dict[str, FrontdoorMetrics] = {}
        # Recorded once per request or placement: no locks (see _PlainValue), binary-search buckets.
        self._queue_time = _FastHistogram(_unlocked(self.queue_time_seconds))
        _unlocked(self.prefix_query_tokens_total)
        _unlocked(self.prefix_hit_tokens_total)

    def frontdoor(self, name: str) -> FrontdoorMetrics:
        """The pre-resolved metrics of front door ``name`` (``http`` or ``grpc``)."""
        found = self._frontdoors.get(name)
        if found is None:
            found = self._frontdoors[name] = FrontdoorMetrics(self, name)
        return found

    def enable_tenants(self, names: Iterable[str]) -> None:
        """Register the per-tenant metrics, with a series for each of ``names`` (a router with
        tenants; without, they are not exported at all)."""
        if self.tenant_families is None:
            self.tenant_families = TenantFamilies(self.registry)
        for name in names:
            self.tenant(name)

    def tenant(self, name: str) -> TenantCounts:
        """The pre-resolved metrics of tenant ``name`` (names come from the tenants file: bounded);
        :meth:`enable_tenants` first."""
        found = self._tenants.get(name)
        if found is None:
            assert self.tenant_families is not None, "enable_tenants first"
            found = self._tenants[name] = TenantCounts(self.tenant_families, name)
        return found

    # -- recorded by the dispatcher ---------------------------------------------------------

    def observe_queue_time(self, seconds: float, tenant: str | None = None, past_share: bool = False) -> None:
        """A request's wait for KV admission (``tenant``: also on its tenant's histogram, and counted
        when it was admitted ``past_share``)."""
        self._queue_time.observe(seconds)
        if tenant is not None and tenant in self._tenants:
            counts = self._tenants[tenant]
            counts.queue_wait.observe(seconds)
            if past_share:
                counts.past_share.inc()

    def set_worker_load(self, worker: str, role: str, *, running: int, queued_prefill_tokens: int,
                        free_blocks: int, device: str = "", sim_modeled_s: float = 0.0,
                        sim_late_s: float = 0.0, waiting: int = 0, kv_usage: float = 0.0, engine: str = "",
                        engine_version: str = "", kv_sent_bytes: int = 0, kv_received_bytes: int = 0,
                        kv_transfer_s: float = 0.0, kv_transfer_failures: int = 0) -> None:
        """Publish a worker's latest load (from its heartbeat) and what it runs on."""
        info = (device, engine, engine_version)
        if self._worker_devices.get((worker, role)) != info:
            old = self._worker_devices.pop((worker, role), None)
            if old is not None:
                with contextlib.suppress(KeyError):
                    self.worker_info.remove(worker, role, *old)
            self._worker_devices[(worker, role)] = info
            self.worker_info.labels(worker, role, *info).set(1)
        self.worker_running_requests.labels(worker, role).set(running)
        self.worker_waiting_requests.labels(worker, role).set(waiting)
        self.worker_kv_cache_usage.labels(worker, role).set(kv_usage)
        self.worker_queued_prefill_tokens.labels(worker, role).set(queued_prefill_tokens)
        self.worker_free_kv_blocks.labels(worker, role).set(free_blocks)
        if device.startswith("sim:"):
            self.worker_sim_modeled_seconds.labels(worker, role).set(sim_modeled_s)
            self.worker_sim_late_seconds.labels(worker, role).set(sim_late_s)
        if role in ("prefill", "decode"):
            self.worker_kv_transfer_bytes.labels(worker, role, "sent").set(kv_sent_bytes)
            self.worker_kv_transfer_bytes.labels(worker, role, "received").set(kv_received_bytes)
            self.worker_kv_transfer_seconds.labels(worker, role).set(kv_transfer_s)
            self.worker_kv_transfer_failures.labels(worker, role).set(kv_transfer_failures)

    def remove_worker(self, worker: str, role: str) -> None:
        """Drop a departed worker's gauges so they stop being exported."""
        for gauge in (self.worker_running_requests, self.worker_waiting_requests, self.worker_kv_cache_usage,
                      self.worker_queued_prefill_tokens, self.worker_free_kv_blocks, self.worker_sim_modeled_seconds,
                      self.worker_sim_late_seconds, self.worker_kv_transfer_seconds, self.worker_kv_transfer_failures):
            with contextlib.suppress(KeyError):
                gauge.remove(worker, role)
        for direction in ("sent", "received"):
            with contextlib.suppress(KeyError):
                self.worker_kv_transfer_bytes.remove(worker, role, direction)
        info = self._worker_devices.pop((worker, role), None)
        if info is not None:
            with contextlib.suppress(KeyError):
                self.worker_info.remove(worker, role, *info)

    def observe_kv_transfer_failure(self, code: str) -> None:
        """One prefill attempt a decode worker reported failed."""
        self.kv_transfer_failures_total.labels(code).inc()

    def observe_kv_transfer(self, nbytes: int, seconds: float, backend: str = "tcp") -> None:
        """One request's KV transfer: its size and how long it took."""
        children = self._transfer_children.get(backend)
        if children is None:
            children = self._transfer_children[backend] = (
                _unlocked(self.kv_transfer_bytes_total.labels(backend)),
                _FastHistogram(_unlocked(self.kv_transfer_duration_seconds.labels(backend))))
        children[0].inc(nbytes)
        children[1].observe(seconds)

    def observe_prefix_match(self, prompt_tokens: int, hit_tokens: int) -> None:
        """A placement decision: ``hit_tokens`` of ``prompt_tokens`` were cached on the chosen worker."""
        self.prefix_query_tokens_total.inc(prompt_tokens)
        self.prefix_hit_tokens_total.inc(hit_tokens)

    def exposition(self) -> bytes:
        """The Prometheus text format of every metric on this registry."""
        return generate_latest(self.registry)
