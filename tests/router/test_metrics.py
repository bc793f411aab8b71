"""The router's Prometheus metrics: names, per-router registries, the dispatcher's API."""

from __future__ import annotations

import asyncio

import pytest

from pdrouter.core.errors import (
    CancelledError,
    CapacityError,
    DeadlineExceededError,
    IncompatibleError,
    NotFoundError,
    PromptTooLongError,
    RequestTooLargeError,
    TransferError,
)
from pdrouter.router.metrics import RouterMetrics, outcome_of


def test_two_routers_in_one_process_have_separate_registries() -> None:
    first, second = RouterMetrics(), RouterMetrics()
    first.frontdoor("http").finished(None, 0.5)
    assert first.registry.get_sample_value(
        "pdrouter_requests_total", {"frontdoor": "http", "outcome": "ok"}) == 1
    assert second.registry.get_sample_value(
        "pdrouter_requests_total", {"frontdoor": "http", "outcome": "ok"}) is None


def test_metric_names_carry_prefix_and_unit() -> None:
    metrics = RouterMetrics()
    names = {m.name for m in metrics.registry.collect()}
    assert names == {
        "pdrouter_time_to_first_token_seconds", "pdrouter_inter_token_latency_seconds",
        "pdrouter_request_duration_seconds", "pdrouter_requests", "pdrouter_requests_in_flight",
        "pdrouter_prompt_tokens", "pdrouter_generation_tokens", "pdrouter_queue_time_seconds",
        "pdrouter_worker_running_requests", "pdrouter_worker_waiting_requests",
        "pdrouter_worker_kv_cache_usage_ratio", "pdrouter_worker_queued_prefill_tokens",
        "pdrouter_worker_free_kv_blocks", "pdrouter_worker_info", "pdrouter_build_info",
        "pdrouter_worker_sim_modeled_seconds",
        "pdrouter_worker_sim_late_seconds", "pdrouter_worker_kv_transfer_bytes",
        "pdrouter_worker_kv_transfer_seconds", "pdrouter_worker_kv_transfer_failures",
        "pdrouter_kv_transfer_failures", "pdrouter_kv_transfer_bytes",
        "pdrouter_kv_transfer_duration_seconds", "pdrouter_prefix_cache_query_tokens",
        "pdrouter_prefix_cache_hit_tokens",
    }  # counters are collected without their "_total" suffix
    exposition = metrics.exposition().decode()
    assert "# TYPE pdrouter_kv_transfer_bytes_total counter" in exposition
    assert "# TYPE pdrouter_requests_total counter" in exposition


def test_failed_requests_are_counted_but_not_timed() -> None:
    metrics = RouterMetrics()
    door = metrics.frontdoor("grpc")
    assert metrics.frontdoor("grpc") is door
    door.finished(CapacityError("full"), 2.0)
    door.finished(None, 0.25)
    r = metrics.registry
    assert r.get_sample_value("pdrouter_requests_total", {"frontdoor": "grpc", "outcome": "capacity"}) == 1
    assert r.get_sample_value("pdrouter_request_duration_seconds_count", {"frontdoor": "grpc"}) == 1
    assert r.get_sample_value("pdrouter_request_duration_seconds_sum", {"frontdoor": "grpc"}) == 0.25


def test_dispatcher_side_api() -> None:
    metrics = RouterMetrics()
    r = metrics.registry
    metrics.set_worker_load("decode-0", "decode", running=3, queued_prefill_tokens=0, free_blocks=120,
                            device="sim:h100-80g", waiting=2, kv_usage=0.25, engine="sim", engine_version="0.1.0")
    metrics.set_worker_load("prefill-0", "prefill", running=1, queued_prefill_tokens=512, free_blocks=7)
    labels = {"worker": "decode-0", "role": "decode"}
    info = {**labels, "device": "sim:h100-80g", "engine": "sim", "version": "0.1.0"}
    assert r.get_sample_value("pdrouter_worker_info", info) == 1
    assert r.get_sample_value("pdrouter_worker_running_requests", labels) == 3
    assert r.get_sample_value("pdrouter_worker_waiting_requests", labels) == 2
    assert r.get_sample_value("pdrouter_worker_kv_cache_usage_ratio", labels) == 0.25
    assert r.get_sample_value("pdrouter_worker_free_kv_blocks", labels) == 120
    assert r.get_sample_value("pdrouter_worker_queued_prefill_tokens",
                              {"worker": "prefill-0", "role": "prefill"}) == 512
    metrics.remove_worker("decode-0", "decode")
    metrics.remove_worker("decode-0", "decode")  # twice is harmless
    assert r.get_sample_value("pdrouter_worker_running_requests", labels) is None
    assert r.get_sample_value("pdrouter_worker_info", info) is None
    metrics.observe_kv_transfer(4096, 0.002, backend="tcp")
    metrics.observe_kv_transfer(1024, 0.001, backend="tcp")
    assert r.get_sample_value("pdrouter_kv_transfer_bytes_total", {"backend": "tcp"}) == 5120
    assert r.get_sample_value("pdrouter_kv_transfer_duration_seconds_count", {"backend": "tcp"}) == 2
    metrics.observe_prefix_match(prompt_tokens=100, hit_tokens=64)
    assert r.get_sample_value("pdrouter_prefix_cache_query_tokens_total") == 100
    assert r.get_sample_value("pdrouter_prefix_cache_hit_tokens_total") == 64
    metrics.observe_queue_time(0.03)
    assert r.get_sample_value("pdrouter_queue_time_seconds_count") == 1


@pytest.mark.parametrize(("exc", "outcome"), [
    (None, "ok"),
    (PromptTooLongError("long"), "invalid"),
    (IncompatibleError("layout"), "invalid"),
    (NotFoundError("model"), "not_found"),
    (RequestTooLargeError("huge"), "capacity"),
    (TransferError("lost"), "unavailable"),
    (DeadlineExceededError("late"), "deadline"),
    (CancelledError("gone"), "cancelled"),
    (asyncio.CancelledError(), "cancelled"),
    (RuntimeError("bug"), "error"),
])
def test_outcome_labels(exc: BaseException | None, outcome: str) -> None:
    assert outcome_of(exc) == outcome


def test_the_hot_path_metrics_expose_what_stock_prometheus_metrics_would() -> None:
    """The front door's children run without locks and bucket by binary search: same exposition."""
    from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

    from pdrouter.router.metrics import FrontdoorMetrics, _FastHistogram, _PlainValue

    metrics = RouterMetrics()
    door = FrontdoorMetrics(metrics, "http")
    assert isinstance(door.ttft, _FastHistogram) and door.ttft.observe.__name__ == "_observe"
    assert isinstance(door.in_flight.inc.__self__, _PlainValue)  # bound to the plain value itself
    reference = CollectorRegistry()
    buckets = list(metrics.ttft_seconds._upper_bounds)
    ttft = Histogram("pdrouter_time_to_first_token_seconds", metrics.ttft_seconds._documentation, ["frontdoor"],
                     buckets=buckets[:-1], registry=reference).labels("http")
    in_flight = Gauge("pdrouter_requests_in_flight", metrics.requests_in_flight._documentation, ["frontdoor"],
                      registry=reference).labels("http")
    tokens = Counter("pdrouter_prompt_tokens", metrics.prompt_tokens_total._documentation, ["frontdoor"],
                     registry=reference).labels("http")
    # Values on, between and beyond the bounds, negative and huge ones included.
    values = [0.0, -1.0, *buckets[:-1], *(b * 1.5 for b in buckets[:-1]), 1e9]
    for v in values:
        door.ttft.observe(v)
        ttft.observe(v)
        door.in_flight.inc()
        in_flight.inc()
        door.prompt_tokens.inc(3)
        tokens.inc(3)
    door.in_flight.dec()
    in_flight.dec()

    def lines(registry: CollectorRegistry, names: tuple[str, ...]) -> list[str]:
        text = generate_latest(registry).decode()
        return sorted(line for line in text.splitlines()
                      if line.startswith(names) and "_created" not in line)

    queue = Histogram("pdrouter_queue_time_seconds", metrics.queue_time_seconds._documentation,
                      buckets=list(metrics.queue_time_seconds._upper_bounds)[:-1], registry=reference)
    transfer = Histogram("pdrouter_kv_transfer_duration_seconds", metrics.kv_transfer_duration_seconds._documentation,
                         ["backend"], buckets=list(metrics.kv_transfer_duration_seconds._upper_bounds)[:-1],
                         registry=reference).labels("tcp")
    for v in values:
        metrics.observe_queue_time(v)
        queue.observe(v)
        metrics.observe_kv_transfer(1, v, "tcp")
        transfer.observe(v)
    names = ("pdrouter_time_to_first_token_seconds", "pdrouter_requests_in_flight", "pdrouter_prompt_tokens",
             "pdrouter_queue_time_seconds", "pdrouter_kv_transfer_duration_seconds")
    assert lines(metrics.registry, names) == lines(reference, names)
    assert any('le="+Inf"' in line for line in lines(reference, names))


def test_a_tenants_admissions_past_its_share_are_counted() -> None:
    metrics = RouterMetrics()
    metrics.enable_tenants(["a", "b"])
    metrics.observe_queue_time(0.5, "a", past_share=True)
    metrics.observe_queue_time(0.1, "a")
    metrics.observe_queue_time(0.2, "b")
    metrics.observe_queue_time(0.3)  # no tenant
    value = metrics.registry.get_sample_value
    assert value("pdrouter_tenant_past_share_total", {"tenant": "a"}) == 1
    assert value("pdrouter_tenant_past_share_total", {"tenant": "b"}) == 0
    assert value("pdrouter_tenant_queue_wait_seconds_count", {"tenant": "a"}) == 2
    assert value("pdrouter_queue_time_seconds_count") == 4


def test_build_info_names_the_version_and_the_compiled_modules() -> None:
    import importlib.metadata
    from pathlib import Path

    import pdrouter

    root = Path(pdrouter.__file__).resolve().parent
    # Counted here from the files: an extension beside its source (the shared runtime has none).
    compiled = [p for p in root.rglob("*.so") if (p.parent / (p.name.split(".", 1)[0] + ".py")).is_file()]
    try:
        version = importlib.metadata.version("pd-router")
    except importlib.metadata.PackageNotFoundError:
        version = "unknown"
    m = RouterMetrics()
    assert m.registry.get_sample_value("pdrouter_build_info",
                                       {"version": version, "compiled_modules": str(len(compiled))}) == 1.0
