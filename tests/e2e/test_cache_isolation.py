"""Cache isolation: a prompt one tenant sent gives another tenant (another salt) no prefix hit and no
time-to-first-token advantage, in the engines or in the Redis index; within one salt the hit is there.

Simulated H100s on a weightless Llama-3-8B folder (``time_scale`` 4: modeled time runs four times
slower than the wall clock), so a 2,048-token prompt's prefill takes a few hundred milliseconds and a
cached one a fraction of that: the advantage a side channel would read is large against what a
loaded machine adds to every request, and compared as ratios within the test.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest

from pdrouter.cli.local_cluster import ManagedProcess, worker_args
from pdrouter.core.hashing import cache_salt_key, hash_blocks
from pdrouter.core.model_spec import get_model_preset
from pdrouter.core.tenants import parse_tenants
from pdrouter.core.workers import WorkerRole
from pdrouter.engine.model_folder import write_config_folder
from pdrouter.router.config import RouterConfig
from pdrouter.router.dispatch import DispatchConfig
from pdrouter.router.frontdoor.auth import ApiKeys
from pdrouter.router.server import RouterProcess
from pdrouter.state.client import redis_client
from pdrouter.state.prefix_index import PrefixIndex
from pdrouter.state.registry import WorkerRegistry
from pdrouter.wire.security import INTERNAL_TOKEN_ENV

MODEL = "llama-3-8b"
KEYS = {name: f"{name}-key-{'k' * 20}" for name in ("alpha", "beta", "open")}
TENANTS = {"tenants": {"alpha": None, "beta": None, "open": {"cache": "shared"}}}
PROMPT_TOKENS = 2048


@pytest.fixture(scope="module")
def sim_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_config_folder(get_model_preset(MODEL), tmp_path_factory.mktemp("sim-models") / MODEL)


@pytest.fixture
async def router(sim_model: Path, redis_url: str) -> AsyncIterator[RouterProcess]:
    token = "t" * 32
    procs = [ManagedProcess(role, worker_args(role, sim_model, redis_url=redis_url, sim=[
        "--gpu", "h100", "--utilization", "0.5", "--time-scale", "4"], extra=("--worker-id", f"{role}-0")),
        env={INTERNAL_TOKEN_ENV: token}) for role in ("prefill", "decode")]
    key_tenants = {key: name for name, key in KEYS.items()}
    config = RouterConfig(model_dir=sim_model, redis_url=redis_url, http_port=0, grpc_port=0, refresh_interval_s=0.2,
                          internal_token=token, api_keys=ApiKeys(KEYS.values()),
                          tenants=parse_tenants(TENANTS, key_tenants),
                          dispatch=DispatchConfig(local_prefill_tokens=0))
    process = RouterProcess(config)
    try:
        for proc in procs:
            proc.wait_ready()
        await process.start()
        assert process.pool is not None
        for _ in range(200):
            if process.pool.workers(WorkerRole.PREFILL) and process.pool.workers(WorkerRole.DECODE):
                break
            await asyncio.sleep(0.05)
        yield process
    finally:
        await process.stop(grace=1.0)
        for proc in procs:
            proc.stop()


async def _ttft(router: RouterProcess, tenant: str, prompt: list[int], salt: str | None = None) -> tuple[float, int]:
    """Time to the first streamed token, and the cached prompt tokens the usage reports."""
    body: dict[str, object] = {"model": MODEL, "prompt": prompt, "max_tokens": 2, "ignore_eos": True,
                               "stream": True, "stream_options": {"include_usage": True}}
    if salt is not None:
        body["cache_salt"] = salt
    first = None
    cached = -1
    async with httpx.AsyncClient(timeout=60) as http:
        start = time.perf_counter()
        async with http.stream("POST", f"http://127.0.0.1:{router.http_port}/v1/completions", json=body,
                               headers={"authorization": f"Bearer {KEYS[tenant]}"}) as resp:
            assert resp.status_code == 200, await resp.aread()
            async for line in resp.aiter_lines():
                if line.startswith("data: {") and first is None:
                    first = time.perf_counter() - start
                if '"usage":{' in line:
                    cached = int(line.split('"cached_tokens":')[1].split("}")[0])
    assert first is not None
    await asyncio.sleep(0.3)  # the prefill worker's block events reach the index
    return first, cached


async def _indexed_blocks(redis_url: str, prompt: list[int], salt: bytes) -> int:
    """Leading blocks of ``prompt`` under ``salt`` the Redis index says prefill-0 holds."""
    client = redis_client(redis_url, max_connections=4, pool_timeout_s=5.0)
    try:
        live = await WorkerRegistry(client, MODEL).live_workers(WorkerRole.PREFILL)
        prefill = [(w.record.worker_id, w.record.epoch) for w in live]
        held = await PrefixIndex(client, MODEL).matched_blocks(hash_blocks(prompt, 16, salt=salt), prefill)
        return max(held.values(), default=0)
    finally:
        await client.aclose()


async def _warm(router: RouterProcess, rng: random.Random) -> None:
    """Connections made and code paths run once (what a first request alone pays), on other prompts."""
    for tenant in KEYS:
        await _ttft(router, tenant, [rng.randrange(3, 30_000) for _ in range(PROMPT_TOKENS)])


async def test_another_tenants_prompt_gives_no_hit_and_no_head_start(router: RouterProcess, redis_url: str) -> None:
    rng = random.Random(11)
    await _warm(router, rng)
    prompt = [rng.randrange(3, 30_000) for _ in range(PROMPT_TOKENS)]
    cold, cached = await _ttft(router, "alpha", prompt)
    assert cached == 0
    assert await _indexed_blocks(redis_url, prompt, cache_salt_key("alpha", None)) == PROMPT_TOKENS // 16
    assert await _indexed_blocks(redis_url, prompt, b"") == 0  # nothing under the unsalted chain
    other, other_cached = await _ttft(router, "beta", prompt)  # the same prompt, another tenant
    again, again_cached = await _ttft(router, "alpha", prompt)  # the first tenant again: its own hit
    beta_again, beta_cached = await _ttft(router, "beta", prompt)  # beta now hits its own copy
    assert other_cached == 0 and again_cached >= PROMPT_TOKENS - 16 and beta_cached >= PROMPT_TOKENS - 16
    assert await _indexed_blocks(redis_url, prompt, cache_salt_key("beta", None)) == PROMPT_TOKENS // 16
    # No head start for beta from alpha's prompt: its time is a cold prefill's, a hit's is a fraction of it.
    assert other / cold > 0.7, (cold, other)
    assert again / cold < 0.5 and beta_again / other < 0.5, (cold, again, other, beta_again)


async def test_a_requests_cache_salt_shares_within_that_salt_only(router: RouterProcess) -> None:
    rng = random.Random(12)
    await _warm(router, rng)
    prompt = [rng.randrange(3, 30_000) for _ in range(PROMPT_TOKENS)]
    cold, cached = await _ttft(router, "open", prompt, salt="salt-x")
    hit, hit_cached = await _ttft(router, "open", prompt, salt="salt-x")
    miss, miss_cached = await _ttft(router, "open", prompt, salt="salt-y")
    plain, plain_cached = await _ttft(router, "open", prompt)
    assert cached == 0 and hit_cached >= PROMPT_TOKENS - 16 and miss_cached == 0 and plain_cached == 0
    assert hit / cold < 0.5 and miss / cold > 0.7 and plain / cold > 0.7, (cold, hit, miss, plain)
    # A salt a tenant that keeps its cache apart sends never reaches another's blocks either: alpha
    # sending salt-x gets no hit from open's salt-x.
    _, alpha_cached = await _ttft(router, "alpha", prompt, salt="salt-x")
    assert alpha_cached == 0
