"""A simulated worker (``--backend sim``) as a real process: no torch, and the real geometry's registration.

The tests that a simulated worker serves, rejects and cleans up like a torch one are the
``BACKENDS``-parametrized ones of ``test_pd_workers`` and ``test_colocated_worker``.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import grpc
import redis.asyncio as aioredis

from pdrouter.cli.local_cluster import ManagedProcess
from pdrouter.core.capacity import plan_capacity
from pdrouter.core.gpu import get_gpu_preset
from pdrouter.core.kv_layout import KvLayout, model_compat_hash
from pdrouter.core.model_spec import get_model_preset
from pdrouter.core.sampling import SamplingParams
from pdrouter.core.workers import WorkerRole
from pdrouter.state.registry import WorkerRegistry
from pdrouter.wire.convert import sampling_to_pb
from pdrouter.wire.v1 import common_pb2, worker_pb2, worker_pb2_grpc

NO_TORCH_SCRIPT = """
import json, sys

import pdrouter.worker.process
import pdrouter.worker.roles
from pdrouter.cli.main import build_parser
from pdrouter.cli.worker_cmd import build_config
from pdrouter.core.gpu import get_gpu_preset
from pdrouter.core.model_spec import get_model_preset
from pdrouter.core.sampling import SamplingParams
from pdrouter.engine.sim.config import SimEngineConfig
from pdrouter.worker.backend import build_engine, device_name, kv_pool

engine = build_engine(SimEngineConfig(spec=get_model_preset("llama-3-8b"), gpu=get_gpu_preset("h100"), time_scale=0))
pool = kv_pool(engine)
assert pool.layout.num_blocks == engine.kv_layout.num_blocks, (pool.layout, engine.kv_layout)
assert device_name(engine) == "sim:h100-80g", device_name(engine)
# The command line's way, over a model folder that has torch weights: only its config.json is read.
args = build_parser().parse_args(["decode", "--backend", "sim", "--model", sys.argv[1], "--time-scale", "0",
                                  "--num-blocks", "64"])
folder_engine = build_engine(build_config(args).engine)
kv_pool(folder_engine)
out = folder_engine.generate([[257, 1, 2, 3]], SamplingParams(max_tokens=5, ignore_eos=True))
assert len(out[0]) == 5, out
print(json.dumps(sorted(m for m in sys.modules if m == "torch" or m.startswith("torch."))))
"""


def test_simulated_worker_never_imports_torch(tiny_model: Path) -> None:
    done = subprocess.run([sys.executable, "-c", NO_TORCH_SCRIPT, str(tiny_model)], capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout.strip().splitlines()[-1]) == []


def mapped_files(pid: int) -> str:
    """The shared objects and files mapped into a running process (Linux)."""
    return Path(f"/proc/{pid}/maps").read_text()


async def test_simulated_decode_worker_registers_the_real_geometry(redis_url: str) -> None:
    spec, gpu = get_model_preset("llama-3-8b"), get_gpu_preset("h100")
    blocks = plan_capacity(spec, gpu).num_blocks
    layout = KvLayout.for_model(spec, blocks, 16, spec.dtype)
    with ManagedProcess("sim-decode", ["decode", "--backend", "sim", "--model-preset", "llama-3-8b", "--gpu", "h100",
                                       "--time-scale", "0", "--port", "0", "--redis", redis_url,
                                       "--worker-id", "sim-decode", "--log-level", "WARNING"]) as worker:
        address = worker.wait_ready()
        assert "torch" not in mapped_files(worker.proc.pid)  # the running process too: no libtorch loaded
        client = aioredis.Redis.from_url(redis_url)
        try:
            live = await WorkerRegistry(client, spec.name).live_workers()
        finally:
            await client.aclose()
        assert len(live) == 1
        record = live[0].record
        assert (record.worker_id, record.role, record.address) == ("sim-decode", WorkerRole.DECODE, address)
        assert record.device == "sim:h100-80g"
        assert record.model == spec.name
        assert record.capacity_blocks == blocks > 10_000
        assert record.block_size == 16
        assert record.kv_compat_hash == layout.compat_hash()
        assert record.model_compat_hash == model_compat_hash(spec, 16, spec.dtype)
        assert record.kv_address and record.kv_backends == ("tcp",)

        async with grpc.aio.insecure_channel(address) as channel:
            info_stub = worker_pb2_grpc.WorkerInfoServiceStub(channel)
            info = await info_stub.GetInfo(worker_pb2.GetInfoRequest())
            assert info.role == common_pb2.WORKER_ROLE_DECODE and info.device == "sim:h100-80g"
            assert (info.capacity_blocks, info.model_compat_hash) == (blocks, record.model_compat_hash)
            kv = info.kv_layout
            assert (kv.num_layers, kv.num_kv_heads, kv.head_dim, kv.block_size, kv.num_blocks, kv.compat_hash) == \
                (spec.num_layers, spec.num_kv_heads, spec.head_dim, 16, blocks, layout.compat_hash())
            assert (info.model.num_layers, info.model.hidden_size, info.model.vocab_size) == \
                (spec.num_layers, spec.hidden_size, spec.vocab_size)
            load = await info_stub.GetLoad(worker_pb2.GetLoadRequest())
            assert load.free_blocks == blocks
            # The pool accounts the real geometry's blocks: 1000 prompt tokens take 63 of them.
            decode = worker_pb2_grpc.DecodeWorkerStub(channel)
            params = SamplingParams(max_tokens=8)
            alloc = await decode.Allocate(worker_pb2.AllocateRequest(
                request_id="r", prompt_token_ids=[1] * 1000, max_tokens=params.max_tokens,
                model_compat_hash=info.model_compat_hash, sampling=sampling_to_pb(params)))
            assert alloc.num_blocks == 63
            assert (await info_stub.GetLoad(worker_pb2.GetLoadRequest())).free_blocks == blocks - 63
            assert (await decode.Release(worker_pb2.ReleaseRequest(request_id="r"))).released


async def _finish_order(address: str, priorities: list[int], name: str) -> list[str]:
    """Send 2,048-token prompts of these priorities one after another (each call started before the
    next is sent) to a colocated worker (prompts of their own, so that none hits the prefix cache); the
    request ids (``<name><i>-p<priority>``) in the order their one token came back."""
    import asyncio

    done: list[str] = []
    params = sampling_to_pb(SamplingParams(max_tokens=1, ignore_eos=True))
    async with grpc.aio.insecure_channel(address) as channel:
        stub = worker_pb2_grpc.ColocatedWorkerStub(channel)

        async def one(i: int, priority: int) -> None:
            rid = f"{name}{i}-p{priority}"
            first = (len(name) * 4 + i) * 3001
            call = stub.Generate(worker_pb2.WorkerGenerateRequest(
                request_id=rid, prompt_token_ids=[(first + t) % 100_000 + 1 for t in range(2048)],
                sampling=params, priority=priority))
            async for _ in call:
                pass
            done.append(rid)

        tasks = []
        for i, priority in enumerate(priorities):
            tasks.append(asyncio.create_task(one(i, priority)))
            await asyncio.sleep(0.01)
        await asyncio.gather(*tasks)
    return done


async def test_a_prompt_of_a_lower_priority_value_overtakes_the_queued_prompts(redis_url: str) -> None:
    """Priority is a scheduling order, end to end over gRPC: a prompt sent last, at priority 0, behind
    three of priority 1 computed in chunks of 512 tokens, is answered before the two still queued
    (with every priority equal it is answered last: first come, first served).

    A step computes 512 tokens (``--max-batched-tokens``), so each prompt ends in a step of its own and
    the order the answers come back is the engine's. (At the simulated workers' default, 8,192, the
    three queued prompts were computed in one step and their answers raced each other back.)"""
    with ManagedProcess("sim-colocated", ["worker", "--backend", "sim", "--model-preset", "llama-3-8b", "--gpu",
                                          "h100", "--time-scale", "10", "--max-batched-tokens", "512", "--port", "0",
                                          "--redis", redis_url, "--worker-id", "sim-colocated",
                                          "--log-level", "WARNING"]) as worker:
        address = worker.wait_ready()
        ordered = await _finish_order(address, [1, 1, 1, 0], "first")
        assert ordered.index("first3-p0") < min(ordered.index("first1-p1"), ordered.index("first2-p1")), ordered
        fifo = await _finish_order(address, [0, 0, 0, 0], "fifo")
        assert fifo == ["fifo0-p0", "fifo1-p0", "fifo2-p0", "fifo3-p0"]
