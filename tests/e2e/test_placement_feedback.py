"""The placement policy hears how each worker call it placed ended (``on_request_complete``).

A router in front of simulated prefill and decode workers, its policy the cache-aware one with the
hook recording: every finished request, computed on the decode worker (a short prompt) or on the
prefill worker, is one call on the decode worker that served it, ``ok``.
"""

from __future__ import annotations

import httpx
import pytest

from pdrouter.core.workers import WorkerRole
from pdrouter.router.placement.cache_aware import CacheAware
from pdrouter.router.placement.policy import Candidate
from pdrouter.router.request import RouterRequest

from .conftest import Cluster
from .test_router_e2e import wait_workers


class Recording(CacheAware):
    def __init__(self) -> None:
        super().__init__()
        self.completed: list[tuple[str, str, bool]] = []

    def on_request_complete(self, request: RouterRequest, worker: Candidate, ok: bool) -> None:
        self.completed.append((request.request_id, worker.worker_id, ok))


@pytest.mark.parametrize("backend", ["sim"])
async def test_the_policy_hears_each_call_end(cluster: Cluster) -> None:
    cluster.spawn("prefill", worker_id="prefill-0")
    cluster.spawn("decode", worker_id="decode-0")
    router = await cluster.router()
    await wait_workers(router, {WorkerRole.PREFILL: 1, WorkerRole.DECODE: 1})
    assert router.dispatcher is not None
    policy = router.dispatcher.policy = Recording()
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{router.http_port}", timeout=30) as http:
        for prompt in ("a short one", "a longer prompt, " * 8):
            resp = await http.post("/v1/completions", json={"model": "tiny", "prompt": prompt, "max_tokens": 3})
            assert resp.status_code == 200, resp.text
    assert [(worker, ok) for _, worker, ok in policy.completed] == [("decode-0", True), ("decode-0", True)]
    assert len({rid for rid, _, _ in policy.completed}) == 2
