"""``LeastLoaded``: placement by load alone, the work a worker reported in its heartbeat plus what
this router has sent it since."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import ClassVar

from mypy_extensions import mypyc_attr

from pdrouter.core.ids import WorkerId
from pdrouter.router.placement.policy import C, Candidate, backlog_tokens, displaced, require
from pdrouter.router.request import RouterRequest


@mypyc_attr(allow_interpreted_subclasses=True)  # a policy of one's own may subclass it
class LeastLoaded:
    """Fewest queued prefill tokens for prefill; most free KV blocks for decode and colocated."""

    name: ClassVar[str] = "least_loaded"

    def pick_prefill(self, request: RouterRequest, candidates: Sequence[C],
                     cached_tokens: Mapping[WorkerId, int] | None = None, priority: int | None = None) -> C:
        """Fewest prefill tokens ahead of the prompt (``backlog_tokens`` at its ``priority``), then the
        least it would push back (``displaced``: none when every priority is the same)."""
        require(candidates, "prefill")
        behind = displaced(candidates, priority)
        return min(candidates, key=lambda h: (backlog_tokens(h, priority), behind.get(h.worker_id, ()),
                                              backlog_tokens(h), h.load.running + h.inflight, h.assigned_tokens,
                                              h.worker_id))

    def pick_decode(self, request: RouterRequest, candidates: Sequence[C],
                    blocks_needed: int) -> C:
        require(candidates, "decode")
        return min(candidates, key=lambda h: (-(h.load.free_blocks - h.inflight * blocks_needed),
                                              h.load.running + h.inflight, h.worker_id))

    def on_request_complete(self, request: RouterRequest, worker: Candidate, ok: bool) -> None:
        """Nothing to learn: the load reads already count what this router sent."""
