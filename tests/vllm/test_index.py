"""Index: the prefix index is fed from vLLM's own KV events, so cache-aware placement works over vLLM workers.

Two vLLM workers behind one router. A prompt's prefix, once computed, is in the Redis index under the
worker that computed it (the project's block hashes of its tokens); requests that share the prefix
go to that worker, as vLLM's own prefix-cache counters (``prefix_cache_hits``, carried by the
worker's heartbeat) and each answer's ``cached_tokens`` show, and the other worker sees none of them.
After a worker dies and restarts, the entries of its old incarnation are gone.
"""

from __future__ import annotations

import urllib.request
import uuid
from typing import Any

from pdrouter.core.hashing import BlockHasher

from .conftest import (
    BLOCK,
    START_S,
    VllmPool,
    completion,
    incarnation_size,
    index_depths,
    kill_group,
    live_workers,
    poll,
    prompt_ids,
    run,
    wait_until,
)

HASHER = BlockHasher(BLOCK, 0)
PREFIX_BLOCKS = 6


def shared_prefix() -> str:
    """A prefix of more than ``PREFIX_BLOCKS`` whole blocks (``<bos>`` included), unique to this run."""
    return (f"{uuid.uuid4().hex} a system prompt that every request of this conversation starts with. " * 4)[
        : PREFIX_BLOCKS * BLOCK + 7]


def holder_of(pool: VllmPool, hashes: list[bytes]) -> str:
    """The one worker whose index entries cover every block of ``hashes`` (waits for the events)."""
    def holders() -> list[str]:
        return [w for w, blocks in run(index_depths(pool, hashes)).items() if blocks == len(hashes)]
    found = poll(holders, lambda h: len(h) == 1, "one worker indexed as the holder")
    return str(found[0])


def hits(pool: VllmPool) -> dict[str, int]:
    return {w: int(v["load"]["prefix_cache_hits"]) for w, v in live_workers(pool).items()}


def test_a_repeated_prefix_goes_to_the_worker_that_holds_it(vllm_pool: VllmPool) -> None:
    prefix = shared_prefix()
    hashes = HASHER.hash_blocks(prompt_ids(prefix))
    assert len(hashes) == PREFIX_BLOCKS
    status, body = completion(vllm_pool, prefix + " first question", max_tokens=2, temperature=0)
    assert status == 200, body
    holder = holder_of(vllm_pool, hashes)
    other = next(w for w in vllm_pool.workers if w != holder)
    before = poll(lambda: hits(vllm_pool), lambda h: len(h) == 2, "both workers' heartbeats")
    for i in range(4):
        status, body = completion(vllm_pool, prefix + f" question number {i}", max_tokens=2, temperature=0)
        assert status == 200, body
        assert body["usage"]["prompt_tokens_details"]["cached_tokens"] == PREFIX_BLOCKS * BLOCK
    want = before[holder] + 4 * PREFIX_BLOCKS * BLOCK  # vLLM's own count of prompt tokens served from its cache
    after = poll(lambda: hits(vllm_pool), lambda h: h.get(holder) == want, "the holder's prefix-cache hits (vLLM's)")
    assert after[other] == before[other]


def test_router_metrics_name_the_engine(vllm_pool: VllmPool) -> None:
    import vllm
    from prometheus_client.parser import text_string_to_metric_families

    def samples() -> dict[str, list[dict[str, str]]]:
        with urllib.request.urlopen(f"{vllm_pool.http}/metrics", timeout=10) as resp:
            text = resp.read().decode()
        return {f.name: [s.labels for s in f.samples] for f in text_string_to_metric_families(text)}

    found = poll(samples, lambda m: len(m.get("pdrouter_worker_info", [])) >= 2, "both workers in the metrics")
    for worker in vllm_pool.workers:
        assert {"worker": worker, "role": "colocated", "device": "cpu", "engine": "vllm",
                "version": vllm.__version__} in found["pdrouter_worker_info"]
        for name in ("pdrouter_worker_waiting_requests", "pdrouter_worker_kv_cache_usage_ratio",
                     "pdrouter_worker_running_requests", "pdrouter_worker_free_kv_blocks"):
            assert {"worker": worker, "role": "colocated"} in found[name], name


def test_a_restarted_worker_leaves_no_stale_entries(vllm_pool: VllmPool) -> None:
    prefix = shared_prefix()
    hashes = HASHER.hash_blocks(prompt_ids(prefix))
    status, body = completion(vllm_pool, prefix + " remember this", max_tokens=2, temperature=0)
    assert status == 200, body
    holder = holder_of(vllm_pool, hashes)
    old: dict[str, Any] = live_workers(vllm_pool)[holder]["record"]
    assert run(incarnation_size(vllm_pool, holder, int(old["epoch"]))) >= PREFIX_BLOCKS
    kill_group(vllm_pool.workers[holder])  # the worker and its vLLM engine, no goodbye
    vllm_pool.start_worker(holder).wait_ready(START_S)
    new = poll(lambda: live_workers(vllm_pool).get(holder, {}).get("record"),
               lambda r: r is not None and r["epoch"] != old["epoch"], "the restarted worker registered")
    assert int(new["epoch"]) > int(old["epoch"])
    wait_until(lambda: run(incarnation_size(vllm_pool, holder, int(old["epoch"]))) == 0,
               "the old incarnation's entries removed", timeout=90)
    assert run(index_depths(vllm_pool, hashes)).get(holder, 0) == 0  # the new engine holds none of it yet
    status, body = completion(vllm_pool, prefix + " ask again", max_tokens=2, temperature=0)
    assert status == 200, body
    wait_until(lambda: sum(run(index_depths(vllm_pool, hashes)).values()) == PREFIX_BLOCKS, "indexed again")
