"""``CacheAware``: prefill placement by estimated cost.

The cost is the prompt tokens a worker would still have to compute (its cached prefix is free,
once it reaches ``min_hit_tokens``) plus the prefill backlog already queued on it; ties go to the
worker this router has given the least work. A balance guard keeps a hot prefix from piling onto
one worker: a worker whose backlog exceeds ``balance_factor`` × the pool's mean backlog +
``balance_slack_tokens`` is passed over while another is within bounds. Decode placement is
``LeastLoaded``'s.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import ClassVar

from mypy_extensions import mypyc_attr

from pdrouter.core.errors import ConfigError
from pdrouter.core.ids import WorkerId
from pdrouter.router.placement.least_loaded import LeastLoaded
from pdrouter.router.placement.policy import C, backlog_tokens, displaced, require
from pdrouter.router.request import RouterRequest


@dataclass(frozen=True)
class CacheAwareConfig:
    """Weights of the cache-aware score (all in prompt-token units)."""

    backlog_weight: float = 1.0
    """Cost of one queued prefill token on the worker (1.0: queued work costs what own work costs)."""
    running_weight_tokens: float = 0.0
    """Cost of each running request on the worker, in tokens (decode contention; 0 ignores it)."""
    balance_factor: float = 1.25
    balance_slack_tokens: int = 4096
    min_hit_tokens: int = 64
    """Cached prefixes shorter than this earn no credit: a block or two of common preamble (a BOS and
    a few words) is no reason to pile requests onto one worker; placement then balances instead."""

    def __post_init__(self) -> None:
        if self.backlog_weight < 0 or self.running_weight_tokens < 0:
            raise ConfigError("cache-aware weights must be >= 0")
        if self.balance_factor < 1.0 or self.balance_slack_tokens < 0 or self.min_hit_tokens < 0:
            raise ConfigError("balance_factor must be >= 1; balance_slack_tokens and min_hit_tokens >= 0")


@mypyc_attr(allow_interpreted_subclasses=True)  # a policy of one's own may subclass it
class CacheAware(LeastLoaded):
    """Prefill on the worker with the cheapest (uncached work + backlog), within the balance guard."""

    name: ClassVar[str] = "cache_aware"

    def __init__(self, config: CacheAwareConfig | None = None) -> None:
        self.config = config or CacheAwareConfig()

    def score(self, prompt_tokens: int, cached: int, backlog: int, running: int) -> float:
        c = self.config
        credit = cached if cached >= c.min_hit_tokens else 0
        return (prompt_tokens - credit) + c.backlog_weight * backlog + c.running_weight_tokens * running

    def pick_prefill(self, request: RouterRequest, candidates: Sequence[C],
                     cached_tokens: Mapping[WorkerId, int] | None = None, priority: int | None = None) -> C:
        """The backlog in the score and the guard is what the prompt waits for (``backlog_tokens`` at
        its ``priority``); equal scores go to the worker where it pushes back least (``displaced``:
        nothing when every priority is the same, and then nothing changes)."""
        require(candidates, "prefill")
        c = self.config
        cached = cached_tokens or {}
        backlogs = [backlog_tokens(h, priority) for h in candidates]
        mean = sum(backlogs) / len(candidates)
        bound = c.balance_factor * mean + c.balance_slack_tokens
        eligible = [i for i, backlog in enumerate(backlogs) if backlog <= bound] or range(len(candidates))
        n = len(request.prompt_token_ids)
        behind = {} if priority is None else displaced([candidates[i] for i in eligible], priority)
        # ``score`` written out, once a candidate (a placement runs it for every request); the first of
        # the least keys wins, as ``min`` picks.
        floor, per_backlog, per_running = c.min_hit_tokens, c.backlog_weight, c.running_weight_tokens
        best, best_key = candidates[eligible[0]], None
        for i in eligible:
            h = candidates[i]
            hit = cached.get(h.worker_id, 0)
            cost = (n - (hit if hit >= floor else 0)) + per_backlog * backlogs[i] \
                + per_running * (h.load.running + h.inflight)
            key = (cost, behind.get(h.worker_id, ()), h.assigned_tokens, h.worker_id)
            if best_key is None or key < best_key:
                best, best_key = h, key
        return best
