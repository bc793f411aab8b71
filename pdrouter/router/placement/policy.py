"""Placement policies: which worker gets a request's prefill, decode or colocated leg.

The contract every policy keeps (``PlacementPolicy``) and what the policies share; one module per
policy beside this one (``least_loaded.py``, ``cache_aware.py``), chosen by name
(``pdrouter.router.placement.policies.make_policy``). A policy only decides: it reads the
candidates' load and this router's accounting of them, and never sends anything.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Protocol, TypeVar

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


C = TypeVar("C", bound=Candidate)


class PlacementPolicy(Protocol):
    """Picks a worker among ``candidates`` (never empty: UnavailableError when it is); mutates nothing."""

    name: str
    """What the router's configuration calls the policy (``make_policy``)."""

    def pick_prefill(self, request: RouterRequest, candidates: Sequence[C],
                     cached_tokens: Mapping[WorkerId, int] | None = None) -> C:
        """The prefill worker for ``request``; ``cached_tokens``: the prompt tokens each holds (index view)."""
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


def backlog_tokens(handle: Candidate) -> int:
    """Prefill tokens queued on a worker: its last report plus what this router sent since."""
    return handle.load.queued_prefill_tokens + handle.inflight_prefill_tokens
