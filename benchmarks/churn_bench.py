"""Churn at scale: kill -9 a tenth of a simulated fleet mid-load, restart it, count what is left behind.

A simulated fleet (``--workers``, half prefill and half decode, Llama-3-8B on H100s at time scale
1) runs in fleet processes of ``--per-process`` workers (``pdrouter prefill|decode --backend sim
--count N``), against an embedded Redis; a router in this process serves a closed loop of
``--concurrency`` completions sharing a few prompt prefixes for ``--seconds``. At 30% of the load
``--kill-fraction`` of the processes (at least one prefill and one decode process, half each) are
killed with SIGKILL and started again at once under the same worker ids (new incarnations;
``--no-restart`` leaves them dead). The
router's booking lease is ``--lease-ms``; the prefix index TTL is its floor of 10 s.

Figures:

* ``workers``, ``processes``, ``killed_workers`` and ``killed_fraction``;
* ``requests_ok``, ``requests_failed_cleanly`` (an error answer: 429, 503…), ``requests_hung`` (no
  answer within 30 s) and ``requests_broken`` (a dropped connection, a body not in the API's form);
* ``left_at_kill_bookings``, ``left_at_kill_booked_blocks`` and ``left_at_kill_index_entries``:
  what the dead incarnations held in Redis just after the kill (bookings, the blocks they book,
  prefix index entries);
* ``leaked_bookings`` (the dead decode incarnations' booking entries, leases and booked blocks
  together), ``dead_index_entries``, ``stranded_work`` (requests running and blocks
  allocated on the live workers) and ``bookings`` (blocks booked on any incarnation), once
  clean or after the bound: all must be 0;
* ``seconds_until_dead_bookings_gone`` and ``seconds_until_dead_index_gone``: from the kill until
  the dead incarnations' bookings, and their index entries, were all gone (polled every 0.25 s
  while the load runs on; -1: not within the bound), and
  ``seconds_until_idle_clean_after_load``: from the end of the load until all four counts are 0;
* ``restart_s``: from the kill until every worker of the restarted processes was ready;
* ``fleet_rss_mib``, ``fleet_rss_mib_per_worker``, ``fleet_rss_mib_max_process`` and
  ``fleet_threads_max_process`` after the run (a prefill worker keeps a KV connection, with a
  sending and an acknowledging thread, to each decode worker it has sent to).

    python benchmarks/churn_bench.py [--quick] [--json] [--workers 128] [--per-process 8] [--seconds 30]
"""

from __future__ import annotations

import argparse
import asyncio
import faulthandler
import logging
import math
import os
import secrets
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import redis.asyncio as aioredis
from _report import Report, base_parser

from pdrouter.cli.local_cluster import ManagedProcess, stop_all, worker_args
from pdrouter.core.model_spec import get_model_preset
from pdrouter.engine.model_folder import write_config_folder
from pdrouter.router.admission import AdmissionConfig
from pdrouter.router.config import RouterConfig
from pdrouter.router.dispatch import DispatchConfig
from pdrouter.router.server import RouterProcess
from pdrouter.state.embedded_redis import EmbeddedRedis
from pdrouter.state.registry import WorkerRegistry
from pdrouter.testing.leak_audit import LeakAudit
from pdrouter.testing.load import LoadOutcomes, classified_load
from pdrouter.wire.security import INTERNAL_TOKEN_ENV

MODEL, GPU = "llama-3-8b", "h100"
REQUEST_BOUND_S = 30.0
CLEAN_BOUND_S = 40.0
SYSTEM_PROMPTS = [f"System prompt {i}: answer every question in one short line, politely. " * 8 for i in range(8)]


@dataclass
class Fleets:
    """The fleet processes, by (role, index); every one is started with the same arguments again on restart."""

    folder: Path
    redis_url: str
    per_process: int
    env: dict[str, str]
    lease_ms: int
    procs: dict[tuple[str, int], ManagedProcess] = field(default_factory=dict)
    dead: list[ManagedProcess] = field(default_factory=list)

    def spawn(self, role: str, index: int) -> ManagedProcess:
        extra = ["--worker-id", f"churn-{role}", "--log-level", "ERROR"]
        if role == "decode":
            extra += ["--lease-ms", str(self.lease_ms)]
        args = worker_args(role, self.folder, redis_url=self.redis_url, sim=["--gpu", GPU, "--time-scale", "1"],
                           count=self.per_process, first_index=index * self.per_process, extra=extra)
        proc = self.procs[(role, index)] = ManagedProcess(f"{role}-{index}", args, env=self.env)
        return proc

    def ids(self, role: str, index: int) -> set[str]:
        return {f"churn-{role}-{i}" for i in range(index * self.per_process, (index + 1) * self.per_process)}


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


async def run(args: argparse.Namespace, report: Report) -> None:
    per = args.per_process
    per_role = math.ceil(args.workers / 2 / per)
    killed_per_role = max(1, round(per_role * args.kill_fraction))
    with tempfile.TemporaryDirectory(prefix="churn-") as tmp, EmbeddedRedis() as redis_server:
        folder = write_config_folder(get_model_preset(MODEL), Path(tmp) / MODEL)
        token = secrets.token_hex(16)
        env = {INTERNAL_TOKEN_ENV: token, "PDROUTER_KV_TOKEN": os.environ.get("PDROUTER_KV_TOKEN")
               or secrets.token_hex(16)}
        fleets = Fleets(folder, redis_server.url, per, env, args.lease_ms)
        for role in ("prefill", "decode"):
            for i in range(per_role):
                fleets.spawn(role, i)
        router: RouterProcess | None = None
        client = aioredis.Redis.from_url(redis_server.url)
        try:
            for proc in list(fleets.procs.values()):
                await asyncio.to_thread(proc.wait_ready_all, per, 120.0)
            total = per * len(fleets.procs)
            report.add("workers", total, "workers")
            report.add("processes", len(fleets.procs), "processes")
            router = RouterProcess(RouterConfig(
                model_dir=folder, redis_url=redis_server.url, http_port=0, grpc_port=0, refresh_interval_s=0.5,
                internal_token=token, dispatch=DispatchConfig(local_prefill_tokens=0),
                admission_config=AdmissionConfig(queue_timeout_s=2.0, lease_ms=fleets.lease_ms)))
            await router.start()
            assert router.pool is not None
            for _ in range(600):
                if len(router.pool.workers()) == total:
                    break
                await asyncio.sleep(0.1)
            registry = WorkerRegistry(client, MODEL)
            audit = LeakAudit(client, MODEL)
            loop = asyncio.get_running_loop()
            outcomes = LoadOutcomes()
            seconds = args.seconds
            load = asyncio.create_task(classified_load(router.http_port, outcomes, model=MODEL,
                                                       prompts=SYSTEM_PROMPTS, concurrency=args.concurrency,
                                                       until=loop.time() + seconds, bound_s=REQUEST_BOUND_S))
            await asyncio.sleep(0.3 * seconds)
            victims = [(role, i) for role in ("prefill", "decode") for i in range(killed_per_role)]
            doomed = set().union(*(fleets.ids(*v) for v in victims))
            dead: list[tuple[str, int]] = [(r.worker_id, int(r.epoch)) for r in await registry.records()
                                           if r.worker_id in doomed]
            for victim in victims:
                fleets.procs[victim].kill()
                fleets.dead.append(fleets.procs[victim])
            killed_at = time.monotonic()
            dead_decode = [(w, e) for w, e in dead if "decode" in w]
            gone_at: dict[str, float] = {}

            async def watch_dead() -> None:
                """When the dead incarnations' bookings, and their index entries, were all gone (polled)."""
                while len(gone_at) < 2:
                    if "bookings" not in gone_at and await audit.dead_bookings(dead_decode) == 0:
                        gone_at["bookings"] = time.monotonic()
                    if "index" not in gone_at and await audit.dead_index_entries(dead) == 0:
                        gone_at["index"] = time.monotonic()
                    await asyncio.sleep(0.25)

            watcher = asyncio.create_task(watch_dead())
            report.add("killed_workers", len(dead), "workers")
            report.add("killed_fraction", len(dead) / total, "")
            entries, _, blocks = await audit.booking_parts(dead_decode)
            report.add("left_at_kill_bookings", entries, "bookings")
            report.add("left_at_kill_booked_blocks", blocks, "blocks")
            report.add("left_at_kill_index_entries", await audit.dead_index_entries(dead), "entries")
            if not args.no_restart:
                restarted = [fleets.spawn(*victim) for victim in victims]
                for proc in restarted:
                    await asyncio.to_thread(proc.wait_ready_all, per, 120.0)
                report.add("restart_s", time.monotonic() - killed_at, "s")
            await asyncio.wait_for(load, seconds + REQUEST_BOUND_S + 10)
            load_ended = time.monotonic()
            census: dict[str, int] = {}
            while True:
                census = await audit.count_leftovers(dead, dead_decode)
                if not any(census.values()) or time.monotonic() - load_ended > CLEAN_BOUND_S:
                    break
                await asyncio.sleep(0.5)
            clean_at = time.monotonic()
            if not watcher.done():
                watcher.cancel()
            report.add("requests_ok", outcomes.ok, "requests")
            report.add("requests_failed_cleanly", outcomes.failed_cleanly, "requests")
            report.add("requests_hung", outcomes.hung, "requests")
            report.add("requests_broken", len(outcomes.broken), "requests")
            report.add("requests_per_s", (outcomes.ok + outcomes.failed_cleanly) / seconds, "requests/s")
            for name, value in census.items():
                report.add(name, value, "entries" if name != "stranded_work" else "requests+blocks")
            clean = not any(census.values())
            for what in ("bookings", "index"):
                report.add(f"seconds_until_dead_{what}_gone", gone_at[what] - killed_at if what in gone_at else -1.0,
                           "s")
            report.add("seconds_until_idle_clean_after_load", clean_at - load_ended if clean else -1.0, "s")
            alive = [p for p in fleets.procs.values() if p.alive]
            rss = [rss_mib(p.proc.pid) for p in alive]
            report.add("fleet_rss_mib", sum(rss), "MiB")
            report.add("fleet_rss_mib_per_worker", sum(rss) / total, "MiB")
            report.add("fleet_rss_mib_max_process", max(rss), "MiB")
            report.add("fleet_threads_max_process", max(len(os.listdir(f"/proc/{p.proc.pid}/task")) for p in alive),
                       "threads")
            for sample in outcomes.broken[:3]:
                print(f"# broken: {sample}")
        finally:
            if router is not None:
                await router.stop(grace=1.0)
            await client.aclose()
            stop_all(list(fleets.procs.values()))
            for proc in fleets.dead:
                proc.stop()


def main() -> None:
    parser = base_parser(__doc__ or "")
    parser.add_argument("--workers", type=int, default=128, help="simulated workers, half prefill, half decode")
    parser.add_argument("--per-process", type=int, default=8, help="workers per fleet process")
    parser.add_argument("--kill-fraction", type=float, default=0.1, help="share of the processes killed")
    parser.add_argument("--concurrency", type=int, default=64, help="requests in flight")
    parser.add_argument("--seconds", type=float, default=30.0, help="load duration (wall)")
    parser.add_argument("--lease-ms", type=int, default=2000, help="the router's booking lease")
    parser.add_argument("--no-restart", action="store_true",
                        help="leave the killed processes dead (what the dead leave, without new incarnations)")
    args = parser.parse_args()
    logging.basicConfig(level=logging.ERROR)  # the router's warnings about the dead workers are expected
    # A run that hangs prints every thread's stack and exits instead of waiting forever.
    faulthandler.dump_traceback_later(60 + 4 * args.seconds + args.workers, exit=True)
    if args.quick:
        args.workers, args.per_process, args.seconds, args.concurrency = 40, 2, 6.0, 24
    report = Report()
    asyncio.run(run(args, report))
    report.emit(args.json)


if __name__ == "__main__":
    main()
