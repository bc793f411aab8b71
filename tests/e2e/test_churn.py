"""Churn: kill -9 a tenth of a simulated fleet mid-load, restart it, and count what the dead left behind.

40 simulated workers (20 prefill, 20 decode) run in 10 fleet processes of 4, so one process is 10%
of the fleet. A router in the test's loop serves a closed-loop load of concurrent completions
sharing a few prompt prefixes (so the prefix index fills). Mid-load one prefill and one decode
process are killed with SIGKILL and started again under the same worker ids (new incarnations,
new epochs). After the load every one of these must be zero:

* leaked bookings: entries in the booking hash, lease set and used counter of every dead decode
  incarnation (``PoolKeys.kv_bookings`` / ``kv_leases`` / ``kv_used``), once the lease has passed;
  and bookings anywhere, once the router's unused credit went back;
* index entries of dead incarnations: their own sets (``px:<worker>:<epoch>``), their members of
  the ``pxlive`` set, the slots still given to them (``pxslots``) and their bits in the per-block
  ``pxb:`` bitmaps, once the index TTL passed;
* hung requests: every request ended (200, or a clean error answer) within ``REQUEST_BOUND_S``;
* stranded work on the live workers: requests running or blocks allocated once all is idle.

Leases are short (the router's at ``LEASE_MS``; the index TTL is its floor of 10 s), so the test
takes about 20 s.
"""

from __future__ import annotations

import asyncio
import time

import redis.asyncio as aioredis

from pdrouter.cli.local_cluster import ManagedProcess, worker_args
from pdrouter.router.admission import AdmissionConfig
from pdrouter.router.dispatch import DispatchConfig
from pdrouter.state.registry import WorkerRegistry
from pdrouter.testing.leak_audit import LeakAudit
from pdrouter.testing.load import LoadOutcomes, classified_load
from pdrouter.wire.security import INTERNAL_TOKEN_ENV

from .conftest import Cluster

PER_PROCESS = 4
PROCESSES = 5  # per role
LEASE_MS = 2000
REQUEST_BOUND_S = 20.0
"""A request still unanswered after this long counts as hung."""
LOAD_S = 7.0
KILL_AT_S = 2.0
CONCURRENCY = 24
CLEAN_BOUND_S = 25.0
"""Everything the dead left must be gone within this long after the load ended."""
SYSTEM_PROMPTS = [f"System prompt {i}: you answer in one short line. " * 3 for i in range(4)]


def spawn_fleet(cluster: Cluster, role: str, index: int) -> ManagedProcess:
    first = index * PER_PROCESS
    args = worker_args(role, cluster.model, redis_url=cluster.redis_url, num_blocks=256,
                       sim=["--gpu", "h100", "--time-scale", "2"], count=PER_PROCESS, first_index=first,
                       extra=("--worker-id", f"churn-{role}", *(("--lease-ms", str(LEASE_MS)) if role == "decode"
                                                                else ())))
    proc = ManagedProcess(f"{role}-fleet-{index}", args, env={INTERNAL_TOKEN_ENV: cluster.internal_token})
    cluster.procs.append(proc)
    return proc


async def test_kill_a_tenth_of_the_fleet_mid_load_and_nothing_is_left_behind(cluster: Cluster) -> None:
    fleets = {(role, i): spawn_fleet(cluster, role, i) for role in ("prefill", "decode") for i in range(PROCESSES)}
    for proc in fleets.values():
        await asyncio.to_thread(proc.wait_ready_all, PER_PROCESS)
    router = await cluster.router(dispatch=DispatchConfig(local_prefill_tokens=0),
                                  admission_config=AdmissionConfig(queue_timeout_s=2.0, lease_ms=LEASE_MS))
    client = aioredis.Redis.from_url(cluster.redis_url)
    audit = LeakAudit(client, "tiny")
    registry = WorkerRegistry(client, "tiny")
    try:
        assert router.pool is not None
        for _ in range(100):
            if len(router.pool.workers()) == 2 * PROCESSES * PER_PROCESS:
                break
            await asyncio.sleep(0.05)
        loop = asyncio.get_running_loop()
        outcomes = LoadOutcomes()
        load_task = asyncio.create_task(classified_load(router.http_port, outcomes, model="tiny",
                                                        prompts=SYSTEM_PROMPTS, concurrency=CONCURRENCY,
                                                        until=loop.time() + LOAD_S, bound_s=REQUEST_BOUND_S))
        await asyncio.sleep(KILL_AT_S)
        victims = [("prefill", 0), ("decode", 0)]
        doomed = {f"churn-{role}-{i}" for role, index in victims
                  for i in range(index * PER_PROCESS, (index + 1) * PER_PROCESS)}
        dead: list[tuple[str, int]] = [(r.worker_id, int(r.epoch)) for r in await registry.records()
                                       if r.worker_id in doomed]
        assert len(dead) == 2 * PER_PROCESS
        for victim in victims:
            fleets[victim].kill()  # kill -9: no deregistration, no clean-up of any kind
        dead_decode = [(w, e) for w, e in dead if "decode" in w]
        at_kill = {"bookings": await audit.dead_bookings(dead_decode),
                   "index_entries": await audit.dead_index_entries(dead)}
        assert at_kill["index_entries"] > 0, at_kill  # the dead did leave something behind to clean up
        await asyncio.sleep(0.5)
        for victim in victims:  # the same worker ids again: new incarnations
            fleets[victim] = spawn_fleet(cluster, *victim)
        for victim in victims:
            await asyncio.to_thread(fleets[victim].wait_ready_all, PER_PROCESS)
        await asyncio.wait_for(load_task, LOAD_S + REQUEST_BOUND_S + 5)
        load_ended = time.monotonic()
        assert outcomes.hung == 0 and outcomes.broken == [], outcomes
        assert outcomes.ok > 2 * outcomes.failed_cleanly, outcomes  # the load went on around the churn

        restarted: dict[str, int] = {r.worker_id: int(r.epoch) for r in await registry.records()
                                     if r.worker_id in doomed}
        assert len(restarted) == len(dead) and all(restarted[w] > e for w, e in dead)  # new epochs

        census: dict[str, int] = {}
        while True:
            census = await audit.count_leftovers(dead, dead_decode)
            if not any(census.values()) or time.monotonic() - load_ended > CLEAN_BOUND_S:
                break
            await asyncio.sleep(0.5)
        print(f"churn: {outcomes.ok} ok, {outcomes.failed_cleanly} failed cleanly, {outcomes.hung} hung; "
              f"left by the dead at the kill {at_kill}, clean {time.monotonic() - load_ended:.1f} s after the load; "
              f"{census}")
        assert census == {"leaked_bookings": 0, "dead_index_entries": 0, "stranded_work": 0, "bookings": 0}, census
        assert len(await registry.live_workers()) == len(fleets) * PER_PROCESS
    finally:
        await client.aclose()
