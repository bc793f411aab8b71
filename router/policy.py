"""Placement: which worker gets a request's prefill, decode or colocated leg.

``LeastLoaded`` picks by load alone: the work a worker reported in its heartbeat plus what this
router has sent it since. Cache-aware prefill placement builds on the same interface.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from pdcommon.errors import UnavailableError
from router.request import RouterRequest
from router.worker_pool import WorkerHandle


class PlacementPolicy(Protocol):
    def pick_prefill(self, request: RouterRequest, candidates: Sequence[WorkerHandle]) -> WorkerHandle: ...

    def pick_decode(self, request: RouterRequest, candidates: Sequence[WorkerHandle],
                    blocks_needed: int) -> WorkerHandle: ...


def _require(candidates: Sequence[WorkerHandle], what: str) -> None:
    if not candidates:
        raise UnavailableError(f"no {what} worker is available (none registered, or all failing)")


class LeastLoaded:
    """Fewest queued prefill tokens for prefill; most free KV blocks for decode and colocated."""

    def pick_prefill(self, request: RouterRequest, candidates: Sequence[WorkerHandle]) -> WorkerHandle:
        _require(candidates, "prefill")
        return min(candidates, key=lambda h: (h.load.queued_prefill_tokens + h.inflight_prefill_tokens,
                                              h.load.running + h.inflight, h.worker_id))

    def pick_decode(self, request: RouterRequest, candidates: Sequence[WorkerHandle],
                    blocks_needed: int) -> WorkerHandle:
        _require(candidates, "decode")
        return min(candidates, key=lambda h: (-(h.load.free_blocks - h.inflight * blocks_needed),
                                              h.load.running + h.inflight, h.worker_id))
