"""The router's ``/metrics`` as a run reads it: counters that do not exist yet count as 0.

The pages are the router's own exposition (``RouterMetrics``), before and after its first KV transfer.
"""

from __future__ import annotations

from pdrouter.bench.report import router_figures
from pdrouter.bench.scrape import counter_growth, parse_metrics
from pdrouter.router.metrics import RouterMetrics


def test_a_fresh_router_moved_no_bytes_and_its_first_transfer_counts_whole() -> None:
    metrics = RouterMetrics()
    fresh = parse_metrics(metrics.exposition().decode(), 0.0)
    assert fresh.kv_transfer_bytes == 0.0  # declared, no transfer yet: 0, not "unknown"
    metrics.observe_kv_transfer(4096, 0.01)
    metrics.observe_kv_transfer(1024, 0.01)
    later = parse_metrics(metrics.exposition().decode(), 1.0)
    assert later.kv_transfer_bytes == 5120.0
    assert router_figures([fresh, later])["kv_transfer_bytes"] == 5120.0


def test_a_counter_missing_from_an_early_page_grows_from_zero() -> None:
    metrics = RouterMetrics()
    metrics.observe_kv_transfer(300, 0.01)
    page = parse_metrics(metrics.exposition().decode(), 2.0)
    blank = parse_metrics("", 0.0)  # a page without the family at all
    assert blank.kv_transfer_bytes is None
    assert counter_growth([blank, page], "kv_transfer_bytes") == 300.0
    assert counter_growth([blank, blank], "kv_transfer_bytes") is None  # never shown: unknown
    assert counter_growth([page], "kv_transfer_bytes") is None  # one sample: no growth to read


def test_a_page_is_read_the_same_from_its_wanted_lines() -> None:
    """The scraper keeps pages as text during a run and parses only the lines it reads, afterwards."""
    from pdrouter.bench.scrape import _wanted_lines

    metrics = RouterMetrics()
    metrics.set_worker_load("decode-0", "decode", running=3, queued_prefill_tokens=0, free_blocks=90,
                            device="sim:h100-80g", sim_modeled_s=12.5, sim_late_s=0.25)
    metrics.observe_kv_transfer(4096, 0.01)
    metrics.observe_prefix_match(1000, 640)
    metrics.observe_queue_time(0.2)
    page = metrics.exposition().decode()
    full, kept = parse_metrics(page, 3.0), parse_metrics(_wanted_lines(page), 3.0)
    assert kept == full
    assert (kept.kv_transfer_bytes, kept.prefix_query_tokens, kept.prefix_hit_tokens, kept.sim_modeled_s,
            kept.sim_late_s) == (4096.0, 1000.0, 640.0, 12.5, 0.25)
    assert len(_wanted_lines(page)) < len(page) / 2


def test_the_routers_own_ttft_over_a_window_is_read_between_its_buckets() -> None:
    """Both doors count; the window is read between the samples that enclose it; a quantile is
    interpolated within its bucket (as Prometheus's ``histogram_quantile``), and one past the last
    finite bound reads that bound."""
    import pytest

    from pdrouter.bench.report import router_ttft_sentence
    from pdrouter.bench.scrape import _wanted_lines, histogram_quantiles
    from pdrouter.router.metrics import FrontdoorMetrics

    metrics = RouterMetrics()
    http, grpc = FrontdoorMetrics(metrics, "http"), FrontdoorMetrics(metrics, "grpc")
    for _ in range(50):
        http.ttft.observe(0.004)  # before the window: not counted
    first = parse_metrics(_wanted_lines(metrics.exposition().decode()), 1.0)
    for _ in range(80):
        http.ttft.observe(0.03)  # bucket (0.025, 0.05]
    for _ in range(10):
        grpc.ttft.observe(0.6)  # bucket (0.5, 0.75]
    for _ in range(10):
        grpc.ttft.observe(100.0)  # past the last finite bound (80 s)
    second = parse_metrics(_wanted_lines(metrics.exposition().decode()), 5.0)
    assert second.ttft_buckets[float("inf")] == 150
    figures = histogram_quantiles([first, second], 1.5, 4.5)
    assert figures["count"] == 100
    assert figures["p50_s"] == pytest.approx(0.025 + 0.025 * 50 / 80)
    assert figures["p90_s"] == pytest.approx(0.75)  # the 90th of 100: the last in (0.5, 0.75]
    assert figures["p99_s"] == 80.0
    assert histogram_quantiles([first, first], 0.0, 2.0) == {}  # nothing between them
    assert histogram_quantiles([parse_metrics("", 0.0), parse_metrics("", 9.0)], 0.0, 9.0) == {}  # not exported
    text = router_ttft_sentence(figures, {"p50": 1.5, "p90": 2.0, "p99": 2.5, "count": 100})
    assert "(its `pdrouter_time_to_first_token_seconds`" in text and "100 requests): p50 41 ms, p90 750 ms" in text
    assert "the client's: p50 1500 ms, p90 2000 ms, p99 2500 ms" in text
