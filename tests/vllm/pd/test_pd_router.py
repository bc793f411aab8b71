"""vLLM prefill and decode workers behind the router: the disaggregated flow token for token, and its faults.

One cluster for the module: an embedded Redis, ``pdrouter prefill`` and ``pdrouter decode`` with
``--backend vllm`` (the CPU wheel, the small model run in float32, KV blocks of 32 tokens) and a
router in disaggregated mode; beside them one colocated ``--backend vllm`` worker with the same
settings behind a router of its own, the reference. (float32: in bfloat16 this random model's logits
tie exactly now and then, and which tied token wins depends on the kernel path; the decode engine
computes the prompt's last position over received KV, as vLLM does after any prefix hit.)

Every prompt is random token ids, so no engine holds any of it before, unless a test gives it a
prefix on purpose. Transferred bytes are the router's ``pdrouter_kv_transfer_bytes_total``.
The faults run last: cancels; a KV stream corrupted or cut on its way to the decode worker (the decode
worker is behind a relay that listens on a second loopback address, ``relay.py``); ``kill -9`` of the
decode worker mid-stream (it is restarted); then of the prefill worker mid-transfer.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import secrets
import signal
import socket
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import httpx
import pytest

from pdrouter.cli.local_cluster import ManagedProcess
from pdrouter.core.workers import WorkerRole
from pdrouter.state.embedded_redis import EmbeddedRedis
from pdrouter.state.registry import WorkerRegistry
from pdrouter.testing.leak_audit import LeakAudit
from pdrouter.testing.otlp import CLIENT, INTERNAL, SERVER, OtlpSink, ReceivedSpan
from pdrouter.wire.security import INTERNAL_TOKEN_ENV
from pdrouter.wire.v1 import common_pb2, router_pb2, router_pb2_grpc
from pdrouter.worker.presence import connect_redis

from ..conftest import HEARTBEAT_TTL_MS
from .relay import Fault, WorkerRelay

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(1800)]

BLOCK = 32
DTYPE = "float32"
BLOCK_BYTES = BLOCK * 2 * 6 * 2 * 64 * 4
"""One block of the small model in float32: 32 tokens × K, V × 6 layers × 2 KV heads × 64 × 4 bytes."""
START_S = 600.0
BOUND_S = 120.0
"""The longest any client waits for its answer (or its clean error) in the fault tests."""
MODEL = "small"
RELAY_HOST = "127.0.0.2"
"""Where a decode worker's relay listens (the worker itself listens on 127.0.0.1)."""


def free_port() -> int:
    """A port free on both loopback addresses a moment ago, below the kernel's ephemeral range.

    The decode worker binds it only once its engine is up, tens of seconds later; meanwhile vLLM's
    processes bind ports of their own (ZMQ sockets) and every connection takes a source port, all
    from the ephemeral range, and one of them once took a port picked from there first."""
    try:
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768
    picker = random.Random()
    while True:
        port = picker.randrange(10_000, max(low, 10_001))
        with socket.socket() as first, socket.socket() as second, contextlib.suppress(OSError):
            first.bind(("127.0.0.1", port))
            second.bind((RELAY_HOST, port))
            return port


def vllm_worker(role: str, model: Path, name: str, redis_url: str | None) -> list[str]:
    argv = [role, "--backend", "vllm", "--model", str(model), "--worker-id", name,
            "--block-size", str(BLOCK), "--dtype", DTYPE, "--vllm-arg", "max_model_len=2048",
            "--torch-threads", "1", "--log-level", "INFO", "--heartbeat-ttl-ms", str(HEARTBEAT_TTL_MS)]
    return argv + (["--redis", redis_url] if redis_url else [])


@dataclass
class PdCluster:
    model: Path
    redis_url: str
    env: dict[str, str]
    workers: dict[str, ManagedProcess] = field(default_factory=dict)
    routers: dict[str, ManagedProcess] = field(default_factory=dict)

    relays: dict[str, WorkerRelay] = field(default_factory=dict)
    """The relay in front of each decode worker (its incarnation's ports)."""
    spans: OtlpSink | None = None
    """Where every process exports the spans of the requests that come with a sampled trace context."""

    def start_worker(self, role: str, name: str, *, registered: bool = True) -> ManagedProcess:
        argv = vllm_worker(role, self.model, name, self.redis_url if registered else None)
        if role == "decode":  # behind a relay (see relay.py): the faults on its KV stream
            ports = [free_port() for _ in range(3)]
            old = self.relays.pop(name, None)
            if old is not None:
                old.close()
            self.relays[name] = WorkerRelay(RELAY_HOST, "127.0.0.1", ports, kv_port=ports[2])
            argv += ["--host", "127.0.0.1", "--advertise-host", RELAY_HOST, "--port", str(ports[0]),
                     "--lane-port", str(ports[1]), "--kv-port", str(ports[2])]
        else:
            argv += ["--port", "0"]
        proc = ManagedProcess(name, argv, env=self.env)
        self.workers[name] = proc
        return proc

    def start_router(self, name: str, *argv: str) -> ManagedProcess:
        proc = ManagedProcess(name, ["router", "--model", str(self.model), "--block-size", str(BLOCK),
                                     "--http-port", "0", "--grpc-port", "0", "--lease-ms", "5000",
                                     "--log-level", "WARNING", *argv], env=self.env)
        self.routers[name] = proc
        proc.wait_ready()
        return proc

    def http(self, router: str) -> str:
        return f"http://{self.routers[router].address}"

    def grpc(self, router: str) -> str:
        address = self.routers[router].grpc_address
        assert address is not None
        return address

    def kill(self, name: str) -> None:
        """SIGKILL the worker and every process of its session (vLLM's engine processes)."""
        proc = self.workers[name]
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.proc.pid, signal.SIGKILL)
        proc.proc.wait()
        proc.stop()

    def stop(self) -> None:
        for proc in (*self.routers.values(), *self.workers.values()):
            proc.stop(60)
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.proc.pid, signal.SIGKILL)
        for relay in self.relays.values():
            relay.close()


@pytest.fixture(scope="module")
def cluster(vllm_model: Path) -> Iterator[PdCluster]:
    redis = EmbeddedRedis()
    redis.start()
    with OtlpSink() as sink:
        # Traced only when a request brings a sampled context: the other tests' requests start no trace.
        tracing = {**sink.environment("http/protobuf"), "OTEL_TRACES_SAMPLER": "parentbased_traceidratio",
                   "OTEL_TRACES_SAMPLER_ARG": "0"}
        pd = PdCluster(vllm_model, redis.url, {INTERNAL_TOKEN_ENV: secrets.token_hex(16), **tracing}, spans=sink)
        try:
            for role, name, registered in (("prefill", "prefill-0", True), ("decode", "decode-0", True),
                                           ("worker", "reference", False)):  # all at once: their imports overlap
                pd.start_worker(role, name, registered=registered)
            for proc in pd.workers.values():
                proc.wait_ready(START_S)
            pd.start_router("pd", "--redis", redis.url, "--mode", "disaggregated")
            pd.start_router("reference", "--workers", pd.workers["reference"].address or "", "--mode", "colocated")
            run(wait_for(lambda: live(pd), "the prefill and decode workers registered", lambda n: n == 2))
            run(listed(pd))
            yield pd
        finally:
            pd.stop()
            redis.stop()


def run(coro: Any) -> Any:
    return asyncio.run(coro)


async def wait_for(probe: Any, what: str, done: Any, timeout: float = 60.0) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = await probe()
        if done(value):
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"never happened: {what} (last: {value})")
        await asyncio.sleep(0.25)


async def live(pd: PdCluster) -> int:
    client = await connect_redis(pd.redis_url)
    try:
        return len(await WorkerRegistry(client, MODEL).live_workers())
    finally:
        await client.aclose()


async def leftovers(pd: PdCluster, dead_decode: list[tuple[str, int]] = ()) -> dict[str, int]:  # type: ignore[assignment]
    """Requests running and blocks held on the live workers (what vLLM reports), blocks booked on the
    live decode workers, and booking entries, leases and blocks left on dead decode incarnations."""
    client = await connect_redis(pd.redis_url)
    try:
        audit = LeakAudit(client, MODEL)
        live = await audit.registry.live_workers()
        decode = [(w.record.worker_id, int(w.record.epoch)) for w in live if w.record.role is WorkerRole.DECODE]
        return {"stranded_work": sum(w.load.running + w.load.allocated_blocks for w in live),
                "bookings": sum([(await audit.reservations.holdings(w, e)).blocks for w, e in decode]),
                "dead_bookings": await audit.dead_bookings(list(dead_decode))}
    finally:
        await client.aclose()


async def idle(pd: PdCluster, dead_decode: list[tuple[str, int]] = (), timeout: float = 60.0) -> None:  # type: ignore[assignment]
    await wait_for(lambda: leftovers(pd, dead_decode), "both engines idle and no booking left",
                   lambda counts: not any(counts.values()), timeout)


async def listed(pd: PdCluster) -> None:
    """Wait until the PD router serves a prompt through its prefill worker with a KV transfer.

    The router reads the registry once a second, so a worker registered (or restarted) a moment ago
    may not be a candidate yet: a prompt sent then is computed on the decode worker, and moves no KV."""
    async def moved() -> int:
        before = await asyncio.to_thread(transfer_bytes, pd)
        with contextlib.suppress(grpc.RpcError):  # the old incarnation, still listed: UNAVAILABLE
            await grpc_tokens(pd.grpc("pd"), random_prompt(random.Random(), 2 * BLOCK + 1), 1)
        return await asyncio.to_thread(transfer_bytes, pd) - before

    await wait_for(moved, "a prompt served with a KV transfer", lambda grew: grew > 0)


async def epoch_of(pd: PdCluster, worker_id: str) -> int:
    client = await connect_redis(pd.redis_url)
    try:
        for record in await WorkerRegistry(client, MODEL).records():
            if record.worker_id == worker_id:
                return int(record.epoch)
        raise AssertionError(f"{worker_id} is not registered")
    finally:
        await client.aclose()


def metric(pd: PdCluster, name: str, **labels: str) -> float:
    """The sum of the PD router's samples of ``name`` that carry ``labels``."""
    with urllib.request.urlopen(f"{pd.http('pd')}/metrics", timeout=10) as resp:
        text = resp.read().decode()
    wanted = [f'{key}="{value}"' for key, value in labels.items()]
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(name + "{") and all(w in line for w in wanted))


def transfer_bytes(pd: PdCluster) -> int:
    return int(metric(pd, "pdrouter_kv_transfer_bytes_total"))


async def grpc_tokens(address: str, prompt: list[int], max_tokens: int) -> tuple[list[int], str, int]:
    """Token ids, text and cached tokens of one greedy completion through a router's gRPC door."""
    ids: list[int] = []
    text, cached = "", -1
    sampling = common_pb2.SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    async with grpc.aio.insecure_channel(address) as channel:
        stub = router_pb2_grpc.RouterStub(channel)
        request = router_pb2.GenerateRequest(model=MODEL, token_ids=router_pb2.TokenIds(ids=prompt), sampling=sampling)
        async for msg in stub.Generate(request):
            ids.extend(msg.token_ids)
            text += msg.text
            if msg.HasField("usage"):
                cached = msg.usage.cached_tokens
    return ids, text, cached


async def http_completion(base: str, prompt: list[int], max_tokens: int, *, stream: bool) -> tuple[str, dict[str, Any]]:
    """The text and usage of one greedy completion through a router's HTTP door."""
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": stream, **({"stream_options": {"include_usage": True}} if stream else {})}
    async with httpx.AsyncClient(timeout=BOUND_S) as client:
        if not stream:
            resp = await client.post(f"{base}/v1/completions", json=body)
            assert resp.status_code == 200, resp.text
            answer = resp.json()
            return answer["choices"][0]["text"], answer["usage"]
        text, usage = "", {}
        async with client.stream("POST", f"{base}/v1/completions", json=body) as resp:
            assert resp.status_code == 200
            async for line in resp.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[6:])
                assert "error" not in event, event
                if event.get("choices"):
                    text += event["choices"][0]["text"]
                usage = event.get("usage") or usage
        return text, usage


def random_prompt(rng: random.Random, tokens: int) -> list[int]:
    return [rng.randrange(3, 256) for _ in range(tokens)]


def sent_blocks(tokens: int, held: int = 0) -> int:
    """Blocks a prompt of ``tokens`` sends when the decode worker holds ``held`` of them."""
    return -(-tokens // BLOCK) - held // BLOCK


# -- the flow -------------------------------------------------------------------------------------------
LENGTHS = [1, 2, 31, 32, 33, 63, 64, 65, 100, 127, 128, 129, 255, 256, 257, 500, 777, 1023, 1024, 1025, 1499,
           1500]
"""1 to 1,500 tokens, on and off the 32-token block boundaries; up to 32 the decode worker computes them."""


def test_disaggregated_tokens_equal_the_colocated_engine(cluster: PdCluster) -> None:
    rng = random.Random(1)

    async def check() -> None:
        for index, length in enumerate(LENGTHS):
            prompt = random_prompt(rng, length)
            ids, text, _ = await grpc_tokens(cluster.grpc("reference"), prompt, 8)
            before = transfer_bytes(cluster)
            door = index % 3
            if door == 0:
                got_ids, _, cached = await grpc_tokens(cluster.grpc("pd"), prompt, 8)
                assert got_ids == ids, f"{length} tokens (gRPC)"
            else:  # HTTP, streamed and not
                got_text, usage = await http_completion(cluster.http("pd"), prompt, 8, stream=door == 1)
                assert got_text == text, f"{length} tokens (HTTP, stream={door == 1})"
                assert usage["prompt_tokens"] == length
                cached = usage["prompt_tokens_details"]["cached_tokens"]
            assert cached == 0
            expected = 0 if length <= BLOCK else sent_blocks(length) * BLOCK_BYTES  # short: computed on decode
            assert transfer_bytes(cluster) - before == expected, f"{length} tokens"

    run(check())
    run(idle(cluster))
    # The workers count the same bytes (their heartbeats; the router exports them per worker).
    moved = transfer_bytes(cluster)
    run(wait_for(lambda: asyncio.sleep(0, metric(cluster, "pdrouter_worker_kv_transfer_bytes")),
                 "the workers' transfer counts", lambda total: total == 2 * moved, timeout=15))
    assert metric(cluster, "pdrouter_worker_kv_transfer_bytes", role="decode", direction="received") == moved


def test_a_request_is_one_trace_across_the_router_and_the_vllm_prefill_and_decode_workers(
        cluster: PdCluster) -> None:
    """The vLLM workers' servicers continue the router's trace: Serve and Prefill in server spans
    parented on the calls' client spans, the decode in a span of its own, the transfer's bytes on
    the router's call span."""
    assert cluster.spans is not None
    sink = cluster.spans
    trace_id, parent_id = secrets.token_hex(16), secrets.token_hex(8)
    prompt = random_prompt(random.Random(9), 100)  # past local_prefill_tokens: prefilled on the prefill worker
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 4, "temperature": 0, "ignore_eos": True}

    async def traced() -> list[ReceivedSpan]:
        async with httpx.AsyncClient(timeout=BOUND_S) as client:
            resp = await client.post(f"{cluster.http('pd')}/v1/completions", json=body,
                                     headers={"traceparent": f"00-{trace_id}-{parent_id}-01"})
        assert resp.status_code == 200, resp.text
        services = {"pdrouter-router", "pdrouter-prefill", "pdrouter-decode"}
        for _ in range(200):
            spans = sink.trace(trace_id)
            if {s.service for s in spans} >= services and any(s.name == "decode" for s in spans):
                await asyncio.sleep(0.3)  # late spans of the same trace
                return sink.trace(trace_id)
            await asyncio.sleep(0.05)
        raise AssertionError(f"trace incomplete: {[(s.service, s.name) for s in sink.trace(trace_id)]}")

    spans = run(traced())

    def one(service: str, name: str, kind: int) -> ReceivedSpan:
        found = [s for s in spans if s.service == service and s.name == name and s.kind == kind]
        assert len(found) == 1, (service, name, [(s.service, s.name, s.kind) for s in spans])
        return found[0]

    root = one("pdrouter-router", "POST /v1/completions", SERVER)
    assert root.parent_id == parent_id
    call = one("pdrouter-router", "pdrouter.v1.DecodeWorker/Serve", CLIENT)
    assert call.parent_id == root.span_id
    assert call.attributes["pdrouter.kv.bytes"] == sent_blocks(len(prompt)) * BLOCK_BYTES
    serve = one("pdrouter-decode", "pdrouter.v1.DecodeWorker/Serve", SERVER)
    assert serve.parent_id == call.span_id
    assert one("pdrouter-decode", "decode", INTERNAL).parent_id == serve.span_id
    prefill_call = one("pdrouter-decode", "pdrouter.v1.PrefillWorker/Prefill", CLIENT)
    assert prefill_call.parent_id == serve.span_id
    prefill = one("pdrouter-prefill", "pdrouter.v1.PrefillWorker/Prefill", SERVER)
    assert prefill.parent_id == prefill_call.span_id
    assert call.start_ns <= serve.start_ns <= prefill.start_ns and prefill.end_ns <= serve.end_ns
    by_id = {s.span_id: s for s in spans}
    for span in spans:  # nothing dangles, nothing failed
        assert span.parent_id == parent_id or span.parent_id in by_id, span
        assert span.status_code != 2, span
    run(idle(cluster))


PREFIX_CASES = [(700, 640, 940), (300, 250, 400), (1100, 1024, 1500)]
"""(a prompt the decode worker computes first, tokens a second prompt shares with it, the second's length):
the shared part on and off block boundaries (the decode worker holds its whole blocks)."""


def test_a_prefix_the_decode_worker_holds_is_not_sent_and_counts_as_cached(cluster: PdCluster) -> None:
    rng = random.Random(2)

    async def check() -> None:
        for door, (first_len, shared, total) in enumerate(PREFIX_CASES):
            first = random_prompt(rng, first_len)
            second = first[:shared] + random_prompt(rng, total - shared)
            held = shared // BLOCK * BLOCK
            reference = await grpc_tokens(cluster.grpc("reference"), second, 8)
            await grpc_tokens(cluster.grpc("pd"), first, 8)  # now held by the decode worker (and the prefill's)
            before = transfer_bytes(cluster)
            if door == 2:
                ids, _, cached = await grpc_tokens(cluster.grpc("pd"), second, 8)
                assert ids == reference[0], f"{total} tokens, {shared} shared"
            else:  # HTTP, streamed and not
                text, usage = await http_completion(cluster.http("pd"), second, 8, stream=door == 0)
                assert text == reference[1], f"{total} tokens, {shared} shared"
                cached = usage["prompt_tokens_details"]["cached_tokens"]
            assert cached == held
            assert transfer_bytes(cluster) - before == sent_blocks(total, held) * BLOCK_BYTES

    run(check())
    run(idle(cluster))


def test_a_prompt_mostly_held_by_the_decode_worker_is_computed_there(cluster: PdCluster) -> None:
    rng = random.Random(4)
    first = random_prompt(rng, 700)
    mostly_held = first[:672] + random_prompt(rng, 20)  # 20 uncached tokens: computed on the decode worker

    async def check() -> None:
        reference = await grpc_tokens(cluster.grpc("reference"), mostly_held, 8)
        await grpc_tokens(cluster.grpc("pd"), first, 8)
        before = transfer_bytes(cluster)
        ids, _, cached = await grpc_tokens(cluster.grpc("pd"), mostly_held, 8)
        assert ids == reference[0]
        assert cached == 672
        assert transfer_bytes(cluster) == before

    run(check())
    run(idle(cluster))


# -- faults ---------------------------------------------------------------------------------------------
@dataclass
class Outcomes:
    correct: int = 0
    clean_errors: int = 0
    wrong: list[str] = field(default_factory=list)
    """Answers that were neither the reference's text nor a clean error, described."""


async def classified(base: str, prompt: list[int], max_tokens: int, reference: str, outcomes: Outcomes, *,
                     stream: bool) -> None:
    """One request; its answer classified: the reference's text, a clean error (an HTTP error or an SSE
    error event, with the API's error object), or anything else (a wrong answer, a dropped connection)."""
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": stream}
    try:
        async with httpx.AsyncClient(timeout=BOUND_S) as client, \
                client.stream("POST", f"{base}/v1/completions", json=body) as resp:
            raw = await resp.aread()
    except httpx.HTTPError as exc:
        outcomes.wrong.append(f"{type(exc).__name__}: {exc}")
        return
    if resp.status_code != 200:
        ok = "error" in json.loads(raw or b"{}")
        (outcomes.__setattr__("clean_errors", outcomes.clean_errors + 1) if ok
         else outcomes.wrong.append(f"{resp.status_code} {raw[:200]!r}"))
        return
    if not stream:
        text = json.loads(raw)["choices"][0]["text"]
    else:
        events = [json.loads(line[6:]) for line in raw.decode().splitlines()
                  if line.startswith("data: ") and line != "data: [DONE]"]
        if any("error" in e for e in events):
            outcomes.clean_errors += 1
            return
        text = "".join(e["choices"][0]["text"] for e in events if e.get("choices"))
    if text == reference:
        outcomes.correct += 1
    else:
        outcomes.wrong.append(f"answer differs from the colocated engine's ({len(prompt)} tokens)")


def test_clients_cancelling_at_random_points_strand_nothing(cluster: PdCluster) -> None:
    rng = random.Random(3)
    prompts = [random_prompt(rng, rng.randrange(40, 1500)) for _ in range(20)]

    async def one(client: httpx.AsyncClient, index: int, gate: asyncio.Semaphore) -> bool:
        prompt = prompts[index % len(prompts)]
        body = {"model": MODEL, "prompt": prompt, "max_tokens": rng.randrange(1, 64), "temperature": 0,
                "stream": index % 2 == 0}
        async with gate:
            request = asyncio.ensure_future(client.post(f"{cluster.http('pd')}/v1/completions", json=body))
            done, _ = await asyncio.wait({request}, timeout=rng.uniform(0.0, 1.2))
            if done:
                return False
            request.cancel()  # the client goes away: its connection closes mid-request
            await asyncio.gather(request, return_exceptions=True)
            return True

    async def check() -> None:
        gate = asyncio.Semaphore(6)
        async with httpx.AsyncClient(timeout=BOUND_S, limits=httpx.Limits(max_keepalive_connections=0)) as client:
            cancelled = await asyncio.gather(*(one(client, i, gate) for i in range(200)))
        # Enough of them went away mid-request for the check to mean something (a request that ends before
        # its random moment is not cancelled: with moments up to 2 s, 99, 100+ and, on a fast run, 56 of 200
        # were seen; up to 1.2 s, more of them go away, at every stage of a request's life still).
        assert sum(cancelled) >= 60, sum(cancelled)
        await idle(cluster)
        reference = await grpc_tokens(cluster.grpc("reference"), prompts[0], 8)
        assert (await grpc_tokens(cluster.grpc("pd"), prompts[0], 8))[0] == reference[0]

    run(check())


@pytest.mark.parametrize("fault", [Fault("flip", 4000), Fault("flip", 60), Fault("cut", 4000)],
                         ids=["corrupted-payload", "corrupted-header", "cut-mid-message"])
def test_a_broken_transfer_is_computed_on_the_decode_worker(cluster: PdCluster, fault: Fault) -> None:
    """A byte of the first DATA message flipped (in its payload, or in its header past the prefix), or the
    connection cut in the middle of it, on the way to the decode worker: the decode worker computes the
    prompt itself and the client gets the colocated answer; the next transfer goes through again."""
    rng = random.Random(f"{fault.action}-{fault.offset}")
    prompt, after = random_prompt(rng, 600), random_prompt(rng, 400)
    relay = cluster.relays["decode-0"]

    async def check() -> None:
        references = [await grpc_tokens(cluster.grpc("reference"), p, 8) for p in (prompt, after)]
        failures = metric(cluster, "pdrouter_kv_transfer_failures_total")
        moved = transfer_bytes(cluster)
        relay.arm(fault)
        text, usage = await http_completion(cluster.http("pd"), prompt, 8, stream=fault.action == "cut")
        assert relay.fired.is_set()
        assert text == references[0][1]
        assert usage["prompt_tokens_details"]["cached_tokens"] == 0
        assert metric(cluster, "pdrouter_kv_transfer_failures_total") == failures + 1  # the attempt, reported
        assert transfer_bytes(cluster) == moved  # no transfer completed: the decode worker computed the prompt
        assert (await grpc_tokens(cluster.grpc("pd"), after, 8))[0] == references[1][0]
        assert transfer_bytes(cluster) - moved == sent_blocks(len(after)) * BLOCK_BYTES

    run(check())
    run(idle(cluster))


def fault_load(cluster: PdCluster, victim: str, *, tokens: int, max_tokens: int, after_s: float = 0.0,
               held: WorkerRelay | None = None) -> Outcomes:
    """Four clients sending prompts with known colocated answers, streamed and not, while ``victim`` is
    killed (SIGKILL, its vLLM processes with it) ``after_s`` seconds in, or (``held``: a relay armed to
    hold a DATA message) once the relay holds one, then the relay released; how their answers ended."""
    rng = random.Random(victim)
    prompts = [random_prompt(rng, tokens) for _ in range(4)]
    references = [run(grpc_tokens(cluster.grpc("reference"), p, max_tokens))[1] for p in prompts]
    outcomes = Outcomes()

    async def load() -> None:
        async def client(i: int) -> None:
            for n in range(3):
                await classified(cluster.http("pd"), prompts[i], max_tokens, references[i], outcomes,
                                 stream=(i + n) % 2 == 0)

        async def killer() -> None:
            await asyncio.sleep(after_s)
            if held is not None:
                assert await asyncio.to_thread(held.fired.wait, BOUND_S), "no KV transfer began"
            await asyncio.to_thread(cluster.kill, victim)
            if held is not None:
                held.release()

        started = time.monotonic()
        await asyncio.gather(*(client(i) for i in range(4)), killer())
        assert time.monotonic() - started < 3 * BOUND_S

    run(load())
    return outcomes


def test_kill_9_of_the_decode_worker_mid_stream(cluster: PdCluster) -> None:
    epoch = run(epoch_of(cluster, "decode-0"))
    outcomes = fault_load(cluster, "decode-0", tokens=300, max_tokens=400, after_s=4.0)
    assert outcomes.wrong == [], outcomes
    assert outcomes.clean_errors >= 1, outcomes  # the streams in flight ended with an error, cleanly
    # The prefill engine holds nothing, and nothing is booked on the dead decode incarnation.
    run(idle(cluster, [("decode-0", epoch)]))
    cluster.start_worker("decode", "decode-0").wait_ready(START_S)  # a new incarnation for what follows
    run(wait_for(lambda: live(cluster), "the decode worker back", lambda n: n == 2))
    run(listed(cluster))


def test_kill_9_of_the_prefill_worker_mid_transfer(cluster: PdCluster) -> None:
    """Killed while the decode worker's relay holds the rest of a DATA message it sent: the transfer is
    cut in its middle whatever the machine's speed (a kill at a fixed moment could fall between
    transfers, the prompts of later rounds being computed on the decode worker, which holds them)."""
    failed = metric(cluster, "pdrouter_kv_transfer_failures_total")
    relay = cluster.relays["decode-0"]
    relay.arm(Fault("hold", 4000))
    outcomes = fault_load(cluster, "prefill-0", tokens=1500, max_tokens=8, held=relay)
    assert outcomes.wrong == [], outcomes
    assert outcomes.correct >= 1, outcomes
    assert metric(cluster, "pdrouter_kv_transfer_failures_total") > failed  # attempts it was in the middle of
    run(idle(cluster))  # the decode engine holds nothing, nothing is booked
