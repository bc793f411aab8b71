"""vLLM's scheduler statistics, as the worker's load reports need them.

vLLM's engine core sends its scheduler's figures (``SchedulerStats``: running and waiting requests,
the fraction of KV blocks held by requests, prefix-cache queries and hits since the last report)
with the outputs of each step; its async client hands them to every stat logger. ``SchedulerFigures``
is one such logger (registered through ``AsyncLLM(stat_loggers=[…])``, vLLM's documented way): it
keeps the latest figures and sums the prefix-cache counts, which are then the same numbers as vLLM's
own ``vllm:prefix_cache_queries`` / ``vllm:prefix_cache_hits`` counters.

The figures come only with steps: a request aborted while the engine is otherwise idle frees its
blocks without a step, and so without a report. ``idle()`` says what an engine with no request
holds (nothing: vLLM's usage counts blocks referenced by requests, not cached free ones), and the
engine reports that once it has no unfinished request.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


@dataclass
class SchedulerFigures:
    """The latest of vLLM's scheduler statistics (see the module docstring)."""

    running: int = 0
    waiting: int = 0
    kv_usage: float = 0.0
    """Fraction of the pool's usable blocks held by requests (vLLM's ``kv_cache_usage``)."""
    prefix_cache_queries: int = 0
    """Prompt tokens looked up in the prefix cache, since the engine started."""
    prefix_cache_hits: int = 0
    """Of those, tokens found cached."""
    reports: int = 0

    def record(self, stats: Any) -> None:
        """One ``SchedulerStats``."""
        self.running = int(stats.num_running_reqs)
        self.waiting = int(stats.num_waiting_reqs)
        self.kv_usage = float(stats.kv_cache_usage)
        prefix = getattr(stats, "prefix_cache_stats", None)
        if prefix is not None:
            self.prefix_cache_queries += int(prefix.queries)
            self.prefix_cache_hits += int(prefix.hits)
        self.reports += 1

    def idle(self) -> None:
        """No request is left: none runs, none waits, no block is held."""
        self.running = self.waiting = 0
        self.kv_usage = 0.0

    def logger_factory(self) -> Callable[..., Any]:
        """A vLLM stat logger factory (``(vllm_config, engine_index) -> StatLoggerBase``) feeding these figures."""
        from vllm.v1.metrics.loggers import StatLoggerBase

        figures = self

        class _FiguresLogger(StatLoggerBase):
            def __init__(self, vllm_config: Any, engine_index: int = 0) -> None:
                self.engine_index = engine_index

            def record(self, scheduler_stats: Any, iteration_stats: Any, mm_cache_stats: Any = None,
                       engine_idx: int = 0) -> None:
                if scheduler_stats is not None:
                    figures.record(scheduler_stats)

            def log_engine_initialized(self) -> None:
                return None

        return _FiguresLogger
