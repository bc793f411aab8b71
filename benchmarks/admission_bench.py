"""KV admission against a real Redis: reserve+release round trip and reservations per second.

One "router" is one process with its own Redis connection pool running 16 concurrent
reserve → release loops over 4 decode workers; the two-router case runs two such processes on
the same Redis at once (their bookings contend on the same keys, as replicas' do). The loops
release as the router does: in the background, riding along with the next reservations; their
latency figures are the reserve's. The serial round trip sends its release at once (``urgent``),
so it is two full script calls. ``script_calls_per_reservation`` shows the coalescing: booking
script calls sent per reservation made. ``admit_release_p50_c1_{credit,alone}`` go through the
router's ``Admission`` one request at a time, with credit (booked ahead, admitted in memory) and
with every request booked alone; ``admitted_on_credit_share`` is the share of the former that
needed no round trip.

    python benchmarks/admission_bench.py [--quick] [--json]
"""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import statistics
import time

import redis.asyncio as aioredis
from _report import Report, base_parser

from pdrouter.core.errors import CapacityError
from pdrouter.core.ids import Epoch, RequestId, WorkerId
from pdrouter.router.admission import Admission, AdmissionConfig
from pdrouter.state.embedded_redis import EmbeddedRedis
from pdrouter.state.reservations import DecodeCapacity, KvReservations

WORKERS = [DecodeCapacity(WorkerId(f"decode-{i}"), Epoch(1), 100_000) for i in range(4)]


async def _router(url: str, name: str, seconds: float, concurrency: int) -> tuple[int, list[float], int]:
    client = aioredis.Redis.from_url(url, max_connections=concurrency + 4)
    res = KvReservations(client, "bench")
    count = 0
    latencies: list[float] = []
    releases: set[asyncio.Task[int]] = set()
    end = time.perf_counter() + seconds

    async def loop(i: int) -> None:
        nonlocal count
        n = 0
        while time.perf_counter() < end:
            start = time.perf_counter()
            try:
                r = await res.reserve(RequestId(f"{name}-{i}-{n}"), 32, WORKERS, lease_ms=30_000)
            except CapacityError:
                continue
            latencies.append(time.perf_counter() - start)
            task = asyncio.ensure_future(res.release(r))
            releases.add(task)
            task.add_done_callback(releases.discard)
            n += 1
            count += 1

    await asyncio.gather(*(loop(i) for i in range(concurrency)))
    await res.flush()
    await asyncio.gather(*releases)
    await client.aclose()
    return count, latencies, res.round_trips


def _run(url: str, name: str, seconds: float, concurrency: int, out: mp.Queue) -> None:  # type: ignore[type-arg]
    out.put(asyncio.run(_router(url, name, seconds, concurrency)))


def measure(url: str, routers: int, seconds: float, concurrency: int) -> tuple[float, list[float], float]:
    ctx = mp.get_context("spawn")
    queue: mp.Queue = ctx.Queue()  # type: ignore[type-arg]
    procs = [ctx.Process(target=_run, args=(url, f"r{i}", seconds, concurrency, queue)) for i in range(routers)]
    for p in procs:
        p.start()
    results = [queue.get() for _ in procs]
    for p in procs:
        p.join()
    total = sum(c for c, _, _ in results)
    calls = sum(n for _, _, n in results)
    return total / seconds, [x for _, lat, _ in results for x in lat], calls / max(total, 1)


async def serial_round_trip(url: str, n: int) -> tuple[float, float]:
    client = aioredis.Redis.from_url(url)
    res = KvReservations(client, "bench")
    times, pings = [], []
    for i in range(n):
        start = time.perf_counter()
        r = await res.reserve(RequestId(f"serial-{i}"), 32, WORKERS, lease_ms=30_000)
        await res.release(r, urgent=True)
        times.append(time.perf_counter() - start)
        start = time.perf_counter()
        await client.ping()
        pings.append(time.perf_counter() - start)
    await client.aclose()
    return statistics.median(times), statistics.median(pings)


async def serial_admission(url: str, n: int, credit: float) -> tuple[float, float]:
    """Admit + release one request at a time through ``Admission``: (p50 seconds, share on credit)."""
    client = aioredis.Redis.from_url(url)
    adm = Admission(KvReservations(client, f"bench-credit-{credit}"), AdmissionConfig(credit_fraction=credit))
    times = []
    for i in range(n):
        start = time.perf_counter()
        r = await adm.admit(RequestId(f"adm-{i}"), 32, WORKERS)
        task = adm.release_soon(r)
        times.append(time.perf_counter() - start)
        if task is not None:
            await task  # a booking of its own: its release is a script call (off the request's path)
    share = adm.stats.admitted_on_credit / max(1, adm.stats.admitted)
    await adm.stop()
    await client.aclose()
    return statistics.median(times), share


def main() -> None:
    args = base_parser(__doc__ or "").parse_args()
    seconds = 3.0 if args.quick else 10.0
    report = Report()
    with EmbeddedRedis() as server:
        rt, ping = asyncio.run(serial_round_trip(server.url, 300 if args.quick else 2000))
        report.add("ping_p50", ping * 1e6, "us")
        report.add("reserve_release_p50_c1", rt * 1e6, "us")
        n = 300 if args.quick else 2000
        alone, _ = asyncio.run(serial_admission(server.url, n, 0.0))
        credited, share = asyncio.run(serial_admission(server.url, n, 0.05))
        report.add("admit_release_p50_c1_alone", alone * 1e6, "us")
        report.add("admit_release_p50_c1_credit", credited * 1e6, "us")
        report.add("admitted_on_credit_share", share, "ratio")
        for routers in (1, 2):
            rate, lat, calls = measure(server.url, routers, seconds, 16)
            lat.sort()
            report.add(f"reservations_per_s_{routers}_router{'s' if routers > 1 else ''}", rate, "1/s")
            report.add(f"reserve_p50_{routers}r_c16", statistics.median(lat) * 1e6, "us")
            report.add(f"reserve_p99_{routers}r_c16", lat[int(0.99 * len(lat))] * 1e6, "us")
            report.add(f"script_calls_per_reservation_{routers}r_c16", calls, "calls")
    report.emit(args.json)


if __name__ == "__main__":
    main()
