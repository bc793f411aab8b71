"""Simulated workers' CPU per output token, in instant mode, and against another commit in the same run.

Simulated GPUs (``--backend sim --time-scale 0``, ``--model-preset llama-3-8b --gpu h100``) are
driven straight, without a router, the way the router drives them: a colocated worker's
``ColocatedWorker.Generate``, and a prefill + decode pair's ``DecodeWorker.Serve`` (the decode
worker reserves the blocks, calls the prefill worker, which computes the prompt and sends its KV
over TCP with MACs, then decodes). Workload: 8 shared 2,000-token prefixes each followed by a
unique 200-token suffix, 16 output tokens (``ignore_eos``), concurrency 32, over the workers' lanes;
streamed (a chunk per token) and ``whole`` (a non-streaming caller: the tokens in one chunk).

``--time-scale S`` runs the simulated GPUs at time scale ``S`` instead (1: each step takes its modeled
time, as in a load test at time scale 1; the workers sleep between steps, so each step wakes them with
cold caches), and ``--output-tokens N`` asks ``N`` tokens a request: with many tokens a request, the
per-token cost of a stream (a step's outputs handed to the event loop, a chunk through the worker's
layers and onto its lane) outweighs the per-request one.

Per mode and kind: ``<mode>_<kind>_cpu_per_token``: the CPU time of the worker processes (all their
threads, from each process's CPU-time clock, over the measured phases) ÷ the output tokens they
produced; ``..._cpu_per_request`` the same per request.

``--vs REV``: the same workers of commit ``REV`` as well (its ``pdrouter`` package exported with
``git archive`` and put first on the workers' ``PYTHONPATH``), phases alternating between the two
trees (the order reversed every round), so that the machine's drift hits both alike.
``..._vs_cpu_per_token`` is theirs, ``..._ratio`` theirs ÷ this tree's (the median of the rounds'
ratios, with ``..._ratio_min`` / ``..._ratio_max``): how many times less CPU a token costs now.

    python benchmarks/sim_worker_cpu.py [--quick] [--json] [--vs REV] [--concurrency N] [--mode colocated|pd]
                                        [--kind stream|whole] [--rounds N] [--requests N]
                                        [--time-scale S] [--output-tokens N]
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import os
import random
import secrets
import statistics
import tempfile
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from _load import cpu_seconds
from _report import Report, base_parser
from tracing_overhead import export_tree

from pdrouter.cli.local_cluster import ManagedProcess, worker_args
from pdrouter.core.sampling import SamplingParams
from pdrouter.core.tokens import pack_token_ids
from pdrouter.state.embedded_redis import EmbeddedRedis
from pdrouter.wire.convert import sampling_to_pb
from pdrouter.wire.grpc_util import CHANNEL_OPTIONS
from pdrouter.wire.lane import LaneChannel, request_stubs
from pdrouter.wire.v1 import common_pb2, worker_pb2, worker_pb2_grpc

PRESET = "llama-3-8b"
GPU = "h100"
PREFIXES = 8
PREFIX_TOKENS = 2_000
SUFFIX_TOKENS = 200
OUTPUT_TOKENS = 16
TOKEN_RANGE = (32, 127)
"""Prompt ids drawn from printable ASCII (the byte-level tokenizer of a preset's simulated worker)."""


@dataclass(frozen=True)
class Plan:
    requests: int
    """Requests per phase."""
    rounds: int
    warmup: int
    output_tokens: int = OUTPUT_TOKENS
    """Tokens a request asks for."""
    time_scale: float = 0.0
    """The simulated GPUs' time scale (0: instant)."""


QUICK = Plan(requests=64, rounds=2, warmup=32)
FULL = Plan(requests=192, rounds=5, warmup=96)


def prompts(seed: int) -> Iterator[list[int]]:
    """Endless prompts: one of the shared prefixes, then a unique suffix."""
    rng = random.Random(seed)
    low, high = TOKEN_RANGE
    prefixes = [[rng.randrange(low, high) for _ in range(PREFIX_TOKENS)] for _ in range(PREFIXES)]
    for i in itertools.count():
        yield prefixes[i % PREFIXES] + [rng.randrange(low, high) for _ in range(SUFFIX_TOKENS)]


class Link:
    """A worker's request stubs over its lane."""

    def __init__(self, info: common_pb2.WorkerInfo) -> None:
        self.info = info
        self._lane = LaneChannel(info.lane_address)
        self.prefill, self.decode, self.colocated = request_stubs(None, self._lane)

    async def close(self) -> None:
        await self._lane.close()


async def worker_info(address: str) -> common_pb2.WorkerInfo:
    import grpc

    async with grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS) as channel:
        info: common_pb2.WorkerInfo = await worker_pb2_grpc.WorkerInfoServiceStub(channel).GetInfo(
            worker_pb2.GetInfoRequest())
    return info


async def _drain(call: AsyncIterator[common_pb2.TokenChunk]) -> int:
    tokens = 0
    async for chunk in call:
        tokens += len(chunk.token_ids)
    return tokens


@dataclass
class Cluster:
    """One tree's workers: a colocated worker, and a prefill + decode pair."""

    label: str
    procs: dict[str, ManagedProcess]
    output_tokens: int = OUTPUT_TOKENS
    packed: bool = True
    """Its workers take a packed prompt (``prompt_token_bytes``), as a router of their tree sends it."""
    links: dict[str, Link] = field(default_factory=dict)
    seq: Iterator[int] = field(default_factory=itertools.count)

    def pids(self, mode: str) -> list[int]:
        names = ["worker"] if mode == "colocated" else ["prefill", "decode"]
        return [self.procs[name].proc.pid for name in names]

    async def connect(self) -> None:
        for name, proc in self.procs.items():
            assert proc.address is not None
            self.links[name] = Link(await worker_info(proc.address))

    async def once(self, mode: str, whole: bool, prompt: list[int]) -> int:
        rid = f"{self.label}-{next(self.seq)}"
        sampling = sampling_to_pb(SamplingParams(max_tokens=self.output_tokens, temperature=0.0, ignore_eos=True))
        sent: dict[str, Any] = ({"prompt_token_bytes": pack_token_ids(prompt)} if self.packed
                                else {"prompt_token_ids": prompt})
        if mode == "colocated":
            return await _drain(self.links["worker"].colocated.Generate(worker_pb2.WorkerGenerateRequest(
                request_id=rid, sampling=sampling, whole=whole, **sent)))
        prefill, decode = self.links["prefill"].info, self.links["decode"]
        route = worker_pb2.PrefillRoute(worker_id=prefill.worker_id, address=prefill.address,
                                        lane_address=prefill.lane_address)
        return await _drain(decode.decode.Serve(worker_pb2.ServeRequest(
            request_id=rid, sampling=sampling, model_compat_hash=decode.info.model_compat_hash,
            local_prefill_tokens=0, prefill=[route], whole=whole, **sent)))

    async def close(self) -> None:
        for link in self.links.values():
            await link.close()


async def phase(cluster: Cluster, mode: str, whole: bool, n: int, concurrency: int,
                source: Iterator[list[int]]) -> tuple[float, int]:
    """``n`` requests at ``concurrency``: (CPU seconds of the mode's worker processes, tokens received)."""
    left, tokens = n, 0

    async def slot() -> None:
        nonlocal left, tokens
        while left > 0:
            left -= 1
            got = await cluster.once(mode, whole, next(source))
            tokens += got

    pids = cluster.pids(mode)
    cpu0 = sum(cpu_seconds(pid) for pid in pids)
    await asyncio.gather(*(slot() for _ in range(concurrency)))
    return sum(cpu_seconds(pid) for pid in pids) - cpu0, tokens


@contextlib.contextmanager
def workers(label: str, redis_url: str, pythonpath: Path | None,
            time_scale: float = 0.0) -> Iterator[dict[str, ManagedProcess]]:
    sim = ["--model-preset", PRESET, "--gpu", GPU, "--time-scale", f"{time_scale:g}"]
    # PYTHONSAFEPATH: the working directory (this checkout, when run from it) must not come first.
    env = {"PYTHONPATH": str(pythonpath), "PYTHONSAFEPATH": "1"} if pythonpath is not None else None
    procs: dict[str, ManagedProcess] = {}
    try:
        for role in ("worker", "prefill", "decode"):
            args = worker_args(role, "", redis_url=redis_url, sim=sim)
            args = [a for a in args if a not in ("--model", "")]  # a preset, not a folder
            procs[role] = ManagedProcess(f"{label}-{role}", [*args, "--worker-id", f"{label}-{role}"], env=env)
        for proc in procs.values():
            proc.wait_ready()
        yield procs
    finally:
        for proc in procs.values():
            proc.stop()


KINDS = [(mode, whole) for mode in ("colocated", "pd") for whole in (False, True)]


def kind_name(mode: str, whole: bool) -> str:
    return f"{mode}_{'whole' if whole else 'stream'}"


async def measure(clusters: list[Cluster], plan: Plan, concurrency: int, report: Report,
                  kinds: list[tuple[str, bool]]) -> None:
    source = prompts(0)
    for cluster in clusters:
        for mode, whole in kinds:
            await phase(cluster, mode, whole, plan.warmup, concurrency, source)
    cpu = {(c.label, k): [] for c in clusters for k in kinds}  # type: dict[tuple[str, tuple[str, bool]], list[float]]
    for r in range(plan.rounds):
        for cluster in clusters if r % 2 == 0 else list(reversed(clusters)):
            for mode, whole in kinds:
                seconds, tokens = await phase(cluster, mode, whole, plan.requests, concurrency, source)
                if tokens != plan.requests * plan.output_tokens:
                    raise RuntimeError(f"{cluster.label} {mode}: {tokens} tokens, expected "
                                       f"{plan.requests * plan.output_tokens}")
                cpu[cluster.label, (mode, whole)].append(seconds / tokens)
    for mode, whole in kinds:
        name = kind_name(mode, whole)
        mine = cpu["now", (mode, whole)]
        report.add(f"{name}_cpu_per_token", statistics.median(mine) * 1e6, "us/token")
        report.add(f"{name}_cpu_per_request", statistics.median(mine) * plan.output_tokens * 1e6, "us/req")
        if len(clusters) > 1:
            theirs = cpu["vs", (mode, whole)]
            ratios = [b / a for a, b in zip(mine, theirs, strict=True)]
            report.add(f"{name}_vs_cpu_per_token", statistics.median(theirs) * 1e6, "us/token")
            report.add(f"{name}_ratio", statistics.median(ratios), "x")
            report.add(f"{name}_ratio_min", min(ratios), "x")
            report.add(f"{name}_ratio_max", max(ratios), "x")


async def main_async() -> None:
    parser = base_parser(__doc__ or "")
    parser.add_argument("--vs", default=None, metavar="REV",
                        help="also run the workers of this commit, interleaved, and report the ratio")
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--mode", choices=("colocated", "pd"), default=None,
                        help="measure this mode only (default: both)")
    parser.add_argument("--kind", choices=("stream", "whole"), default=None,
                        help="measure this kind of caller only (default: both)")
    parser.add_argument("--rounds", type=int, default=None, help="rounds (default: 2 with --quick, else 5)")
    parser.add_argument("--requests", type=int, default=None,
                        help="requests per phase (default: 64 with --quick, else 192)")
    parser.add_argument("--time-scale", type=float, default=0.0, metavar="S",
                        help="the simulated GPUs' time scale (default: 0, instant; 1: modeled step times)")
    parser.add_argument("--output-tokens", type=int, default=OUTPUT_TOKENS, metavar="N",
                        help=f"tokens a request asks for (default: {OUTPUT_TOKENS})")
    args = parser.parse_args()
    plan = QUICK if args.quick else FULL
    if args.rounds is not None:
        plan = dataclasses.replace(plan, rounds=args.rounds)
    if args.requests is not None:
        plan = dataclasses.replace(plan, requests=args.requests)
    if args.time_scale < 0 or args.output_tokens < 1:
        parser.error(f"--time-scale must be >= 0 and --output-tokens >= 1, got {args.time_scale:g} and "
                     f"{args.output_tokens}")
    plan = dataclasses.replace(plan, output_tokens=args.output_tokens, time_scale=args.time_scale)
    kinds = [(mode, whole) for mode, whole in KINDS
             if args.mode in (None, mode) and args.kind in (None, "whole" if whole else "stream")]
    report = Report()
    report.add("concurrency", args.concurrency, "requests")
    report.add("output_tokens", plan.output_tokens, "tokens")
    report.add("time_scale", plan.time_scale, "x")
    report.add("prompt_tokens", PREFIX_TOKENS + SUFFIX_TOKENS, "tokens")
    # Prefill and decode workers refuse to start without the deployment's KV secret.
    if not (os.environ.get("PDROUTER_KV_TOKEN") or os.environ.get("PDROUTER_KV_TOKEN_FILE")):
        os.environ["PDROUTER_KV_TOKEN"] = secrets.token_hex(16)
    started = time.monotonic()
    with contextlib.ExitStack() as stack:
        tmp = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="sim-worker-cpu-")))
        trees: list[tuple[str, Path | None]] = [("now", None)]
        if args.vs:
            trees.append(("vs", export_tree(args.vs, tmp / "vs")))
        clusters = []
        for label, path in trees:
            redis_server = stack.enter_context(EmbeddedRedis())
            packed = path is None or "prompt_token_bytes" in (path / "pdrouter/wire/v1/worker_pb2.pyi").read_text()
            procs = stack.enter_context(workers(label, redis_server.url, path, plan.time_scale))
            clusters.append(Cluster(label, procs, plan.output_tokens, packed))
        for cluster in clusters:
            await cluster.connect()
        try:
            await measure(clusters, plan, args.concurrency, report, kinds)
        finally:
            for cluster in clusters:
                await cluster.close()
    report.add("wall", time.monotonic() - started, "s")
    report.emit(args.json)


if __name__ == "__main__":
    asyncio.run(main_async())
