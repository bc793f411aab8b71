"""Quota: a vLLM worker under a memory limit gets the KV pool the limit leaves, and registers what vLLM allocated.

On the CPU the worker gives vLLM its KV space in bytes, made by the capacity math of the quota (quota
÷ the machine's memory as the utilization, less the weights); vLLM divides it into blocks and keeps
one aside (its null block). The worker registers the usable blocks and logs what the math predicted
beside what vLLM allocated. The refusals (a utilization or a KV space above the quota, one line,
nothing started) are in ``tests/cli/test_vllm_sizing.py``: they need no vLLM.
"""

from __future__ import annotations

import re
from pathlib import Path

import grpc

from pdrouter.cli.local_cluster import ManagedProcess
from pdrouter.cli.vllm_worker import machine_memory_bytes
from pdrouter.core.capacity import kv_bytes_per_token, kv_pool_bytes, weight_bytes_per_rank
from pdrouter.core.gpu import GiB
from pdrouter.core.model_spec import ModelSpec
from pdrouter.wire.v1 import worker_pb2, worker_pb2_grpc

from .conftest import BLOCK, START_S, run, stop_group

QUOTA_GB = 0.25


async def _info(address: str) -> worker_pb2.GetInfoRequest:
    async with grpc.aio.insecure_channel(address) as channel:
        return await worker_pb2_grpc.WorkerInfoServiceStub(channel).GetInfo(worker_pb2.GetInfoRequest(), timeout=10)


def test_the_pool_follows_the_memory_quota(vllm_model: Path, tmp_path: Path) -> None:
    spec = ModelSpec.from_pretrained_dir(vllm_model)
    physical = machine_memory_bytes()
    kv_bytes = kv_pool_bytes(physical, QUOTA_GB * GiB / physical, weight_bytes_per_rank(spec), 0)
    block_bytes = kv_bytes_per_token(spec) * BLOCK
    worker = ManagedProcess("quota-worker", [
        "worker", "--backend", "vllm", "--model", str(vllm_model), "--port", "0", "--block-size", str(BLOCK),
        "--quota-gb", str(QUOTA_GB), "--vllm-arg", "max_model_len=1024", "--torch-threads", "1", "--log-level", "INFO"],
        log_file=tmp_path / "worker.log")
    try:
        address = worker.wait_ready(START_S)
        info = run(_info(address))
        allocated = kv_bytes // block_bytes  # what vLLM makes of the KV space it was given
        assert info.capacity_blocks == allocated - 1 == info.kv_layout.num_blocks  # less vLLM's null block
        assert info.kv_layout.block_size == BLOCK and info.capacity_tokens == info.capacity_blocks * BLOCK
        assert (info.engine, info.engine_version) == ("vllm", __import__("vllm").__version__)
        assert info.device == "cpu"
        log = (tmp_path / "worker.log").read_text()
        plan = re.search(r"vLLM KV plan: ([\d.]+) GiB of KV space = ([\d.]+) × ([\d.]+) GiB − ([\d.]+) GiB of weights "
                         r"\(memory quota 0\.25 GiB \(--quota-gb 0\.25\)\)", log)
        assert plan is not None, log
        assert float(plan.group(1)) == round(kv_bytes / GiB, 2)
        line = re.search(r"KV pool: vLLM allocated ([\d,]+) blocks of 32 tokens at ([\d,]+) bytes per token .* "
                         r"predicted ([\d,]+) blocks .*: ([+-]\d+) blocks", log)
        assert line is not None, log
        assert int(line.group(1).replace(",", "")) == allocated == int(line.group(3).replace(",", ""))
        assert int(line.group(2).replace(",", "")) == kv_bytes_per_token(spec) and line.group(4) == "+0"
    finally:
        stop_group(worker)
