"""vLLM through pd-router against vLLM's own OpenAI server: the same workload, direct and routed, in one run.

Processes (all on this machine, one OpenMP thread per engine): vLLM's OpenAI server
(``python -m vllm.entrypoints.openai.api_server``) on a model folder; Redis, one
``pdrouter worker --backend vllm`` on the same folder with the same engine settings (block size,
pool, context), and ``pdrouter router`` in front of it. This script is the load generator.

Workload: ``/v1/completions`` with text prompts of ``--prompt-tokens`` tokens, each unique (no
prefix hits on either side), ``--max-tokens`` greedy tokens with ``ignore_eos`` (every request
makes exactly that many), one request at a time, the two kinds taking turns request by request so
that the machine's drift hits both alike. Figures:

* ``direct_p50_ms`` / ``router_p50_ms``: end-to-end latency of a non-streamed request;
* ``overhead_ms_per_request``: router p50 minus direct p50, and ``overhead_ratio``: that over the
  direct p50 (what the router and its worker add to a request, as a fraction of what vLLM alone takes);
* ``*_stream_ms_per_token``: the same requests streamed, milliseconds per output token after the first;
* ``*_cpu_us_per_token``: CPU time per streamed output token of the processes that relay tokens:
  vLLM's API server process (its HTTP server, SSE encoding, detokenizing and its async engine
  client), the pd-router worker process (its async engine client in process, the worker lane) and
  the router process (its front door, detokenizing, SSE). The engine core processes, identical on
  both sides, are not counted. This is the measured reason the worker hosts vLLM's client in its own
  process: a worker relaying vLLM's own server would pay the API server's per-token CPU and then its
  own parsing of vLLM's SSE on top of what the in-process client costs.

    python benchmarks/vllm_overhead.py [--quick] [--json] [--requests N] [--max-tokens N]
                                       [--prompt-tokens N] [--model DIR]

Needs vLLM (``scripts/install_vllm.sh``). ``--quick`` runs 8 requests of each kind; the engines'
start-up (about a minute on a 2-core machine, mostly vLLM's imports) comes on top and cannot be
made shorter.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import signal
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
from _load import cpu_seconds
from _report import Report, base_parser

from pdrouter.cli.local_cluster import ManagedProcess
from pdrouter.state.embedded_redis import EmbeddedRedis
from pdrouter.testing.vllm_server import vllm_server
from pdrouter.wire.security import INTERNAL_TOKEN_ENV

BLOCK = 32
POOL_BLOCKS = 256
MAX_LEN = 2048
START_S = 900.0
VLLM_ENV = {"VLLM_CPU_OMP_THREADS_BIND": "nobind", "OMP_NUM_THREADS": "1"}


@dataclass
class Endpoint:
    name: str
    url: str
    pids: tuple[int, ...]
    """The processes whose CPU counts for this kind (the engine core processes excluded)."""


@contextlib.contextmanager
def direct(model: Path, log: Path) -> Iterator[Endpoint]:
    """vLLM's own OpenAI server with the worker's engine settings."""
    args = ["--served-model-name", model.name, "--enforce-eager", "--block-size", str(BLOCK), "--max-model-len",
            str(MAX_LEN), "--num-gpu-blocks-override", str(POOL_BLOCKS), "--kv-cache-memory-bytes",
            str(256 * 2**20), "--disable-uvicorn-access-log", "--disable-log-stats"]
    with vllm_server(model, args, log, env=VLLM_ENV, start_s=START_S) as server:
        yield Endpoint("direct", server.url, (server.proc.pid,))


@contextlib.contextmanager
def routed(model: Path, logs: Path) -> Iterator[Endpoint]:
    env = {INTERNAL_TOKEN_ENV: secrets.token_hex(16)}
    with EmbeddedRedis() as redis:
        worker = ManagedProcess("worker", [
            "worker", "--backend", "vllm", "--model", str(model), "--redis", redis.url, "--port", "0",
            "--block-size", str(BLOCK), "--num-blocks", str(POOL_BLOCKS), "--vllm-arg", f"max_model_len={MAX_LEN}",
            "--torch-threads", "1", "--log-level", "WARNING"], env=env, log_file=logs / "worker.log")
        router = None
        try:
            worker.wait_ready(START_S)
            router = ManagedProcess("router", [
                "router", "--model", str(model), "--redis", redis.url, "--mode", "colocated", "--block-size",
                str(BLOCK), "--http-port", "0", "--grpc-port", "0", "--log-level", "WARNING"], env=env,
                log_file=logs / "router.log")
            address = router.wait_ready()
            yield Endpoint("router", f"http://{address}", (worker.proc.pid, router.proc.pid))
        finally:
            if router is not None:
                router.stop()
            worker.stop(60)
            with contextlib.suppress(ProcessLookupError):
                os.killpg(worker.proc.pid, signal.SIGKILL)


def prompt(tokens: int) -> str:
    return (f"{uuid.uuid4().hex} measure the overhead of the request path " * 40)[: tokens - 1]


def wait_ready(client: httpx.Client, endpoint: Endpoint, model: str) -> None:
    """The router lists the worker a moment after it registered: retry until a request is served."""
    deadline = time.monotonic() + 60
    while True:
        resp = client.post(f"{endpoint.url}/v1/completions", json={"model": model, "prompt": "warm up",
                                                                   "max_tokens": 2, "temperature": 0})
        if resp.status_code == 200:
            return
        if time.monotonic() > deadline:
            raise RuntimeError(f"{endpoint.name}: {resp.status_code} {resp.text}")
        time.sleep(0.5)


def whole(client: httpx.Client, endpoint: Endpoint, model: str, tokens: int, max_tokens: int) -> float:
    body = {"model": model, "prompt": prompt(tokens), "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True}
    started = time.perf_counter()
    resp = client.post(f"{endpoint.url}/v1/completions", json=body)
    took = time.perf_counter() - started
    resp.raise_for_status()
    assert resp.json()["usage"]["completion_tokens"] == max_tokens
    return took


def streamed(client: httpx.Client, endpoint: Endpoint, model: str, tokens: int,
             max_tokens: int) -> tuple[float, list[float]]:
    """(seconds per token after the first, CPU seconds of each of the endpoint's relaying processes)."""
    body = {"model": model, "prompt": prompt(tokens), "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True}
    cpu_before = [cpu_seconds(pid) for pid in endpoint.pids]
    first = last = 0.0
    with client.stream("POST", f"{endpoint.url}/v1/completions", json=body) as resp:
        resp.raise_for_status()
        for line in resp.iter_lines():
            if line.startswith("data: {"):
                last = time.perf_counter()
                first = first or last
    cpu = [cpu_seconds(pid) - before for pid, before in zip(endpoint.pids, cpu_before, strict=True)]
    return (last - first) / max(1, max_tokens - 1), cpu


def main() -> int:
    parser = base_parser(__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=None, help="requests of each kind (default 40; --quick 8)")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--prompt-tokens", type=int, default=100)
    parser.add_argument("--model", type=Path, default=None,
                        help="model folder (default: the small preset in bfloat16, made for the run)")
    args = parser.parse_args()
    n = args.requests or (8 if args.quick else 40)
    report = Report()
    with tempfile.TemporaryDirectory(prefix="vllm-overhead-") as tmp:
        logs = Path(tmp)
        model = args.model
        if model is None:
            from pdrouter.engine.model_io import make_model

            model = make_model("small", 0, logs / "small", dtype="bfloat16")
        name = model.name
        with direct(model, logs / "vllm-server.log") as straight, routed(model, logs) as router, \
                httpx.Client(timeout=300) as client:
            kinds = (straight, router)
            for endpoint in kinds:
                wait_ready(client, endpoint, name)
            e2e: dict[str, list[float]] = {k.name: [] for k in kinds}
            per_token: dict[str, list[float]] = {k.name: [] for k in kinds}
            cpu: dict[str, list[list[float]]] = {k.name: [] for k in kinds}
            for i in range(n):
                for endpoint in kinds if i % 2 == 0 else kinds[::-1]:
                    e2e[endpoint.name].append(whole(client, endpoint, name, args.prompt_tokens, args.max_tokens))
                    itl, used = streamed(client, endpoint, name, args.prompt_tokens, args.max_tokens)
                    per_token[endpoint.name].append(itl)
                    cpu[endpoint.name].append([seconds / args.max_tokens for seconds in used])
    direct_p50 = statistics.median(e2e["direct"])
    router_p50 = statistics.median(e2e["router"])
    report.add("requests_per_kind", n)
    report.add("prompt_tokens", args.prompt_tokens)
    report.add("max_tokens", args.max_tokens)
    report.add("direct_p50_ms", direct_p50 * 1e3, "ms")
    report.add("router_p50_ms", router_p50 * 1e3, "ms")
    report.add("overhead_ms_per_request", (router_p50 - direct_p50) * 1e3, "ms")
    report.add("overhead_ratio", (router_p50 - direct_p50) / direct_p50)
    report.add("direct_stream_ms_per_token", statistics.median(per_token["direct"]) * 1e3, "ms")
    report.add("router_stream_ms_per_token", statistics.median(per_token["router"]) * 1e3, "ms")
    report.add("vllm_api_server_cpu_us_per_token", statistics.median(c[0] for c in cpu["direct"]) * 1e6, "us")
    report.add("worker_cpu_us_per_token", statistics.median(c[0] for c in cpu["router"]) * 1e6, "us")
    report.add("router_cpu_us_per_token", statistics.median(c[1] for c in cpu["router"]) * 1e6, "us")
    report.emit(args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
