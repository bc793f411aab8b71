"""The router end to end: real worker processes, real Redis, both front doors, both modes.

The tests that need no real logits run on both engines (``BACKENDS``): a simulated worker's tokens
are pseudo-random (the same for the same greedy prompt), so with it the tests check the answers'
structure and that every front door and every retry agrees, not the torch model's text.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import grpc
import httpx
import openai
import pytest

from pdrouter.cli.local_cluster import ManagedProcess
from pdrouter.core.sampling import SamplingParams
from pdrouter.core.tokenizer import load_tokenizer
from pdrouter.core.workers import WorkerRole
from pdrouter.engine.config import EngineConfig
from pdrouter.engine.torch_engine import TorchEngine
from pdrouter.router.config import RouterConfig
from pdrouter.router.dispatch import DispatchConfig
from pdrouter.router.server import RouterProcess
from pdrouter.wire.v1 import common_pb2, router_pb2, router_pb2_grpc

from .conftest import BACKENDS, Cluster

PROMPT = "The quick brown fox"


def expected_text(model: Path, prompt: str, max_tokens: int) -> tuple[list[int], str]:
    tok = load_tokenizer(model)
    ids = tok.encode(prompt)
    out = TorchEngine(EngineConfig(model_dir=model, num_blocks=128)).generate(
        [ids], SamplingParams(max_tokens=max_tokens, temperature=0.0))[0]
    return out, tok.decode(out)


async def wait_workers(router: RouterProcess, roles: dict[WorkerRole, int]) -> None:
    assert router.pool is not None
    for _ in range(200):
        if all(len(router.pool.workers(role)) >= n for role, n in roles.items()):
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"workers never registered: {roles}")


async def check_front_doors(router: RouterProcess, model: Path, backend: str) -> None:
    """Both front doors answer; on torch workers with the reference engine's text and tokens, on
    simulated ones all with the same answer (greedy: the same prompt gives the same tokens)."""
    base = f"http://127.0.0.1:{router.http_port}"
    client = openai.AsyncOpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0)
    # Unary completion.
    done = await client.completions.create(model="tiny", prompt=PROMPT, max_tokens=12, temperature=0)
    assert done.usage is not None
    if backend == "torch":
        tokens, text = expected_text(model, PROMPT, 12)
        assert done.choices[0].text == text
        assert done.usage.completion_tokens == len(tokens)
    else:  # the tokens come from the gRPC front door below; they must decode to this text
        text = done.choices[0].text
        assert 0 < done.usage.completion_tokens <= 12 and done.choices[0].finish_reason in ("length", "stop")
    # Streaming completion: the concatenated chunks are the same text.
    stream = await client.completions.create(model="tiny", prompt=PROMPT, max_tokens=12, temperature=0,
                                             stream=True)
    parts = [chunk.choices[0].text async for chunk in stream if chunk.choices]
    assert "".join(parts) == text
    # Chat, unary and streaming.
    chat = await client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                                max_tokens=5, temperature=0)
    assert chat.choices[0].finish_reason in (("length",) if backend == "torch" else ("length", "stop"))
    chunks = await client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                                  max_tokens=5, temperature=0, stream=True)
    assert "".join([c.choices[0].delta.content or "" async for c in chunks if c.choices]) == \
        chat.choices[0].message.content
    models = await client.models.list()
    assert [m.id for m in models.data] == ["tiny"]
    await client.close()
    # gRPC front door: the same tokens.
    async with grpc.aio.insecure_channel(router.grpc_address) as channel:
        stub = router_pb2_grpc.RouterStub(channel)
        got: list[int] = []
        last = None
        async for msg in stub.Generate(router_pb2.GenerateRequest(
                model="tiny", text=PROMPT, sampling=common_pb2.SamplingParams(max_tokens=12, temperature=0))):
            got.extend(msg.token_ids)
            last = msg
        assert last is not None
        if backend == "torch":
            assert got == tokens
            assert last.finish_reason == common_pb2.FINISH_REASON_LENGTH
            assert last.usage.completion_tokens == 12
        else:
            assert load_tokenizer(model).decode(got) == text
            assert last.usage.completion_tokens == len(got) == done.usage.completion_tokens
            assert last.finish_reason in (common_pb2.FINISH_REASON_LENGTH, common_pb2.FINISH_REASON_STOP)


TRANSPORTS = ["lane", "grpc", "mixed"]
"""lane: the router reaches workers over their lanes; grpc: over gRPC only (``worker_transport``);
mixed: one worker serves no lane (``--lane-port -1``), so the router talks gRPC to that one."""


def spawn_for(cluster: Cluster, transport: str, roles: list[str]) -> None:
    for i, role in enumerate(roles):
        no_lane = transport == "mixed" and i == len(roles) - 1
        cluster.spawn(role, extra=("--lane-port", "-1") if no_lane else ())


def check_transport(router: RouterProcess, transport: str) -> None:
    assert router.pool is not None
    handles = router.pool.workers()
    on_lane = [h.lane is not None for h in handles]
    expected = {"lane": [True] * len(handles), "grpc": [False] * len(handles)}.get(transport)
    if expected is None:  # mixed: the last worker spawned has no lane
        assert sorted(on_lane) == [False] + [True] * (len(handles) - 1)
    else:
        assert on_lane == expected


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("transport", TRANSPORTS)
async def test_disaggregated_mode_both_front_doors(cluster: Cluster, transport: str) -> None:
    spawn_for(cluster, transport, ["prefill", "decode"])
    router = await cluster.router(dispatch=DispatchConfig(local_prefill_tokens=0),
                                  worker_transport="grpc" if transport == "grpc" else "lane")
    await wait_workers(router, {WorkerRole.PREFILL: 1, WorkerRole.DECODE: 1})
    check_transport(router, transport)
    await check_front_doors(router, cluster.model, cluster.backend)
    assert router.dispatcher is not None
    assert router.dispatcher.stats.transfers > 0  # long prompts went through the prefill pool


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("transport", ["lane", "grpc"])
async def test_colocated_mode_both_front_doors(cluster: Cluster, transport: str) -> None:
    cluster.spawn("worker")
    router = await cluster.router("colocated", worker_transport=transport)
    await wait_workers(router, {WorkerRole.COLOCATED: 1})
    check_transport(router, transport)
    await check_front_doors(router, cluster.model, cluster.backend)


@pytest.mark.parametrize("backend", BACKENDS)
async def test_bad_input_gets_400_and_the_router_keeps_serving(cluster: Cluster) -> None:
    cluster.spawn("worker")
    router = await cluster.router("colocated")
    await wait_workers(router, {WorkerRole.COLOCATED: 1})
    url = f"http://127.0.0.1:{router.http_port}/v1/completions"
    cases: list[tuple[bytes, int]] = [
        (b"{not json", 400),
        # An unknown model: 400 with OpenAI's code model_not_found.
        (json.dumps({"model": "nope", "prompt": "x", "max_tokens": 3}).encode(), 400),
        (json.dumps({"prompt": "x", "max_tokens": 3}).encode(), 400),
        (json.dumps({"model": "tiny", "max_tokens": 3}).encode(), 400),
        (json.dumps({"model": "tiny", "prompt": "x", "max_tokens": -1}).encode(), 400),
        (json.dumps({"model": "tiny", "prompt": "x" * 2000, "max_tokens": 3}).encode(), 400),
        (b'{"model": "tiny", "prompt": "\xff\xfe", "max_tokens": 3}', 400),
    ]
    async with httpx.AsyncClient() as http:
        for body, status in cases:
            resp = await http.post(url, content=body, headers={"content-type": "application/json"})
            assert resp.status_code == status, (body, resp.text)
            err = resp.json()["error"]
            assert err["message"] and err["type"]
        ok = await http.post(url, json={"model": "tiny", "prompt": "x", "max_tokens": 3})
        assert ok.status_code == 200
    async with grpc.aio.insecure_channel(router.grpc_address) as channel:
        stub = router_pb2_grpc.RouterStub(channel)
        with pytest.raises(grpc.aio.AioRpcError) as err:
            async for _ in stub.Generate(router_pb2.GenerateRequest(
                    model="tiny", text="x", sampling=common_pb2.SamplingParams(max_tokens=5000))):
                pass
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT


@pytest.mark.parametrize("backend", BACKENDS)
async def test_killed_prefill_worker_is_retried_elsewhere(cluster: Cluster, wait_for: object) -> None:
    doomed = cluster.spawn("prefill", worker_id="prefill-a")
    cluster.spawn("prefill", worker_id="prefill-b")
    decode = cluster.spawn("decode")
    router = await cluster.router()
    await wait_workers(router, {WorkerRole.PREFILL: 2, WorkerRole.DECODE: 1})
    doomed.kill()  # the router still lists it until its heartbeat lapses
    client = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{router.http_port}/v1", api_key="x", max_retries=0)
    results = await asyncio.gather(*(client.completions.create(model="tiny", prompt=PROMPT * 20, max_tokens=8,
                                                               temperature=0) for _ in range(4)))
    if cluster.backend == "torch":
        _, text = expected_text(cluster.model, PROMPT * 20, 8)
    else:  # pseudo-random, but the same prompt gives the same text whichever prefill worker served it
        text = results[0].choices[0].text
    assert all(r.choices[0].text == text for r in results)
    assert router.dispatcher is not None and router.dispatcher.stats.transfers > 0
    await client.close()
    assert decode.alive


@pytest.mark.parametrize("backend", BACKENDS)
async def test_killed_decode_worker_gives_a_clean_error(cluster: Cluster) -> None:
    cluster.spawn("prefill")
    decode = cluster.spawn("decode", time_scale=5.0)  # simulated: about 8 ms a token, 6 s for the 700
    router = await cluster.router()
    await wait_workers(router, {WorkerRole.PREFILL: 1, WorkerRole.DECODE: 1})
    url = f"http://127.0.0.1:{router.http_port}/v1/completions"
    body = {"model": "tiny", "prompt": PROMPT * 10, "max_tokens": 700, "temperature": 0, "stream": True,
            "ignore_eos": True}
    events: list[str] = []
    async with httpx.AsyncClient(timeout=30) as http, http.stream("POST", url, json=body) as resp:
        assert resp.status_code == 200
        async for line in resp.aiter_lines():
            if line.startswith("data:"):
                events.append(line)
                if len(events) == 3:
                    decode.kill()
    assert any('"error"' in e for e in events[3:]), events[-3:]
    assert router.admission is not None
    for _ in range(100):
        if router.admission.active == 0:
            break
        await asyncio.sleep(0.05)
    assert router.admission.active == 0


async def test_static_worker_list_without_redis(cluster: Cluster) -> None:
    worker = ManagedProcess("static-worker", ["worker", "--model", str(cluster.model), "--port", "0",
                                              "--num-blocks", "128", "--log-level", "WARNING"])
    cluster.procs.append(worker)
    assert worker.wait_ready()
    config = RouterConfig(model_dir=cluster.model, static_workers=(worker.address or "",), mode="colocated",
                          http_port=0, grpc_port=0, dispatch=DispatchConfig(mode="colocated"))
    router = RouterProcess(config)
    await router.start()
    cluster.routers.append(router)
    await wait_workers(router, {WorkerRole.COLOCATED: 1})
    assert router.admission is None and router.redis is None
    _, text = expected_text(cluster.model, PROMPT, 6)
    async with httpx.AsyncClient() as http:
        resp = await http.post(f"http://127.0.0.1:{router.http_port}/v1/completions",
                               json={"model": "tiny", "prompt": PROMPT, "max_tokens": 6, "temperature": 0})
    assert resp.status_code == 200 and resp.json()["choices"][0]["text"] == text
