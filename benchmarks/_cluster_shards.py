"""How the load of model pools spreads over the shards of a Redis Cluster (``measure_shards``).

Starts an :class:`~pdrouter.testing.redis_cluster.EmbeddedRedisCluster` (3 masters, one replica
each) and drives the real code paths of ``pdrouter.state`` against it for a few seconds per
scenario, as a pool's workers and routers do:

* per pool, ``WORKERS`` simulated workers (a quarter of them decode): a heartbeat
  (``WorkerRegistry.heartbeat``) and an index ``touch`` each, then a block event each
  (``PrefixIndex.apply``: a few blocks stored, some removed);
* per pool, a router loop: ``live_workers``, a prefix ``lookup`` of a prompt the fleet partly
  holds, a booking on the decode workers (``KvReservations.reserve``), a ``renew`` and a
  ``release``; and the sweep of lapsed incarnations (``PrefixIndex.sweep``).

Each master's commands are counted with ``INFO commandstats`` after ``CONFIG RESETSTAT``: every
command it executed, those run inside a script as well as the script's ``EVALSHA`` (the work a
shard does), housekeeping such as ``INFO``, ``PING``, ``CLUSTER`` left out. Figures, per scenario
``<s>`` and per master ``<i>`` (ordered by the slots it serves). The scenarios: ``1pool_oneslot``:
one model pool with every key under the pool's hash tag (the layout on one Redis); ``1pool``: the
same pool with its bookings under a tag of their own (``PoolKeys.bookings_apart``, the layout on a
Redis Cluster); ``<P>pools``: P pools under the same per-pool load, cluster layout.

* ``cluster_<s>_shard<i>_ops``: commands per second on that master;
* ``cluster_<s>_shard<i>_share``: its share of all the commands;
* ``cluster_<s>_max_share``: the busiest master's share (100 %: one shard carries everything);
* ``cluster_<s>_shards_used``: masters that served more than 1 % of the commands;
* ``cluster_<s>_ops``: commands per second over the whole cluster.

A pool's registry and prefix index share one slot, and its bookings another, so one pool's load
lands on at most two masters whatever the cluster's size (one when the two tags hash to slots of
the same master); pools spread over the masters by the slots of their names.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Sequence
from typing import Any

from _report import Report, base_parser

from pdrouter.core.ids import BlockHash, Epoch, WorkerId
from pdrouter.core.workers import WorkerLoad, WorkerRecord, WorkerRole
from pdrouter.state.client import RedisClient, redis_client
from pdrouter.state.prefix_index import HASH_BYTES, PrefixIndex
from pdrouter.state.registry import WorkerRegistry
from pdrouter.state.reservations import BookingId, DecodeCapacity, KvReservations
from pdrouter.testing.redis_cluster import EmbeddedRedisCluster

WORKERS = 16
"""Simulated workers per pool."""

POOLS = ("llama-3-8b", "llama-3-70b", "qwen2-7b", "mistral-7b", "gemma-2-9b", "phi-3-mini")
"""The pool names of the many-pool scenario (real-looking model names: their slots are what they are)."""

HOUSEKEEPING = frozenset({"info", "config", "ping", "cluster", "command", "client", "hello", "auth", "select",
                          "readonly", "script", "slowlog", "replconf"})
"""Commands not counted: the benchmark's and the client's own bookkeeping."""


class _Pool:
    """One model pool's workers and router, driving the real state code."""

    def __init__(self, client: RedisClient, name: str, workers: int, rng: random.Random,
                 bookings_apart: bool | None = None) -> None:
        self.name = name
        self.registry = WorkerRegistry(client, name, heartbeat_ttl_ms=10_000)
        self.index = PrefixIndex(client, name, ttl_ms=10_000)
        self.bookings = KvReservations(client, name, resize_delay_s=0.0, bookings_apart=bookings_apart)
        self.rng = rng
        self.records: list[WorkerRecord] = []
        self.workers = workers
        self.prompt = [BlockHash(rng.randbytes(HASH_BYTES)) for _ in range(64)]
        self.held: dict[WorkerId, list[bytes]] = {}
        self.booked = 0

    async def start(self) -> None:
        for i in range(self.workers):
            role = WorkerRole.DECODE if i % 4 == 3 else WorkerRole.PREFILL
            epoch = await self.registry.new_epoch()
            record = WorkerRecord(worker_id=WorkerId(f"{role.value}-{i}"), role=role, address=f"10.0.0.{i}:5000",
                                  epoch=epoch, model=self.name, model_compat_hash="m", kv_compat_hash="k",
                                  block_size=16, capacity_blocks=10_000)
            await self.registry.register(record)
            self.records.append(record)
            # Worker i holds the shared prompt's first blocks (deeper for lower i) and some of its own.
            depth = max(1, len(self.prompt) * (self.workers - i) // self.workers)
            own = [self.rng.randbytes(HASH_BYTES) for _ in range(32)]
            self.held[record.worker_id] = own
            await self.index.apply(record.worker_id, epoch, [(True, [*self.prompt[:depth], *own])])

    def decodes(self) -> list[DecodeCapacity]:
        return [DecodeCapacity(r.worker_id, r.epoch, r.capacity_blocks) for r in self.records
                if r.role == WorkerRole.DECODE]

    async def worker_round(self) -> None:
        """Every worker: heartbeat, touch, one block event (4 stored, 2 of its oldest removed)."""
        load = WorkerLoad(running=2, free_blocks=9_000, total_blocks=10_000)

        async def one(record: WorkerRecord) -> None:
            await self.registry.heartbeat(record.worker_id, record.epoch, load)
            await self.index.touch(record.worker_id, record.epoch)
            own = self.held[record.worker_id]
            new = [self.rng.randbytes(HASH_BYTES) for _ in range(4)]
            gone, self.held[record.worker_id] = own[:2], own[2:] + new
            await self.index.apply(record.worker_id, record.epoch, [(True, new), (False, gone)])

        await asyncio.gather(*(one(r) for r in self.records))

    async def router_round(self, rounds: int) -> None:
        """``rounds`` requests: list the workers, look the prompt up, book, renew, release."""
        decodes = self.decodes()
        prefills = [(r.worker_id, Epoch(r.epoch)) for r in self.records if r.role == WorkerRole.PREFILL]

        async def one(n: int) -> None:
            await self.index.matched_blocks(self.prompt[: 16 + n % 48], prefills)
            booking = await self.bookings.reserve(BookingId(f"{self.name}-{self.booked}-{n}"), 8, decodes, 5_000)
            await self.bookings.renew(booking)
            await self.bookings.release(booking, urgent=True)

        await self.registry.live_workers()
        await asyncio.gather(*(one(n) for n in range(rounds)))
        self.booked += rounds
        await self.index.sweep(max_calls=2)


async def _master_clients(cluster: EmbeddedRedisCluster) -> list[Any]:
    import redis.asyncio as aioredis

    return [aioredis.Redis(host="127.0.0.1", port=s.master_port) for s in cluster.shards()]


async def _counted(masters: Sequence[Any]) -> list[int]:
    """Commands served by each master since its last ``CONFIG RESETSTAT`` (housekeeping left out)."""
    counts = []
    for m in masters:
        stats = await m.info("commandstats")
        total = 0
        for name, entry in stats.items():
            command = name.removeprefix("cmdstat_").split("|")[0].lower()
            if command not in HOUSEKEEPING:
                total += int(entry["calls"])
        counts.append(total)
    return counts


async def _scenario(label: str, client: RedisClient, cluster: EmbeddedRedisCluster, names: Sequence[str],
                    seconds: float, report: Report, bookings_apart: bool | None = None) -> None:
    await client.flushall()  # every master
    rng = random.Random(7)
    pools = [_Pool(client, name, WORKERS, rng, bookings_apart) for name in names]
    for pool in pools:
        await pool.start()
    masters = await _master_clients(cluster)
    try:
        for m in masters:
            await m.config_resetstat()
        start = time.perf_counter()
        while time.perf_counter() - start < seconds:
            await asyncio.gather(*(p.worker_round() for p in pools), *(p.router_round(8) for p in pools))
        elapsed = time.perf_counter() - start
        counts = await _counted(masters)
    finally:
        for m in masters:
            await m.aclose()
    total = sum(counts) or 1
    for i, n in enumerate(counts):
        report.add(f"cluster_{label}_shard{i}_ops", n / elapsed, "ops/s")
        report.add(f"cluster_{label}_shard{i}_share", 100.0 * n / total, "%")
    report.add(f"cluster_{label}_max_share", 100.0 * max(counts) / total, "%")
    report.add(f"cluster_{label}_shards_used", sum(1 for n in counts if n > total / 100), "masters")
    report.add(f"cluster_{label}_ops", sum(counts) / elapsed, "ops/s")


async def measure_shards(report: Report, *, quick: bool) -> None:
    """Start a 3-master Redis Cluster, drive one pool (in one slot, then with its bookings apart),
    then ``len(POOLS)`` pools through the real state code, and add each master's ops/s and share
    of the commands to ``report``. About 10 s with ``quick``, 25 s without."""
    seconds = 2.0 if quick else 6.0
    cluster = await asyncio.to_thread(EmbeddedRedisCluster().start)
    try:
        client = redis_client(cluster.url, max_connections=64, pool_timeout_s=5.0)
        try:
            await _scenario("1pool_oneslot", client, cluster, POOLS[:1], seconds, report, bookings_apart=False)
            await _scenario("1pool", client, cluster, POOLS[:1], seconds, report)
            await _scenario(f"{len(POOLS)}pools", client, cluster, POOLS, seconds, report)
        finally:
            await client.aclose()
    finally:
        await asyncio.to_thread(cluster.close)


def main() -> None:
    args = base_parser("Ops per Redis Cluster shard under the real state code paths").parse_args()
    report = Report()
    asyncio.run(measure_shards(report, quick=args.quick))
    report.emit(args.json)


if __name__ == "__main__":
    main()
