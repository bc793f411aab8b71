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
