"""Tenants' limits with two router processes on one real Redis and one simulated worker.

Each tenant's limits are one budget across both routers: a burst spread over them gets exactly the
limit admitted, never one more; token limits hold to within one request's tokens; refusals are
429s with ``Retry-After`` and OpenAI's error body naming the limit (gRPC: RESOURCE_EXHAUSTED), and
the OpenAI client acts on them (it waits what ``Retry-After`` says and retries).
"""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import Iterator
from pathlib import Path

import grpc
import httpx
import openai
import pytest
import redis.asyncio as aioredis

from pdrouter.cli.local_cluster import ManagedProcess
from pdrouter.state.tenant_limits import TenantLimiter
from pdrouter.wire.security import INTERNAL_TOKEN_ENV
from pdrouter.wire.v1 import common_pb2, router_pb2, router_pb2_grpc

from .conftest import Cluster

KEYS = {name: f"{name}-key-{'x' * 20}" for name in ("rpm", "tokens", "output", "one", "free", "spare")}
RPM = 20
PROMPT_TPM = 1000
OUTPUT_TPM = 200
TENANTS = f"""
tenants:
  rpm:
    requests_per_minute: {RPM}
  tokens:
    prompt_tokens_per_minute: {PROMPT_TPM}
  output:
    output_tokens_per_minute: {OUTPUT_TPM}
  one:
    max_concurrent: 1
  free:
    api_key_sha256: [{hashlib.sha256(KEYS['free'].encode()).hexdigest()}]
"""


@pytest.fixture
def backend() -> str:
    return "sim"


@pytest.fixture
def routers(cluster: Cluster, tmp_path: Path) -> Iterator[list[ManagedProcess]]:
    """A colocated simulated worker (5 ms of modeled time a step) and two routers with the tenants file;
    every key but ``free`` names its tenant in the key file (``free``'s is in the tenants file)."""
    (tmp_path / "tenants.yaml").write_text(TENANTS)
    (tmp_path / "keys").write_text("".join(f"{key} {name}\n" if name not in ("free", "spare") else f"{key}\n"
                                           for name, key in KEYS.items()))
    cluster.spawn("worker", num_blocks=4096, time_scale=3.0)
    procs = [ManagedProcess(f"router-{i}", [
        "router", "--model", str(cluster.model), "--redis", cluster.redis_url, "--mode", "colocated",
        "--http-port", "0", "--grpc-port", "0", "--tenants", str(tmp_path / "tenants.yaml"),
        "--api-key-file", str(tmp_path / "keys"), "--log-level", "WARNING"],
        env={INTERNAL_TOKEN_ENV: cluster.internal_token}) for i in range(2)]
    cluster.procs.extend(procs)
    for proc in procs:
        proc.wait_ready()
    yield procs


async def _complete(http: httpx.AsyncClient, router: ManagedProcess, tenant: str, prompt: list[int],
                    max_tokens: int = 4) -> httpx.Response:
    return await http.post(f"http://{router.address}/v1/completions",
                           headers={"authorization": f"Bearer {KEYS[tenant]}"},
                           json={"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True})


async def _burst(routers: list[ManagedProcess], tenant: str, n: int, prompt: list[int],
                 max_tokens: int = 4) -> list[httpx.Response]:
    """``n`` requests at once, spread over the routers in turn."""
    async with httpx.AsyncClient(timeout=60) as http:
        # Every router has the worker in its pool before the burst.
        for router in routers:
            for _ in range(100):
                if (await _complete(http, router, "free", [1, 2])).status_code == 200:
                    break
                await asyncio.sleep(0.1)
        return await asyncio.gather(*(_complete(http, routers[i % 2], tenant, prompt, max_tokens) for i in range(n)))


def _refusal(resp: httpx.Response, limit: str) -> int:
    """Check a refusal's shape; its Retry-After in seconds."""
    assert resp.status_code == 429, resp.text
    error = resp.json()["error"]
    assert error["type"] == "rate_limit_error" and error["code"] == "rate_limit_exceeded"
    assert f"({limit}:" in error["message"] or f"({limit})" in error["message"], error["message"]
    return int(resp.headers["retry-after"])


async def test_a_requests_per_minute_limit_is_exact_across_two_routers(cluster: Cluster,
                                                                      routers: list[ManagedProcess]) -> None:
    answers = await _burst(routers, "rpm", 3 * RPM, [65] * 8)
    ok = [r for r in answers if r.status_code == 200]
    assert len(ok) == RPM  # never one more, though both routers raced for the last of the budget
    waits = [_refusal(r, "requests_per_minute") for r in answers if r.status_code != 200]
    assert len(waits) == 2 * RPM and all(1 <= w <= 60 for w in waits)
    # Both routers admitted some (one budget, two doors), and Redis holds exactly the limit.
    client = aioredis.Redis.from_url(cluster.redis_url)
    try:
        assert (await TenantLimiter(client).usage("rpm"))["requests"] == RPM
    finally:
        await client.aclose()
    # The gRPC door counts against the same budget and refuses in its own words.
    async with grpc.aio.insecure_channel(routers[1].grpc_address or "") as channel:
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await router_pb2_grpc.RouterStub(channel).Generate(
                router_pb2.GenerateRequest(model="tiny", token_ids=router_pb2.TokenIds(ids=[65] * 8),
                                           sampling=common_pb2.SamplingParams(max_tokens=2)),
                metadata=[("authorization", f"Bearer {KEYS['rpm']}")]).read()
    assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "requests_per_minute" in (refused.value.details() or "")
    # Other tenants, and keys naming none, are not held back by it.
    async with httpx.AsyncClient(timeout=60) as http:
        for tenant in ("free", "spare"):
            assert (await _complete(http, routers[0], tenant, [65] * 8)).status_code == 200


async def test_token_limits_hold_to_within_one_requests_tokens(routers: list[ManagedProcess]) -> None:
    prompt = [66] * 90  # token ids, sent as they are: 90 prompt tokens
    answers = await _burst(routers, "tokens", 30, prompt)
    admitted = [r for r in answers if r.status_code == 200]
    used = sum(r.json()["usage"]["prompt_tokens"] for r in admitted)
    assert PROMPT_TPM - len(prompt) < used <= PROMPT_TPM  # filled to within one request, never past it
    assert all(_refusal(r, "prompt_tokens_per_minute") >= 1 for r in answers if r.status_code != 200)
    # Output tokens are counted as max_tokens when admitted, so they never pass the limit either.
    answers = await _burst(routers, "output", 20, [67] * 4, max_tokens=30)
    generated = sum(r.json()["usage"]["completion_tokens"] for r in answers if r.status_code == 200)
    assert OUTPUT_TPM - 30 < generated <= OUTPUT_TPM
    assert all(_refusal(r, "output_tokens_per_minute") >= 1 for r in answers if r.status_code != 200)
    # A request that alone is over a limit is told it never passes.
    async with httpx.AsyncClient(timeout=60) as http:
        huge = await _complete(http, routers[0], "tokens", [66] * (PROMPT_TPM + 1))
    assert huge.status_code == 429 and huge.headers["x-should-retry"] == "false"
    assert "can never pass" in huge.json()["error"]["message"]


async def test_the_openai_client_waits_what_retry_after_says_and_gets_in(cluster: Cluster,
                                                                          routers: list[ManagedProcess]) -> None:
    """Tenant ``one`` may run one request at a time: of two sent at once, one is refused with
    ``Retry-After: 1``; the OpenAI client waits that long, retries, and both complete."""
    clients = [openai.AsyncOpenAI(base_url=f"http://{r.address}/v1", api_key=KEYS["one"], max_retries=3)
               for r in routers]
    try:
        await _burst(routers, "free", 0, [1])  # both routers see the worker
        done = await asyncio.gather(*(c.completions.create(model="tiny", prompt=[68] * 8, max_tokens=64,
                                                           extra_body={"ignore_eos": True}) for c in clients))
        assert [d.usage.completion_tokens for d in done if d.usage is not None] == [64, 64]
        without_retries = clients[0].with_options(max_retries=0)
        holder = asyncio.ensure_future(clients[1].completions.create(model="tiny", prompt=[68] * 8, max_tokens=512,
                                                                     extra_body={"ignore_eos": True}))
        redis = aioredis.Redis.from_url(cluster.redis_url)
        try:
            while (await TenantLimiter(redis).usage("one"))["running"] == 0:  # the holder runs
                assert not holder.done()
                await asyncio.sleep(0.01)
        finally:
            await redis.aclose()
        with pytest.raises(openai.RateLimitError) as refused:
            await without_retries.completions.create(model="tiny", prompt=[68] * 8, max_tokens=4)
        await holder
    finally:
        for c in clients:
            await c.close()
    assert refused.value.response.headers["retry-after"] == "1"
    assert refused.value.code == "rate_limit_exceeded" and "max_concurrent" in refused.value.message
    # Of the two sent at once, one was refused and retried: with the one refused above, two refusals.
    refusals = 0.0
    async with httpx.AsyncClient(timeout=10) as http:
        for router in routers:
            text = (await http.get(f"http://{router.address}/metrics",
                                   headers={"authorization": f"Bearer {KEYS['free']}"})).text
            series = 'pdrouter_tenant_rejections_total{reason="max_concurrent",tenant="one"} '
            refusals += sum(float(line[len(series):]) for line in text.splitlines() if line.startswith(series))
    assert refusals == 2
