"""Prefix index lookups against a real Redis: latency on a full hit and on a miss vs. a PING.

A 32k-token prompt (2,048 blocks of 16) is looked up across 16 workers, once when every worker
holds the whole prompt (full hit) and once when none holds any of it (miss). Targets: p50 of each
<= 4 × the PING round trip measured by the same client in the same run. Also prints the lookups
per second one router sustains with 32 concurrent lookups.

A worker's writes: ``flush_cpu_*`` is the CPU this process spends on one block publisher's flush of
720 events (360 blocks stored, the 360 of the flush before removed: about 30 requests of a 2,200-token
prompt with a shared prefix), through redis-py's pipeline (``client``) and through the pipelined
connection workers use (``pipelined``), the two in turns.

    python benchmarks/prefix_index_bench.py [--quick] [--json]
"""

from __future__ import annotations

import asyncio
import random
import statistics
import time
from collections.abc import Awaitable, Callable

import redis.asyncio as aioredis
from _report import Report, base_parser

from pdrouter.core.hashing import BlockHasher
from pdrouter.core.ids import Epoch, WorkerId
from pdrouter.state.embedded_redis import EmbeddedRedis
from pdrouter.state.pipelined import PipelinedRedis
from pdrouter.state.prefix_index import PrefixIndex

WORKERS = [(WorkerId(f"prefill-{i}"), Epoch(1)) for i in range(16)]


async def timed(fn: Callable[[], Awaitable[object]], n: int) -> list[float]:
    for _ in range(min(50, n)):
        await fn()
    out = []
    for _ in range(n):
        start = time.perf_counter()
        await fn()
        out.append(time.perf_counter() - start)
    return out


def p(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


async def flushes(client: aioredis.Redis, rng: random.Random, rounds: int) -> dict[str, float]:
    """CPU seconds of this process per flush of 720 events, by path (see the module docstring)."""
    pipe = PipelinedRedis.of(client)
    assert pipe is not None
    paths = {"client": PrefixIndex(client, "bench-writes", ttl_ms=600_000),
             "pipelined": PrefixIndex(client, "bench-writes", ttl_ms=600_000, pipelined=pipe)}
    cpu: dict[str, list[float]] = {name: [] for name in paths}
    stored: dict[str, list[bytes]] = {name: [] for name in paths}
    for i in range(rounds):
        for name in (list(paths) if i % 2 == 0 else list(reversed(paths))):
            new = [rng.randbytes(16) for _ in range(360)]
            events = [(True, new), (False, stored[name])] if stored[name] else [(True, new)]
            start = time.process_time()
            await paths[name].apply(f"writer-{name}", 1, events)
            cpu[name].append(time.process_time() - start)
            stored[name] = new
    await pipe.aclose()
    return {name: statistics.median(samples[1:]) for name, samples in cpu.items()}


async def main_async() -> None:
    args = base_parser(__doc__ or "").parse_args()
    n = 300 if args.quick else 2000
    rng = random.Random(0)
    hasher = BlockHasher(16)
    hit_prompt = [rng.randrange(128_000) for _ in range(32_768)]
    miss_prompt = [rng.randrange(128_000) for _ in range(32_768)]
    hit_hashes, miss_hashes = hasher.hash_blocks(hit_prompt), hasher.hash_blocks(miss_prompt)
    report = Report()
    with EmbeddedRedis() as server:
        client = aioredis.Redis.from_url(server.url)
        index = PrefixIndex(client, "bench", ttl_ms=600_000)
        for worker_id, epoch in WORKERS:
            await index.add(worker_id, epoch, hit_hashes)
        ping = await timed(client.ping, n)
        full = await timed(lambda: index.lookup(hit_hashes, WORKERS), n)
        miss = await timed(lambda: index.lookup(miss_hashes, WORKERS), n)
        result = await index.lookup(hit_hashes, WORKERS)
        assert all(m.blocks == 2048 for m in result)
        assert all(m.blocks == 0 for m in await index.lookup(miss_hashes, WORKERS))

        async def worker(count: int) -> None:
            for i in range(count):
                await index.lookup(hit_hashes if i % 2 else miss_hashes, WORKERS)

        total = 1000 if args.quick else 5000
        start = time.perf_counter()
        await asyncio.gather(*(worker(total // 32) for _ in range(32)))
        throughput = (total // 32 * 32) / (time.perf_counter() - start)
        flush_cpu = await flushes(client, rng, 60 if args.quick else 300)
        await client.aclose()
    ping50 = statistics.median(ping)
    report.add("ping_p50", ping50 * 1e6, "us")
    report.add("lookup_full_hit_p50", statistics.median(full) * 1e6, "us")
    report.add("lookup_full_hit_p99", p(full, 0.99) * 1e6, "us")
    report.add("lookup_miss_p50", statistics.median(miss) * 1e6, "us")
    report.add("lookup_miss_p99", p(miss, 0.99) * 1e6, "us")
    report.add("full_hit_vs_ping", statistics.median(full) / ping50, "x")
    report.add("miss_vs_ping", statistics.median(miss) / ping50, "x")
    report.add("lookup_throughput_c32", throughput, "lookups/s")
    report.add("target_met", int(statistics.median(full) <= 4 * ping50 and statistics.median(miss) <= 4 * ping50),
               "bool")
    for path, seconds in flush_cpu.items():
        report.add(f"flush_cpu_{path}", seconds * 1e6, "us/flush")
    report.add("flush_cpu_pipelined_vs_client", flush_cpu["pipelined"] / flush_cpu["client"], "x")
    report.emit(args.json)


if __name__ == "__main__":
    asyncio.run(main_async())
