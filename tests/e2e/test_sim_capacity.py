"""Simulated Llama-3-8B / H100 workers behind the real router: capacity, prefix hits and KV links as modeled.

The workers run ``--backend sim``: the real scheduler, block manager and prefix cache, a KV pool
sized by the capacity math, a roofline timing model slept × the time scale, and the prefill
side's KV transfer held back to the modeled time of the real geometry's bytes. Everything else
is real: worker processes, Redis (registry, prefix index, KV bookings), the router in this
test's event loop, its HTTP door and the KV transport.

* capacity: the router admits exactly ``pdrouter capacity``'s max concurrency of 4k-context
  requests per decode worker; the next one waits in the admission queue, then gets 429; at the
  end no booking and no block is left;
* a prefix hit cuts the time to first token by what the timing model predicts (the prefill of
  the block-aligned cached prefix, and the transfer of the blocks the decode worker holds);
* a slow link adds its modeled transfer time of the prompt's real KV bytes to the TTFT.

Timings are compared in simulated seconds (wall ÷ time scale) and only as differences, with time
scales large enough that the router's and the machine's own costs are a few percent of them.
"""

from __future__ import annotations

import asyncio
import functools
import json
import random
import statistics
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis.asyncio as aioredis

from pdrouter.cli.local_cluster import ManagedProcess, worker_args
from pdrouter.core.capacity import blocks_for_tokens, plan_capacity
from pdrouter.core.gpu import get_gpu_preset
from pdrouter.core.kv_layout import KvLayout
from pdrouter.core.model_spec import ModelSpec, get_model_preset
from pdrouter.core.workers import WorkerLoad, WorkerRole
from pdrouter.engine.model_folder import write_config_folder
from pdrouter.engine.sim.link import get_link_preset
from pdrouter.engine.sim.timing import TimingModel
from pdrouter.router.admission import Admission, AdmissionConfig
from pdrouter.router.config import RouterConfig
from pdrouter.router.dispatch import DispatchConfig
from pdrouter.router.server import RouterProcess
from pdrouter.router.transfer_stats import TransferStats
from pdrouter.state.reservations import KvReservations
from pdrouter.wire.worker_client import WorkerClient

MODEL = "llama-3-8b"
GPU = "h100"
BLOCK = 16
CONTEXT = 4096
"""Prompt + max_tokens of every capacity-test request: 256 blocks booked each."""
DECODE_UTILIZATION = 0.3
"""Of the H100's 80 GiB: 24 GiB − 15 GiB weights − 2 GiB overhead leaves a small pool (14 × 4k)."""
TOLERANCE = 0.10


@pytest.fixture(scope="module")
def sim_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A weightless Llama-3-8B folder (config.json + byte tokenizer), what the router and workers read."""
    return write_config_folder(get_model_preset(MODEL), tmp_path_factory.mktemp("sim-models") / MODEL)


@dataclass
class SimCluster:
    """Simulated worker processes on one Redis, and routers in the test's event loop."""

    model: Path
    redis_url: str
    procs: dict[str, ManagedProcess] = field(default_factory=dict)
    routers: list[RouterProcess] = field(default_factory=list)

    def spawn(self, role: str, worker_id: str, *, utilization: float = DECODE_UTILIZATION,
              time_scale: float = 1.0, link: str | None = None) -> ManagedProcess:
        sim = ["--gpu", GPU, "--utilization", str(utilization), "--time-scale", str(time_scale)]
        if link is not None:
            sim += ["--link", link]
        proc = ManagedProcess(worker_id, worker_args(role, self.model, redis_url=self.redis_url, sim=sim,
                                                     extra=("--worker-id", worker_id)))
        self.procs[worker_id] = proc
        proc.wait_ready()
        return proc

    def stop(self, worker_id: str) -> None:
        self.procs.pop(worker_id).stop()

    async def router(self, *, mode: str = "disaggregated", admission: AdmissionConfig | None = None,
                     dispatch: DispatchConfig | None = None) -> RouterProcess:
        config = RouterConfig(model_dir=self.model, redis_url=self.redis_url, mode=mode,  # type: ignore[arg-type]
                              http_port=0, grpc_port=0, refresh_interval_s=0.2,
                              dispatch=dispatch or DispatchConfig(mode=mode),  # type: ignore[arg-type]
                              admission_config=admission or AdmissionConfig())
        router = RouterProcess(config)
        await router.start()
        self.routers.append(router)
        return router


@pytest.fixture
async def sim_cluster(sim_model: Path, redis_url: str) -> AsyncIterator[SimCluster]:
    cluster = SimCluster(sim_model, redis_url)
    yield cluster
    try:
        for router in cluster.routers:
            await asyncio.wait_for(router.stop(grace=1.0), timeout=60)
    finally:
        for proc in cluster.procs.values():
            proc.stop()


@pytest.fixture
async def redis_client(redis_url: str) -> AsyncIterator[aioredis.Redis]:
    client = aioredis.Redis.from_url(redis_url)
    yield client
    await client.aclose()


# -- helpers ---------------------------------------------------------------------------------------
def spec_and_timing() -> tuple[ModelSpec, TimingModel, int]:
    """The preset's geometry, its timing model on one H100, and the bytes of one real KV block."""
    spec, gpu = get_model_preset(MODEL), get_gpu_preset(GPU)
    layout = KvLayout.for_model(spec, 1, BLOCK, spec.dtype)
    return spec, TimingModel(spec, gpu), layout.block_bytes


def prompt_ids(seed: int, n: int) -> list[int]:
    """``n`` pseudo-random token ids, clear of the byte tokenizer's bytes and specials."""
    rng = random.Random(seed)
    return [rng.randrange(1_000, 120_000) for _ in range(n)]


async def eventually(predicate: Callable[[], Any], what: str, timeout: float = 15.0,
                     interval: float = 0.02) -> Any:
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout
    while True:
        value = predicate()
        if isinstance(value, Awaitable):
            value = await value
        if value:
            return value
        if loop.time() > end:
            raise AssertionError(f"not within {timeout:g}s: {what}")
        await asyncio.sleep(interval)


async def ready(router: RouterProcess, prefill: Sequence[str], decode: Sequence[str]) -> None:
    """Until the router's pool holds exactly these prefill and decode workers."""
    pool = router.pool
    assert pool is not None

    def match() -> bool:
        return sorted(h.worker_id for h in pool.available(WorkerRole.PREFILL)) == sorted(prefill) and \
            sorted(h.worker_id for h in pool.available(WorkerRole.DECODE)) == sorted(decode)

    await eventually(match, f"the router sees prefill {list(prefill)} and decode {list(decode)}")


async def worker_load(proc: ManagedProcess) -> WorkerLoad:
    assert proc.address is not None
    client = WorkerClient(proc.address)
    try:
        _, load = await client.info()
    finally:
        await client.close()
    return load


def completions_url(router: RouterProcess) -> str:
    return f"http://127.0.0.1:{router.http_port}/v1/completions"


def body(router: RouterProcess, prompt: list[int], max_tokens: int, stream: bool = False) -> dict[str, Any]:
    out: dict[str, Any] = {"model": router.model_name, "prompt": prompt, "max_tokens": max_tokens,
                           "temperature": 0, "ignore_eos": True}
    if stream:
        out.update(stream=True, stream_options={"include_usage": True})
    return out


@dataclass(frozen=True)
class Timed:
    """One streamed request as the client saw it, and what the decode worker reported of its prefill."""

    ttft_s: float
    """Wall seconds from sending the request to the response's head (sent with the first token)."""
    cached_tokens: int
    bytes_sent: int
    transfer_s: float
    """Seconds of the KV transfer as the prefill worker reported it (a simulated one: in simulated time)."""


async def timed_request(http: httpx.AsyncClient, router: RouterProcess, prompt: list[int]) -> Timed:
    """One request at a time (the router's transfer counters are read before and after it)."""
    assert router.dispatcher is not None
    stats: TransferStats = router.dispatcher.stats
    bytes_before, seconds_before, transfers_before = stats.bytes, stats.seconds, stats.transfers
    start = time.perf_counter()
    async with http.stream("POST", completions_url(router), json=body(router, prompt, 1, stream=True)) as resp:
        ttft = time.perf_counter() - start
        raw = (await resp.aread()).decode()
    assert resp.status_code == 200, raw
    usage = [json.loads(line[6:])["usage"] for line in raw.splitlines()
             if line.startswith("data: {") and '"usage":{' in line]
    assert len(usage) == 1 and usage[0]["prompt_tokens"] == len(prompt), raw
    assert stats.transfers == transfers_before + 1, "the prompt was not computed on the prefill worker"
    return Timed(ttft, int(usage[0]["prompt_tokens_details"]["cached_tokens"]), stats.bytes - bytes_before,
                 stats.seconds - seconds_before)


def relative_error(measured: float, predicted: float) -> float:
    return abs(measured - predicted) / predicted


# -- 1. capacity -----------------------------------------------------------------------------------
CAPACITY_PROMPT = 3696
CAPACITY_MAX_TOKENS = CONTEXT - CAPACITY_PROMPT  # 400 decode steps (~5 s at time scale 1)
QUEUE_TIMEOUT_S = 1.5


def capacity_cli() -> dict[str, Any]:
    """``pdrouter capacity --json`` for the decode workers' model, GPU and utilization at 4k context."""
    out = subprocess.run([sys.executable, "-m", "pdrouter", "capacity", "--model", MODEL, "--gpu", GPU,
                          "--utilization", str(DECODE_UTILIZATION), "--context", str(CONTEXT), "--json"],
                         capture_output=True, text=True, check=True, timeout=60)
    return dict(json.loads(out.stdout))


async def test_admission_admits_the_capacity_math_per_decode_worker_then_queues_and_refuses(
        sim_cluster: SimCluster, redis_client: aioredis.Redis) -> None:
    spec = get_model_preset(MODEL)
    plan = plan_capacity(spec, get_gpu_preset(GPU), utilization=DECODE_UTILIZATION, context=CONTEXT)
    cli = capacity_cli()
    assert (cli["max_concurrency"], cli["num_blocks"]) == (plan.max_concurrency, plan.num_blocks)
    per_worker = plan.max_concurrency
    assert 8 <= per_worker <= 16, per_worker  # small enough for this machine, large enough to mean something
    assert blocks_for_tokens(CAPACITY_PROMPT + CAPACITY_MAX_TOKENS, BLOCK) == CONTEXT // BLOCK
    # The prefill worker's pool is larger (0.9), so only the decode workers' pools limit admission.
    prefill = sim_cluster.spawn("prefill", "prefill-0", utilization=0.9)
    decodes = {wid: sim_cluster.spawn("decode", wid) for wid in ("decode-0", "decode-1")}
    router = await sim_cluster.router(admission=AdmissionConfig(queue_timeout_s=QUEUE_TIMEOUT_S))
    await ready(router, ["prefill-0"], list(decodes))
    assert router.pool is not None and router.admission is not None
    admission: Admission = router.admission
    epochs = {}
    for handle in router.pool.available(WorkerRole.DECODE):
        assert handle.record.capacity_blocks == plan.num_blocks  # the pool the capacity math prints
        epochs[handle.worker_id] = handle.record.epoch
    reservations = KvReservations(redis_client, router.model_name)

    async def booked() -> dict[str, int]:
        return {wid: await reservations.used(wid, epoch) for wid, epoch in epochs.items()}

    fits = per_worker * len(decodes)
    async with httpx.AsyncClient(timeout=120) as http:
        async def send(i: int) -> httpx.Response:
            return await http.post(completions_url(router),
                                   json=body(router, prompt_ids(i, CAPACITY_PROMPT), CAPACITY_MAX_TOKENS))

        running: list[asyncio.Task[httpx.Response]] = []
        extra: asyncio.Task[httpx.Response] | None = None
        try:
            burst_start = time.monotonic()
            running = [asyncio.create_task(send(i)) for i in range(fits)]
            await eventually(lambda: admission.active == fits and admission.queue_length == 0,
                             f"{fits} requests admitted at once")
            admitted_s = time.monotonic() - burst_start
            # Exactly the capacity per worker: every booking in Redis is a request's 256 blocks
            # (credit the router had booked ahead goes back once a request waits for room).
            await eventually(lambda: _all_equal(booked(), per_worker * CONTEXT // BLOCK),
                             "each decode worker booked with exactly its capacity of 4k requests", timeout=5)
            # One more: it waits in the admission queue (the router's gauge says so), then is refused.
            extra_start = time.monotonic()
            extra = asyncio.create_task(send(fits))
            await eventually(lambda: admission.queue_length == 1, "the extra request queued")
            scraped = (await http.get(f"http://127.0.0.1:{router.http_port}/metrics")).text
            assert "pdrouter_admission_queue_length 1.0" in scraped
            refused = await extra
            waited = time.monotonic() - extra_start
            assert refused.status_code == 429, refused.text
            assert refused.headers.get("retry-after") and refused.json()["error"]["type"]
            assert waited >= QUEUE_TIMEOUT_S * 0.95, waited
            assert admission.stats.rejections["timeout"] == 1
            assert admission.active == fits and not any(t.done() for t in running), \
                "a request finished before the extra one was refused: its refusal proves nothing"
            # And on the workers themselves: each decode engine holds exactly its share.
            await eventually(lambda: _running_on(decodes.values(), per_worker),
                             f"{per_worker} requests on each decode worker", timeout=3)
            await asyncio.wait(running, return_when=asyncio.FIRST_COMPLETED)
            first_done_s = time.monotonic() - burst_start
            answers = await asyncio.gather(*running)
            print(f"capacity: {fits} admitted ({per_worker} per decode worker) {admitted_s:.2f} s into the burst; "
                  f"the extra one refused (429) after {waited:.2f} s in the queue; the first of the {fits} "
                  f"finished at {first_done_s:.2f} s, the last at {time.monotonic() - burst_start:.2f} s")
        finally:
            for task in [*running, *([extra] if extra is not None else [])]:
                task.cancel()
    for answer in answers:
        assert answer.status_code == 200, answer.text
        assert answer.json()["usage"]["completion_tokens"] == CAPACITY_MAX_TOKENS
    assert admission.stats.admitted == fits and admission.queue_length == 0
    # No leak: every booking and all credit are gone from Redis, every block is free on every worker.
    await eventually(lambda: _all_equal(booked(), 0), "every booking released", timeout=10)
    await eventually(lambda: admission.active == 0 and admission.credit_blocks == 0, "admission idle", timeout=10)
    for wid, proc in decodes.items():
        load = await eventually(functools.partial(_idle_load, proc), f"{wid} frees every block", timeout=10)
        assert (load.free_blocks, load.total_blocks) == (plan.num_blocks, plan.num_blocks), (wid, load)
    assert (await eventually(lambda: _idle_load(prefill), "prefill-0 frees every block")).running == 0


async def _all_equal(values: Awaitable[dict[str, int]], expected: int) -> bool:
    return all(v == expected for v in (await values).values())


async def _running_on(procs: Iterable[ManagedProcess], expected: int) -> bool:
    running = [(await worker_load(proc)).running for proc in procs]
    return all(n == expected for n in running)


async def _idle_load(proc: ManagedProcess) -> WorkerLoad | None:
    load = await worker_load(proc)
    return load if load.allocated_blocks == 0 and load.running == 0 and load.waiting == 0 else None


# -- 2. prefix hits ---------------------------------------------------------------------------------
PROMPT_TOKENS = 4000
SHARED_TOKENS = 3000
PREFIX_TIME_SCALE = 10.0


async def test_a_prefix_hit_cuts_ttft_by_the_modeled_prefill_and_transfer(sim_cluster: SimCluster) -> None:
    _, timing, block_bytes = spec_and_timing()
    link = get_link_preset("rdma-400g")  # the workers' default link
    sim_cluster.spawn("prefill", "prefill-0", utilization=0.9, time_scale=PREFIX_TIME_SCALE)
    sim_cluster.spawn("decode", "decode-0", utilization=0.9, time_scale=PREFIX_TIME_SCALE)
    router = await sim_cluster.router()
    await ready(router, ["prefill-0"], ["decode-0"])
    blocks = blocks_for_tokens(PROMPT_TOKENS, BLOCK)
    cached = SHARED_TOKENS // BLOCK * BLOCK  # whole blocks only: 2992 of the 3000 shared tokens
    cold_s = timing.prefill(PROMPT_TOKENS).seconds + link.transfer_s(blocks * block_bytes)
    # The decode worker holds the shared blocks too (from the first request): only the rest travels.
    warm_s = timing.prefill(PROMPT_TOKENS, cached).seconds + \
        link.transfer_s((blocks - cached // BLOCK) * block_bytes)
    predicted = cold_s - warm_s
    cuts = []
    async with httpx.AsyncClient(timeout=60) as http:
        await timed_request(http, router, prompt_ids(999, PROMPT_TOKENS))  # connections and lanes warm
        for rep in range(3):
            first = prompt_ids(100 + rep, PROMPT_TOKENS)
            second = first[:SHARED_TOKENS] + prompt_ids(200 + rep, PROMPT_TOKENS - SHARED_TOKENS)
            cold = await timed_request(http, router, first)
            await asyncio.sleep(0.3)  # the first prompt's blocks settle in both prefix caches and the index
            warm = await timed_request(http, router, second)
            assert (cold.cached_tokens, cold.bytes_sent) == (0, blocks * block_bytes), cold
            assert (warm.cached_tokens, warm.bytes_sent) == (cached, (blocks - cached // BLOCK) * block_bytes), warm
            cuts.append((cold.ttft_s - warm.ttft_s) / PREFIX_TIME_SCALE)
            print(f"prefix rep {rep}: TTFT cold {cold.ttft_s / PREFIX_TIME_SCALE * 1e3:.2f} ms, warm "
                  f"{warm.ttft_s / PREFIX_TIME_SCALE * 1e3:.2f} ms (simulated); modeled {cold_s * 1e3:.2f} / "
                  f"{warm_s * 1e3:.2f} ms")
    measured = statistics.median(cuts)
    error = relative_error(measured, predicted)
    print(f"prefix hit cuts TTFT by {measured * 1e3:.2f} ms (simulated, median of "
          f"{[round(c * 1e3, 2) for c in cuts]}); modeled {predicted * 1e3:.2f} ms; error {error:.1%}")
    assert error <= TOLERANCE, (measured, predicted, cuts)


# -- 3. the KV link ---------------------------------------------------------------------------------
LINK_TIME_SCALE = 5.0


async def test_a_slow_link_adds_its_modeled_transfer_time_to_ttft(sim_cluster: SimCluster) -> None:
    _, timing, block_bytes = spec_and_timing()
    blocks = blocks_for_tokens(PROMPT_TOKENS, BLOCK)
    nbytes = blocks * block_bytes
    fast, slow = get_link_preset("nvlink"), get_link_preset("tcp-25g")
    sim_cluster.spawn("decode", "decode-0", utilization=0.9, time_scale=LINK_TIME_SCALE)
    router = await sim_cluster.router()
    measured: dict[str, list[Timed]] = {}
    async with httpx.AsyncClient(timeout=60) as http:
        for n, link in enumerate((fast, slow)):
            wid = f"prefill-{link.name}"
            sim_cluster.spawn("prefill", wid, utilization=0.9, time_scale=LINK_TIME_SCALE, link=link.name)
            await ready(router, [wid], ["decode-0"])
            await timed_request(http, router, prompt_ids(990 + n, PROMPT_TOKENS))  # connections warm
            # Fresh prompts: no prefix hit on either worker, the whole prompt's KV travels.
            runs = [await timed_request(http, router, prompt_ids(300 + 10 * n + rep, PROMPT_TOKENS))
                    for rep in range(3)]
            for run in runs:
                assert (run.cached_tokens, run.bytes_sent) == (0, nbytes), run
            measured[link.name] = runs
            sim_cluster.stop(wid)
    ttft = {name: statistics.median(r.ttft_s for r in runs) / LINK_TIME_SCALE for name, runs in measured.items()}
    reported = {name: statistics.median(r.transfer_s for r in runs) for name, runs in measured.items()}
    prefill_s = timing.prefill(PROMPT_TOKENS).seconds
    predicted = slow.transfer_s(nbytes) - fast.transfer_s(nbytes)
    rise = ttft[slow.name] - ttft[fast.name]
    error = relative_error(rise, predicted)
    for name in measured:
        print(f"link {name}: TTFT {ttft[name] * 1e3:.2f} ms = prefill {prefill_s * 1e3:.2f} (modeled) + transfer "
              f"{reported[name] * 1e3:.2f} (reported by the prefill worker; modeled "
              f"{get_link_preset(name).transfer_s(nbytes) * 1e3:.2f}) + the rest "
              f"{(ttft[name] - prefill_s - reported[name]) * 1e3:.2f} ms (simulated)")
    print(f"{slow.name} vs {fast.name}: TTFT rises {rise * 1e3:.2f} ms (simulated); modeled "
          f"{predicted * 1e3:.2f} ms; error {error:.1%}")
    assert error <= TOLERANCE, (ttft, predicted)
    # The decomposition TTFT = queueing + prefill + transfer. No request queued for admission:
    assert router.admission is not None and router.admission.stats.max_queue == 0
    for name in measured:
        modeled = prefill_s + get_link_preset(name).transfer_s(nbytes)
        assert ttft[name] >= modeled * 0.99, (name, ttft[name], modeled)  # nothing beats the model
        assert reported[name] >= get_link_preset(name).transfer_s(nbytes) * 0.99, (name, reported)
    # The prefill worker's own transfer time is the slow link's modeled one, and with the modeled
    # prefill it makes up the slow-link TTFT.
    assert relative_error(reported[slow.name], slow.transfer_s(nbytes)) <= TOLERANCE, reported
    assert relative_error(ttft[slow.name], prefill_s + reported[slow.name]) <= TOLERANCE, (ttft, reported)
