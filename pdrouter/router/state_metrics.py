"""Metrics of the router's shared state: the prefix index, KV admission and Redis itself.

Read at scrape time from the dispatcher's and admission's counters, and from Redis by a
periodic ``refresh`` (index sizes, booked blocks), so the hot path pays nothing for them.

* ``pdrouter_redis_up`` — 1 while the router reaches Redis: its last periodic read of it (the
  refresh here, and the worker pool's registry read) succeeded and no request has failed to reach
  it since. It returns to 1 at the first refresh after Redis does, whatever requests arrive.
* ``pdrouter_worker_retries_total`` — requests placed on another decode (or colocated) worker
  after one failed them before answering.
* ``pdrouter_prefix_lookup_seconds_total`` / ``pdrouter_prefix_lookups_total`` — index lookups.
* ``pdrouter_prefix_index_blocks{worker}`` — blocks each prefill worker has in the index.
* ``pdrouter_prefix_match_tokens_total{worker}`` / ``pdrouter_prefix_placed_tokens_total{worker}``
  — per worker, prompt tokens placed on it and the part its cache held (the match share).
* ``pdrouter_kv_reserved_blocks{worker}`` / ``pdrouter_kv_capacity_blocks{worker}`` — the KV
  water level per decode worker, as booked in Redis.
* ``pdrouter_admission_queue_length``, ``pdrouter_admission_wait_seconds_total``,
  ``pdrouter_admission_admitted_total``, ``pdrouter_admission_admitted_on_credit_total``,
  ``pdrouter_admission_credit_blocks``, ``pdrouter_admission_credit_yields_total``,
  ``pdrouter_admission_rejections_total{reason}``.
* ``pdrouter_admission_redis_errors_total{outcome}`` — bookings that failed because Redis could not
  be reached: ``outcome="refused"`` (the request got UNAVAILABLE / 503) or ``outcome="local"``
  (placed by load alone, without shared admission; ``--admission-on-redis-error local``).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector
from redis.exceptions import RedisError

from pdrouter.core.workers import WorkerRole
from pdrouter.router.dispatch import PoolDispatcher

log = logging.getLogger(__name__)


class StateMetrics(Collector):
    """A prometheus_client collector over one router's dispatcher, admission and pool."""

    def __init__(self, dispatcher: PoolDispatcher) -> None:
        self.dispatcher = dispatcher
        self.index_blocks: dict[str, int] = {}
        self.reserved_blocks: dict[str, tuple[int, int]] = {}
        self.redis_up = 1 if dispatcher.prefix_index is not None or dispatcher.admission is not None else 0
        self._failures_seen = 0
        """The request path's Redis failures counted at the last refresh that reached Redis."""

    def _redis_failures(self) -> int:
        stats = self.dispatcher.stats
        return stats.index_errors + sum(stats.admission_redis_errors.values())

    async def refresh(self) -> None:
        """Read index sizes and booked blocks from Redis (called every few seconds)."""
        orch = self.dispatcher
        failures = self._redis_failures()
        try:
            if orch.prefix_index is not None:
                self.index_blocks = {h.worker_id: await orch.prefix_index.size(h.worker_id, h.record.epoch)
                                     for h in orch.pool.workers(WorkerRole.PREFILL)}
            if orch.admission is not None:
                res = orch.admission.reservations
                roles = (WorkerRole.DECODE, WorkerRole.COLOCATED)
                self.reserved_blocks = {h.worker_id: (await res.used(h.worker_id, h.record.epoch),
                                                      h.record.capacity_blocks)
                                        for role in roles for h in orch.pool.workers(role)}
            reached = orch.pool.registry_ok or orch.pool.registry is None
            self.redis_up = 1 if (orch.prefix_index or orch.admission) and reached else 0
            if self.redis_up:
                self._failures_seen = failures
        except (RedisError, OSError) as exc:
            log.debug("state metrics refresh failed: %s", exc)
            self.redis_up = 0

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        orch = self.dispatcher
        stats = orch.stats
        up = self.redis_up and self._redis_failures() == self._failures_seen
        yield GaugeMetricFamily("pdrouter_redis_up", "1 while the router's shared state in Redis is reachable.",
                                value=1 if up else 0)
        yield CounterMetricFamily("pdrouter_worker_retries",
                                  "Requests placed on another decode or colocated worker after one failed them "
                                  "before answering.", value=stats.worker_retries)
        yield CounterMetricFamily("pdrouter_prefix_lookups", "Prefix index lookups.", value=stats.lookups)
        yield CounterMetricFamily("pdrouter_prefix_lookup_seconds", "Time spent in prefix index lookups.",
                                  value=stats.lookup_seconds)
        yield CounterMetricFamily("pdrouter_prefix_lookup_errors", "Lookups that failed (Redis unreachable).",
                                  value=stats.index_errors)
        blocks = GaugeMetricFamily("pdrouter_prefix_index_blocks", "Blocks a prefill worker has in the index.",
                                   labels=["worker"])
        for worker, n in sorted(self.index_blocks.items()):
            blocks.add_metric([worker], n)
        yield blocks
        match = CounterMetricFamily("pdrouter_prefix_match_tokens",
                                    "Prompt tokens the chosen prefill worker held in its cache (index view).",
                                    labels=["worker"])
        placed = CounterMetricFamily("pdrouter_prefix_placed_tokens", "Prompt tokens placed on a prefill worker.",
                                     labels=["worker"])
        for worker in sorted(stats.placed_tokens):
            match.add_metric([worker], stats.match_tokens.get(worker, 0))
            placed.add_metric([worker], stats.placed_tokens[worker])
        yield match
        yield placed
        reserved = GaugeMetricFamily("pdrouter_kv_reserved_blocks", "KV blocks booked on a decode worker.",
                                     labels=["worker"])
        capacity = GaugeMetricFamily("pdrouter_kv_capacity_blocks", "KV blocks a decode worker holds in all.",
                                     labels=["worker"])
        for worker, (used, cap) in sorted(self.reserved_blocks.items()):
            reserved.add_metric([worker], used)
            capacity.add_metric([worker], cap)
        yield reserved
        yield capacity
        adm = orch.admission
        if adm is not None:
            yield GaugeMetricFamily("pdrouter_admission_queue_length", "Requests waiting for KV room.",
                                    value=adm.queue_length)
            yield CounterMetricFamily("pdrouter_admission_admitted", "Requests admitted.", value=adm.stats.admitted)
            yield CounterMetricFamily("pdrouter_admission_admitted_on_credit",
                                      "Requests admitted from this router's booked credit (no Redis round trip).",
                                      value=adm.stats.admitted_on_credit)
            yield GaugeMetricFamily("pdrouter_admission_credit_blocks",
                                    "KV blocks this router has booked ahead as credit (used or not).",
                                    value=adm.credit_blocks)
            yield CounterMetricFamily("pdrouter_admission_credit_yields",
                                      "Times another router had a request waiting for room and this router "
                                      "gave back its unused credit.", value=adm.credit_requests_heard)
            yield CounterMetricFamily("pdrouter_admission_wait_seconds", "Time requests waited for KV room.",
                                      value=adm.stats.wait_seconds_total)
            rejected = CounterMetricFamily("pdrouter_admission_rejections", "Requests refused by admission.",
                                           labels=["reason"])
            for reason in ("queue_full", "timeout", "too_large"):
                rejected.add_metric([reason], adm.stats.rejections.get(reason, 0))
            yield rejected
        if adm is not None:
            errors = CounterMetricFamily("pdrouter_admission_redis_errors",
                                         "Bookings that failed because Redis could not be reached, by what "
                                         "happened to the request (refused, or placed locally by load alone).",
                                         labels=["outcome"])
            for outcome, n in sorted(stats.admission_redis_errors.items()):
                errors.add_metric([outcome], n)
            yield errors
