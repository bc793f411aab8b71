"""A router's gRPC door under 200 hostile connections at once, none holding the API key.

One ``pdrouter router`` process (an API key, Redis, no workers: nothing here reaches a worker) is
sent, all at once, a quarter each of:

* ``silent``: TCP connections that never send a byte;
* ``slow-preface``: connections that trickle the HTTP/2 preface a byte every half second;
* ``huge``: calls without the key whose message announces 60 MiB, pushed as fast as flow control lets;
* ``slow``: the same calls, their message trickled a byte every half second.

Figures: how many were refused (the calls: UNAUTHENTICATED) or closed (the handshakes) and how
many were still open after twice the handshake deadline; the longest time to refusal and to close,
against that deadline; the most message bytes a refused call had sent; the router's resident
memory before, at its peak during the flood (sampled every 20 ms) and after; and whether a call
with the key was served during the flood.

    python benchmarks/unauthenticated_flood.py [--quick] [--json] [--connections N]

``--quick`` runs the router with a 2 s handshake deadline (the default is 5 s).
"""

from __future__ import annotations

import asyncio
import secrets
import tempfile
import time
from collections import Counter
from pathlib import Path

import grpc
import psutil
from _report import Report, base_parser

from pdrouter.cli.local_cluster import ManagedProcess
from pdrouter.core.model_spec import get_model_preset
from pdrouter.engine.model_folder import write_config_folder
from pdrouter.router.frontdoor.auth import ENV_VAR
from pdrouter.state.embedded_redis import EmbeddedRedis
from pdrouter.testing.grpc_probe import ProbeResult, probe
from pdrouter.wire.v1 import router_pb2, router_pb2_grpc

KINDS = ("silent", "slow-preface", "huge", "slow")
MiB = 1 << 20


async def flood(port: int, kinds: list[str], wait_s: float) -> list[ProbeResult]:
    return list(await asyncio.gather(*(probe("127.0.0.1", port, kind, trickle_s=0.5, wait_s=wait_s)
                                       for kind in kinds)))


async def sample_rss(process: psutil.Process, peak: list[int], stop: asyncio.Event) -> None:
    while not stop.is_set():
        peak[0] = max(peak[0], process.memory_info().rss)
        await asyncio.sleep(0.02)


async def keyed_call(address: str, key: str) -> bool:
    async with grpc.aio.insecure_channel(address) as channel:
        stub = router_pb2_grpc.RouterStub(channel)
        reply = await stub.ListModels(router_pb2.ListModelsRequest(), metadata=(("authorization", f"Bearer {key}"),),
                                      timeout=30)
        return bool(reply.models)


async def measure(router: ManagedProcess, key: str, connections: int, handshake_s: float, report: Report) -> None:
    assert router.grpc_address is not None
    port = int(router.grpc_address.rpartition(":")[2])
    process = psutil.Process(router.proc.pid)
    kinds = [KINDS[i % len(KINDS)] for i in range(connections)]
    before = process.memory_info().rss
    peak, stop = [before], asyncio.Event()
    sampler = asyncio.ensure_future(sample_rss(process, peak, stop))
    started = time.monotonic()
    flooding = asyncio.ensure_future(flood(port, kinds, wait_s=2 * handshake_s))
    await asyncio.sleep(0.5)  # every connection is open and at work
    served = await keyed_call(router.grpc_address, key)
    results = await flooding
    took = time.monotonic() - started
    stop.set()
    await sampler
    await asyncio.sleep(1.0)
    after = process.memory_info().rss
    outcomes: Counter[str] = Counter()
    for kind, result in zip(kinds, results, strict=True):
        if kind in ("huge", "slow"):
            outcomes["refused" if (result.outcome, result.status) == ("ended", 16) else "not refused"] += 1
        else:
            outcomes["closed" if result.outcome == "closed" else "not closed"] += 1
    calls = [r for k, r in zip(kinds, results, strict=True) if k in ("huge", "slow")]
    handshakes = [r for k, r in zip(kinds, results, strict=True) if k in ("silent", "slow-preface")]
    report.add("connections", connections, "count")
    report.add("handshake_deadline", handshake_s, "s")
    report.add("calls_refused_unauthenticated", outcomes["refused"], "count")
    report.add("calls_not_refused", outcomes["not refused"], "count")
    report.add("handshakes_closed", outcomes["closed"], "count")
    report.add("handshakes_not_closed", outcomes["not closed"], "count")
    report.add("still_open_after_twice_the_deadline", sum(r.outcome == "open" for r in results), "count")
    report.add("refusal_time_max", max((r.elapsed_s for r in calls), default=0.0), "s")
    report.add("handshake_close_time_max", max((r.elapsed_s for r in handshakes), default=0.0), "s")
    report.add("message_bytes_sent_before_refusal_max", max((r.sent for r in calls), default=0), "bytes")
    report.add("keyed_call_served_during_flood", int(served), "bool")
    report.add("router_rss_before", before / MiB, "MiB")
    report.add("router_rss_peak", peak[0] / MiB, "MiB")
    report.add("router_rss_growth_peak", (peak[0] - before) / MiB, "MiB")
    report.add("router_rss_after", after / MiB, "MiB")
    report.add("flood_duration", took, "s")


def main() -> None:
    parser = base_parser(__doc__.splitlines()[0])
    parser.add_argument("--connections", type=int, default=200, help="hostile connections, at once (default 200)")
    args = parser.parse_args()
    handshake_s = 2.0 if args.quick else 5.0
    key = secrets.token_urlsafe(24)
    report = Report()
    with tempfile.TemporaryDirectory(prefix="pdrouter-flood-") as tmp, EmbeddedRedis() as redis:
        model = Path(tmp) / "tiny"
        write_config_folder(get_model_preset("tiny"), model)
        router = ManagedProcess("router", ["router", "--model", str(model), "--redis", redis.url, "--http-port", "0",
                                           "--grpc-port", "0", "--grpc-handshake-timeout", str(handshake_s),
                                           "--log-level", "ERROR"], env={ENV_VAR: key})
        try:
            router.wait_ready()
            asyncio.run(measure(router, key, args.connections, handshake_s, report))
        finally:
            router.stop()
    report.emit(args.json)


if __name__ == "__main__":
    main()
