#!/usr/bin/env bash
# PD with vLLM on GPUs: greedy parity of a vLLM prefill and decode pair with a colocated vLLM, and
# pd-router's KV connector over NCCL.
#
# Prepared for a machine with CUDA GPUs and vLLM's GPU wheel in ./.venv (pip install -e '.[dev,vllm]');
# never part of the test suite. It starts, on the small random model in bfloat16 (KV blocks of 16,
# CUDA graphs on):
#   * `pdrouter prefill --backend vllm` on GPU 0 and `pdrouter decode --backend vllm` on GPU 1 (one
#     process per GPU: CUDA_VISIBLE_DEVICES) with --kv-backend nccl, behind a disaggregated router;
#     with one GPU both on it with --kv-backend tcp (NCCL refuses two ranks of one communicator on one
#     device, and a KV transfer is a two-rank group), and the NCCL path is reported as not run;
#   * a colocated `pdrouter worker --backend vllm` on GPU 0 behind a router of its own;
# one after the other (engines sharing a GPU must not profile its memory at once), then sends the
# same greedy prompts (1 to 1,500 tokens, on and off block boundaries, one with a prefix the decode
# worker holds) through both routers' gRPC doors, compares the token ids, and checks that the KV
# moved over the backend (the router's pdrouter_kv_transfer_bytes_total{backend=...}).
# Exit 0: all equal (and, with two GPUs, over NCCL); 1: a difference or a failure.
# Usage: bash scripts/gpu_check_vllm_pd.sh [--prompts N]   (about 3 minutes, most of it vLLM starting)
set -euo pipefail
cd "$(dirname "$0")/.."
if [ -x .venv/bin/python ]; then . .venv/bin/activate; fi
export PDROUTER_KV_TOKEN=${PDROUTER_KV_TOKEN:-$(python -c 'import secrets; print(secrets.token_hex(16))')}
export PDROUTER_INTERNAL_TOKEN=${PDROUTER_INTERNAL_TOKEN:-$(python -c 'import secrets; print(secrets.token_hex(16))')}

python - "$@" <<'PY'
import argparse
import asyncio
import os
import random
import signal
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

parser = argparse.ArgumentParser()
parser.add_argument("--prompts", type=int, default=12)
args = parser.parse_args()

try:
    import torch
    import vllm
except ImportError as exc:
    sys.exit(f"vLLM's GPU wheel is not importable here ({exc}): pip install -e '.[dev,vllm]'")
if not torch.cuda.is_available():
    sys.exit("no CUDA device: this check runs on GPUs")
DEVICES = torch.cuda.device_count()
KV_BACKEND = "nccl" if DEVICES >= 2 else "tcp"
if DEVICES < 2:
    print("one CUDA device: prefill and decode share it, KV over tcp; the NCCL path needs two (NCCL refuses "
          "two ranks of one communicator on one device) and is not run", flush=True)
print(f"vLLM {vllm.__version__}, torch {torch.__version__}, {torch.cuda.device_count()} devices:",
      ", ".join(torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())), flush=True)

import grpc  # noqa: E402

from pdrouter.cli.local_cluster import ManagedProcess  # noqa: E402
from pdrouter.engine.model_io import make_model  # noqa: E402
from pdrouter.state.embedded_redis import EmbeddedRedis  # noqa: E402
from pdrouter.wire.v1 import common_pb2, router_pb2, router_pb2_grpc  # noqa: E402

BLOCK = 16
folder = make_model("small", 0, Path(tempfile.mkdtemp(prefix="gpu-pd-")) / "small", dtype="bfloat16")
common = ["--backend", "vllm", "--model", str(folder), "--port", "0", "--block-size", str(BLOCK),
          "--vllm-arg", "max_model_len=2048", "--utilization", "0.3", "--log-level", "INFO"]
procs: list[ManagedProcess] = []


def start(name: str, argv: list[str], gpu: str | None = None) -> ManagedProcess:
    """One process; ``gpu``: the one device it sees (vLLM takes the first visible one)."""
    proc = ManagedProcess(name, argv, env={"CUDA_VISIBLE_DEVICES": gpu} if gpu is not None else None)
    procs.append(proc)
    return proc


def stop_all() -> None:
    for proc in reversed(procs):
        proc.stop(60)
        try:
            os.killpg(proc.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


async def tokens(address: str, prompt: list[int]) -> list[int]:
    ids: list[int] = []
    sampling = common_pb2.SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    async with grpc.aio.insecure_channel(address) as channel:
        stub = router_pb2_grpc.RouterStub(channel)
        request = router_pb2.GenerateRequest(model="small", token_ids=router_pb2.TokenIds(ids=prompt),
                                             sampling=sampling)
        async for msg in stub.Generate(request):
            ids.extend(msg.token_ids)
    return ids


def kv_bytes(router: ManagedProcess) -> float:
    """KV bytes the router counted over this run's backend."""
    with urllib.request.urlopen(f"http://{router.address}/metrics", timeout=10) as resp:
        return sum(float(line.rsplit(" ", 1)[1]) for line in resp.read().decode().splitlines()
                   if line.startswith(f'pdrouter_kv_transfer_bytes_total{{backend="{KV_BACKEND}"}}'))


redis = EmbeddedRedis()
redis.start()
failed = False
try:
    device = ["--device", "cuda:0"]
    kv = ["--kv-backend", KV_BACKEND, "--redis", redis.url]
    prefill = start("prefill", ["prefill", *common, *device, *kv, "--worker-id", "prefill-0"], gpu="0")
    print(f"{prefill.name:<10} {prefill.wait_ready(900)}", flush=True)
    decode = start("decode", ["decode", *common, *device, *kv, "--worker-id", "decode-0"],
                   gpu="1" if DEVICES >= 2 else "0")
    print(f"{decode.name:<10} {decode.wait_ready(900)}", flush=True)
    reference = start("reference", ["worker", *common, *device, "--worker-id", "reference"], gpu="0")
    print(f"{reference.name:<10} {reference.wait_ready(900)}", flush=True)
    router_args = ["router", "--model", str(folder), "--block-size", str(BLOCK), "--http-port", "0", "--grpc-port",
                   "0", "--log-level", "WARNING"]
    pd_router = start("pd-router", [*router_args, "--redis", redis.url, "--mode", "disaggregated"])
    ref_router = start("ref-router", [*router_args, "--workers", reference.address or "", "--mode", "colocated"])
    for proc in (pd_router, ref_router):
        proc.wait_ready()
    time.sleep(3)  # the workers' first heartbeats
    rng = random.Random(0)
    lengths = [1, 15, 16, 17, 33, 255, 256, 257, 1000, 1023, 1024, 1500][: args.prompts]
    prompts = [[rng.randrange(3, 256) for _ in range(n)] for n in lengths]
    prompts.append(prompts[-1][:1024] + [rng.randrange(3, 256) for _ in range(100)])  # a prefix decode holds
    for prompt in prompts:
        want = asyncio.run(tokens(ref_router.grpc_address or "", prompt))
        before = kv_bytes(pd_router)
        got = asyncio.run(tokens(pd_router.grpc_address or "", prompt))
        moved = kv_bytes(pd_router) - before
        same = got == want
        failed |= not same
        print(f"{len(prompt):>5} tokens: {'equal' if same else 'DIFFERENT'}, {moved:,.0f} bytes over {KV_BACKEND}"
              + ("" if same else f"\n  colocated {want}\n  PD        {got}"), flush=True)
    total = kv_bytes(pd_router)
    failed |= total <= 0
    print(f"KV over {KV_BACKEND} in all: {total:,.0f} bytes", flush=True)
except Exception as exc:
    failed = True
    print(f"failed: {type(exc).__name__}: {exc}", flush=True)
    for proc in procs:
        print(f"--- {proc.name} ---\n" + "\n".join(list(proc.tail)[-30:]), flush=True)
finally:
    stop_all()
    redis.stop()
print(f"PD parity, KV over {KV_BACKEND}:", "FAILED" if failed else "ok", flush=True)
if DEVICES < 2:
    print("NCCL path: not run (one device)", flush=True)
sys.exit(1 if failed else 0)
PY
