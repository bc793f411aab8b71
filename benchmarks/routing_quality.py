"""Prefill placement quality on a shared-prefix workload: hit rate and load balance per policy.

Replays G groups × P prompts (a long per-group system prompt + a short unique question), in a
seeded random order, over W simulated prefill workers. Each worker has a real block manager
(``pdrouter.engine.block_manager``) with a finite KV pool, so its prefix cache fills and evicts exactly as a
worker's would; the cache-aware policy reads a real Redis prefix index fed by those block events.
Time advances one tick per request; each worker computes ``rate`` prompt tokens per tick, so
backlogs (the load the policies see) rise and fall.

Policies: round-robin, least-loaded, cache-aware (this router's), and an oracle that reads every
worker's cache exactly and takes the longest prefix (ties: least backlog). Printed per policy:
token hit rate and imbalance (max / mean prefill tokens computed per worker); then the cache-aware
policy's hit rate as a fraction of the oracle's (target >= 0.95) and its imbalance (target <= 1.25).

The policies above see each worker's backlog as it is. A router sees it as the worker's last
heartbeat gave it, plus the prompts it placed that have not reported (``backlog_tokens``).
``cache_aware_heartbeat_*`` replays the cache-aware policy so: the workers' loads are taken every
``--heartbeat-ticks`` requests, and each placed prompt is in flight on its worker until the worker
has computed it; the router's own prompts are taken out of each load as the router does
(``OwnPrefills``). ``cache_aware_heartbeat_uncorrected_*`` leaves them in: a prompt queued when a
load was taken then counts twice until computed, and once more until the next load is taken.

    python benchmarks/routing_quality.py [--quick] [--json] [--heartbeat-ticks N]
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Sequence
from dataclasses import dataclass, field

import redis.asyncio as aioredis
from _report import Report, base_parser

from pdrouter.core.hashing import BlockHasher
from pdrouter.core.ids import Epoch, RequestId, WorkerId
from pdrouter.core.sampling import SamplingParams
from pdrouter.core.workers import WorkerLoad
from pdrouter.engine.block_manager import BlockManager
from pdrouter.engine.events import RecordingBlockEventSink
from pdrouter.router.placement.cache_aware import CacheAware
from pdrouter.router.placement.least_loaded import LeastLoaded
from pdrouter.router.placement.worker_pool import OwnPrefills, PrefillCharge
from pdrouter.router.request import RouterRequest
from pdrouter.state.embedded_redis import EmbeddedRedis
from pdrouter.state.prefix_index import PrefixIndex

BLOCK = 16


@dataclass
class SimWorker:
    """A prefill worker: a real block manager, a backlog, and what it computed."""

    worker_id: WorkerId
    blocks: BlockManager
    sink: RecordingBlockEventSink
    load: WorkerLoad = field(default_factory=WorkerLoad)
    inflight: int = 0
    inflight_prefill_tokens: int = 0
    inflight_prefill_by_priority: dict[int, int] = field(default_factory=dict)
    assigned_tokens: int = 0
    schedules_by_priority: bool = False
    backlog: float = 0.0
    computed: int = 0
    published: int = 0
    done: float = 0.0
    """Tokens computed since the start (the backlog drained)."""
    queued: float = 0.0
    """Tokens enqueued since the start."""
    in_flight: list[tuple[float, PrefillCharge]] = field(default_factory=list)
    """Placed prompts not yet computed: (``queued`` once it was enqueued, its charge), oldest first."""
    own: OwnPrefills = field(default_factory=OwnPrefills)
    correct: bool = True
    """Take this router's prompts out of each load taken (``OwnPrefills.adjust``)."""

    def run(self, prompt: Sequence[int], hashes: Sequence[bytes]) -> int:
        """Prefill ``prompt`` here; returns the tokens served from the cache."""
        alloc = self.blocks.allocate(hashes, len(prompt))  # type: ignore[arg-type]
        if alloc is None:  # the pool is smaller than one prompt: compute without caching
            self.computed += len(prompt)
            self.backlog += len(prompt)
            return 0
        cached = alloc.num_cached_blocks * BLOCK
        self.blocks.commit(alloc.block_ids, hashes, alloc.num_cached_blocks)  # type: ignore[arg-type]
        self.blocks.free(alloc.block_ids)
        self.computed += len(prompt) - cached
        self.assigned_tokens = self.computed
        self.backlog += len(prompt) - cached
        return cached

    def charge(self, tokens: int, now: float) -> None:
        """A prompt of ``tokens`` to compute was placed here at ``now``: in flight until computed."""
        self.queued += tokens
        self.in_flight.append((self.queued, self.own.charge(tokens, 0, now)))
        self.inflight_prefill_tokens += tokens

    def tick(self, rate: float, now: float, beat: bool = True) -> None:
        """``rate`` tokens computed by ``now``; the load the router sees taken again when ``beat``."""
        self.done += min(self.backlog, rate)
        self.backlog = max(0.0, self.backlog - rate)
        while self.in_flight and self.in_flight[0][0] <= self.done + 1e-9:
            charge = self.in_flight.pop(0)[1]
            self.inflight_prefill_tokens -= charge.tokens
            self.own.settle(charge, now)
        if beat:
            load = WorkerLoad(queued_prefill_tokens=int(self.backlog), taken_at=now + 0.25)
            self.load = self.own.adjust(load, now + 0.5) if self.correct else load


def workload(groups: int, per_group: int, system: int, question: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    systems = [[rng.randrange(32_000) for _ in range(system)] for _ in range(groups)]
    prompts = [systems[g] + [rng.randrange(32_000) for _ in range(question)]
               for g in range(groups) for _ in range(per_group)]
    rng.shuffle(prompts)
    return prompts


async def replay(policy: str, prompts: list[list[int]], workers: int, kv_blocks: int, rate: float,
                 index: PrefixIndex | None, heartbeat_ticks: int = 0, correct: bool = True) -> tuple[float, float]:
    """Hit rate and imbalance of ``policy``; ``heartbeat_ticks`` > 0: the loads as a router sees them
    (taken every so many requests, its own prompts in flight added, taken out of the loads when
    ``correct``; see the module docstring). Request ``n`` is placed at time ``n``."""
    sims = []
    for i in range(workers):
        sink = RecordingBlockEventSink()
        sims.append(SimWorker(WorkerId(f"p{i}"), BlockManager(kv_blocks, BLOCK, sink=sink), sink, correct=correct))
    hasher = BlockHasher(BLOCK)
    cache_aware, least = CacheAware(), LeastLoaded()
    sampling = SamplingParams(max_tokens=1)
    hits = total = 0
    for n, prompt in enumerate(prompts):
        hashes = hasher.hash_blocks(prompt)
        request = RouterRequest(RequestId(f"r{n}"), "sim", tuple(prompt), sampling)
        if policy == "round_robin":
            chosen = sims[n % workers]
        elif policy == "least_loaded":
            chosen = least.pick_prefill(request, sims)
        elif policy == "oracle":
            chosen = min(sims, key=lambda w: (-len(w.blocks.match_prefix(hashes)), w.backlog, w.worker_id))
        else:
            assert index is not None
            matches = await index.lookup(hashes, [(w.worker_id, Epoch(1)) for w in sims])
            cached = {m.worker_id: m.blocks * BLOCK for m in matches}
            chosen = cache_aware.pick_prefill(request, sims, cached)
        before = chosen.computed
        hits += chosen.run(prompt, hashes)
        if heartbeat_ticks:
            chosen.charge(chosen.computed - before, float(n))
        total += len(prompt)
        if index is not None:  # the worker's block events reach the index before the next request
            new = chosen.sink.events[chosen.published:]
            chosen.published = len(chosen.sink.events)
            await index.apply(chosen.worker_id, 1, [(kind == "stored", list(h)) for kind, h in new])
        beat = not heartbeat_ticks or (n + 1) % heartbeat_ticks == 0
        for w in sims:
            w.tick(rate, n + 0.25, beat)
    computed = [w.computed for w in sims]
    mean = sum(computed) / len(computed)
    return hits / total, max(computed) / mean if mean else 1.0


async def main_async() -> None:
    parser = base_parser(__doc__ or "")
    parser.add_argument("--groups", type=int, default=64)
    parser.add_argument("--per-group", type=int, default=16)
    parser.add_argument("--system-tokens", type=int, default=2048)
    parser.add_argument("--question-tokens", type=int, default=128)
    parser.add_argument("--workers", type=int, default=8)
    parser.add_argument("--kv-blocks", type=int, default=1536, help="KV blocks per worker (finite cache)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--heartbeat-ticks", type=int, default=64,
                        help="requests between two loads the router sees, for cache_aware_heartbeat_*")
    args = parser.parse_args()
    if args.heartbeat_ticks < 1:
        parser.error("--heartbeat-ticks must be at least 1")
    if args.quick:
        args.groups, args.per_group = 32, 8
    prompts = workload(args.groups, args.per_group, args.system_tokens, args.question_tokens, args.seed)
    # Offered load ~70% of capacity when caching works ideally.
    ideal = (args.groups * args.system_tokens + len(prompts) * (args.question_tokens + BLOCK)) / len(prompts)
    rate = ideal / args.workers / 0.7
    report = Report()
    results: dict[str, tuple[float, float]] = {}
    with EmbeddedRedis() as server:
        client = aioredis.Redis.from_url(server.url)
        for policy in ("round_robin", "least_loaded", "cache_aware", "oracle", "cache_aware_heartbeat",
                       "cache_aware_heartbeat_uncorrected"):
            await client.flushall()
            index = PrefixIndex(client, "sim", ttl_ms=600_000) if policy.startswith("cache_aware") else None
            ticks = args.heartbeat_ticks if policy.startswith("cache_aware_heartbeat") else 0
            results[policy] = await replay(policy.split("_heartbeat")[0], prompts, args.workers, args.kv_blocks,
                                           rate, index, ticks, correct=not policy.endswith("_uncorrected"))
            report.add(f"{policy}_hit_rate", round(results[policy][0], 4), "fraction")
            report.add(f"{policy}_imbalance", round(results[policy][1], 4), "max/mean")
        await client.aclose()
    ratio = results["cache_aware"][0] / results["oracle"][0]
    report.add("cache_aware_vs_oracle_hit_rate", round(ratio, 4), "fraction")
    report.add("target_met", int(ratio >= 0.95 and results["cache_aware"][1] <= 1.25), "bool")
    for policy in ("cache_aware_heartbeat", "cache_aware_heartbeat_uncorrected"):
        report.add(f"{policy}_vs_oracle_hit_rate", round(results[policy][0] / results["oracle"][0], 4), "fraction")
    report.add("heartbeat_ticks", args.heartbeat_ticks, "requests")
    report.add("requests", len(prompts), "requests")
    report.emit(args.json)


if __name__ == "__main__":
    asyncio.run(main_async())
