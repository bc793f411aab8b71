"""Colocated vs disaggregated serving on equal resources, through the router, with real workers.

Both layouts get two worker processes and the same KV blocks in total: two colocated workers, or
one prefill + one decode worker. The same seeded workload (long prompts, short outputs, a fixed
number of concurrent clients) is streamed through the router's gRPC front door; per layout the
script prints time to first token and inter-token latency (p50 / p99), output tokens/s and
requests/s. Decode steps in a colocated worker share the engine with other requests' prefills
(chunked), so its inter-token latency has a prefill-shaped tail; the disaggregated layout moves that
conflict to the cluster, paying a KV transfer instead. On a 2-core CPU box the two layouts also
share cores, so read the ratios, not the absolute numbers.

    python benchmarks/pd_vs_colocated.py [--quick] [--json]
"""

from __future__ import annotations

import asyncio
import random
import tempfile
import time
from pathlib import Path

import grpc
from _report import Report, base_parser

from pdrouter.cli.local_cluster import ManagedProcess, cores_each, worker_args
from pdrouter.engine.model_io import make_model
from pdrouter.state.embedded_redis import EmbeddedRedis
from pdrouter.wire.v1 import common_pb2, router_pb2, router_pb2_grpc


def pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))] if values else float("nan")


async def one(stub: router_pb2_grpc.RouterStub, prompt: str, max_tokens: int,
              ttft: list[float], itl: list[float]) -> int:
    start = time.perf_counter()
    last = None
    tokens = 0
    request = router_pb2.GenerateRequest(model="tiny", text=prompt, sampling=common_pb2.SamplingParams(
        max_tokens=max_tokens, temperature=0.0, ignore_eos=True))
    async for msg in stub.Generate(request):
        if not msg.token_ids:
            continue
        now = time.perf_counter()
        if last is None:
            ttft.append(now - start)
        else:
            itl.append((now - last) / len(msg.token_ids))
        last = now
        tokens += len(msg.token_ids)
    return tokens


async def drive(address: str, prompts: list[str], max_tokens: int, concurrency: int) -> dict[str, float]:
    ttft: list[float] = []
    itl: list[float] = []
    queue = list(prompts)
    produced = 0
    async with grpc.aio.insecure_channel(address) as channel:
        stub = router_pb2_grpc.RouterStub(channel)
        for p in prompts[:2]:  # warm-up
            await one(stub, p, 4, [], [])

        async def client() -> None:
            nonlocal produced
            while queue:
                n = await one(stub, queue.pop(), max_tokens, ttft, itl)  # not `produced += await`: racy
                produced += n

        start = time.perf_counter()
        await asyncio.gather(*(client() for _ in range(concurrency)))
        elapsed = time.perf_counter() - start
    return {"ttft_p50_ms": pct(ttft, 0.5) * 1e3, "ttft_p99_ms": pct(ttft, 0.99) * 1e3,
            "itl_p50_ms": pct(itl, 0.5) * 1e3, "itl_p99_ms": pct(itl, 0.99) * 1e3,
            "output_tokens_per_s": produced / elapsed, "requests_per_s": len(prompts) / elapsed}


def run_layout(mode: str, model: Path, blocks_total: int, prompts: list[str], max_tokens: int,
               concurrency: int) -> dict[str, float]:
    procs: list[ManagedProcess] = []
    with EmbeddedRedis() as redis_server:
        try:
            roles = ["worker", "worker"] if mode == "colocated" else ["prefill", "decode"]
            threads = cores_each(len(roles) + 1)  # both layouts: the same cores per worker
            for i, role in enumerate(roles):
                proc = ManagedProcess(f"{role}-{i}", worker_args(role, model, redis_url=redis_server.url,
                                                                 num_blocks=blocks_total // 2, torch_threads=threads,
                                                                 extra=("--worker-id", f"{role}-{i}")))
                procs.append(proc)
                proc.wait_ready()
            router = ManagedProcess("router", ["router", "--model", str(model), "--redis", redis_server.url,
                                               "--mode", mode, "--http-port", "0", "--grpc-port", "0",
                                               "--local-prefill-tokens", "0", "--log-level", "WARNING"])
            procs.append(router)
            router.wait_ready()
            assert router.grpc_address is not None
            time.sleep(1.5)  # the router has discovered both workers
            return asyncio.run(drive(router.grpc_address, prompts, max_tokens, concurrency))
        finally:
            for proc in reversed(procs):
                proc.stop()


def main() -> None:
    parser = base_parser(__doc__ or "")
    parser.add_argument("--requests", type=int, default=48)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--prompt-chars", type=int, default=600)
    parser.add_argument("--max-tokens", type=int, default=48)
    args = parser.parse_args()
    if args.quick:
        args.requests, args.max_tokens = 12, 16
    rng = random.Random(0)
    words = ["alpha", "beta", "gamma", "delta", "epsilon", "zeta", "eta", "theta", "iota", "kappa", "lambda", "mu"]
    prompts = [" ".join(rng.choice(words) for _ in range(args.prompt_chars // 6)) for _ in range(args.requests)]
    report = Report()
    with tempfile.TemporaryDirectory() as tmp:
        model = make_model("tiny", 0, Path(tmp) / "tiny")
        results = {mode: run_layout(mode, model, 1024, prompts, args.max_tokens, args.concurrency)
                   for mode in ("colocated", "disaggregated")}
    for mode, figures in results.items():
        for name, value in figures.items():
            unit = name.rsplit("_", 1)[-1] if name.endswith("_ms") else ("1/s" if "per_s" in name else "")
            report.add(f"{mode}_{name}", round(value, 3), unit)
    c, d = results["colocated"], results["disaggregated"]
    report.add("itl_p99_disagg_vs_colocated", round(d["itl_p99_ms"] / c["itl_p99_ms"], 3), "x")
    report.add("ttft_p50_disagg_vs_colocated", round(d["ttft_p50_ms"] / c["ttft_p50_ms"], 3), "x")
    report.add("throughput_disagg_vs_colocated", round(d["output_tokens_per_s"] / c["output_tokens_per_s"], 3), "x")
    report.emit(args.json)


if __name__ == "__main__":
    main()
