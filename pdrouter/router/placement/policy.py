"""Placement policies: which worker gets a request's prefill, decode or colocated leg.

The contract every policy keeps (``PlacementPolicy``) and what the policies share; one module per
policy beside this one (``least_loaded.py``, ``cache_aware.py``), chosen by name
(``pdrouter.router.placement.policies.make_policy``). A policy only decides: it reads the
candidates' load and this router's accounting of them, and never sends anything.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import ClassVar, Protocol, TypeVar

from pdrouter.core.errors import UnavailableError
from pdrouter.core.ids import WorkerId
from pdrouter.core.workers import WorkerLoad
from pdrouter.router.request import RouterRequest


class Candidate(Protocol):
    """What placement reads of a worker (``pdrouter.router.placement.worker_pool.WorkerHandle`` provides it)."""

    @property
    def worker_id(self) -> WorkerId: ...

    load: WorkerLoad
    inflight: int
    inflight_prefill_tokens: int
    assigned_tokens: int
    """Prompt tokens this router has placed on the worker so far (spreads ties)."""

    @property
    def inflight_prefill_by_priority(self) -> Mapping[int, int]:
        """Of ``inflight_prefill_tokens``, the tokens at each engine priority."""
        ...

    @property
    def schedules_by_priority(self) -> bool:
        """Whether the worker's engine computes waiting prompts by engine priority (lower first)."""
        ...


C = TypeVar("C", bound=Candidate)


class PlacementPolicy(Protocol):
    """Picks a worker among ``candidates`` (never empty: UnavailableError when it is); mutates nothing."""

    name: ClassVar[str]
    """What the router's configuration calls the policy (``make_policy``)."""

    def pick_prefill(self, request: RouterRequest, candidates: Sequence[C],
                     cached_tokens: Mapping[WorkerId, int] | None = None, priority: int | None = None) -> C:
        """The prefill worker for ``request``; ``cached_tokens``: the prompt tokens each holds (index view);
        ``priority``: the prompt's engine priority, when known (``backlog_tokens``)."""
        ...

    def pick_decode(self, request: RouterRequest, candidates: Sequence[C],
                    blocks_needed: int) -> C:
        """The decode (or colocated) worker for ``request``, which books ``blocks_needed`` KV blocks."""
        ...

    def on_request_complete(self, request: RouterRequest, worker: Candidate, ok: bool) -> None:
        """Feedback: the call ``worker`` served for ``request`` ended (``ok``: it finished)."""
        ...


def require(candidates: Sequence[C], what: str) -> None:
    if not candidates:
        raise UnavailableError(f"no {what} worker is available (none registered, or all failing)")


def backlog_tokens(handle: Candidate, priority: int | None = None) -> int:
    """Prefill tokens queued on a worker: its last report plus what this router sent since.

    With the prompt's engine ``priority``, on a worker that schedules by priority: only the tokens
    the prompt would wait for, those queued at that priority or a lower value. A prompt of a lower
    value than the rest of a worker's queue waits for one step of it at most, so a worker whose
    queue is all of a flood's past-share prompts is, for a standard prompt, as good as an idle one.
    """
    if priority is None or not handle.schedules_by_priority:
        return handle.load.queued_prefill_tokens + handle.inflight_prefill_tokens
    return handle.load.prefill_tokens_ahead(priority) + sum(
        tokens for p, tokens in handle.inflight_prefill_by_priority.items() if p <= priority)


def displaced(candidates: Sequence[Candidate], priority: int | None) -> dict[WorkerId, tuple[int, ...]]:
    """What a prompt of engine ``priority`` would push back on each candidate: the tokens queued
    behind it (priorities of higher values), the nearest priority first, over the priorities any
    candidate has behind it. Equal backlogs ahead go to the least such tuple, so an interactive
    prompt displaces a flood's past-share work before a standard prompt. Empty tuples (nothing to
    tell) without a priority, on workers that do not schedule by priority, and when every prompt
    has one priority."""
    if priority is None:
        return {}
    behind: dict[WorkerId, dict[int, int]] = {}
    for h in candidates:
        if not h.schedules_by_priority:
            continue
        mine: dict[int, int] = {}
        for p, tokens in (*h.load.queued_prefill_by_priority, *h.inflight_prefill_by_priority.items()):
            if p > priority:
                mine[p] = mine.get(p, 0) + tokens
        if mine:
            behind[h.worker_id] = mine
    levels = sorted({p for mine in behind.values() for p in mine})
    return {w: tuple(mine.get(p, 0) for p in levels) for w, mine in behind.items()} if levels else {}
