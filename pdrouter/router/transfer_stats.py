"""What the router counts of KV hand-offs, and the one path a decode worker's prefill report takes
to the metrics.

``TransferStats`` keeps counters that ``pdrouter.router.state_metrics`` reads at scrape time (so the
request path pays an addition for them) and, for a report, also makes the observations that
``RouterMetrics`` keeps as histograms and labelled counters; the dispatcher hands it each report
once (``reported``) and each prefill placement once (``placed``).
"""

from __future__ import annotations

from pdrouter.core.disaggregation import PrefillReport
from pdrouter.router.metrics import RouterMetrics


class TransferStats:
    """Counters the dispatcher keeps about KV hand-offs, and the one path a prefill report takes to the
    metrics: ``reported`` counts it here (read at scrape time, ``pdrouter.router.state_metrics``) and
    observes it in ``RouterMetrics`` (histograms, per-backend counters)."""

    def __init__(self, metrics: RouterMetrics | None = None, backend: str = "tcp") -> None:
        """``metrics``: the router's (None: counted here only); ``backend``: the KV transport's label."""
        self.metrics = metrics
        self.backend = backend
        self.bytes = 0
        self.seconds = 0.0
        self.transfers = 0
        self.local_prefills = 0
        self.prefill_retries = 0
        self.lookups = 0
        self.lookup_seconds = 0.0
        self.index_errors = 0
        self.admission_redis_errors: dict[str, int] = {"refused": 0, "local": 0}
        """Bookings that failed because Redis could not be reached, by what happened to the request:
        ``refused`` (UNAVAILABLE) or ``local`` (placed by load alone, without shared admission)."""
        self.match_tokens: dict[str, int] = {}
        """Per prefill worker: prompt tokens its cache held when it was chosen (index view)."""
        self.placed_tokens: dict[str, int] = {}
        """Per prefill worker: prompt tokens placed on it."""
        self.prompt_tokens = 0
        self.cached_prompt_tokens = 0
        self.worker_retries = 0
        """Requests placed on another decode (or colocated) worker after one failed them unanswered."""

    def placed(self, worker_id: str, prompt_tokens: int, cached_tokens: int) -> None:
        """A prompt placed on prefill worker ``worker_id``, which held ``cached_tokens`` of it (index view)."""
        self.match_tokens[worker_id] = self.match_tokens.get(worker_id, 0) + cached_tokens
        self.placed_tokens[worker_id] = self.placed_tokens.get(worker_id, 0) + prompt_tokens

    def reported(self, report: PrefillReport) -> None:
        """A decode worker's prefill report: its failed attempts, a local prefill, or a KV transfer."""
        metrics = self.metrics
        for failure in report.failures:
            self.prefill_retries += 1
            if metrics is not None:
                metrics.observe_kv_transfer_failure(failure.code)
        if report.local:
            self.local_prefills += 1
            return
        if not report.worker_id:
            return  # every attempt failed
        self.prompt_tokens += report.prompt_tokens
        self.cached_prompt_tokens += report.cached_tokens
        self.transfers += 1
        self.bytes += report.bytes_sent
        self.seconds += report.transfer_ms / 1e3
        if metrics is not None:
            metrics.observe_prefix_match(report.prompt_tokens, report.cached_tokens)
            metrics.observe_kv_transfer(report.bytes_sent, report.transfer_ms / 1e3, self.backend)
