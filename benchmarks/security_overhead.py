"""What security costs the router: API keys, the internal secret and TLS against an open cluster, in one run.

Three disaggregated clusters share one Redis (each its own model pool) and run at once, so drift
hits them alike:

* ``open``: no API key, no internal secret, plaintext everywhere (loopback only);
* ``keys``: an API key on the front doors and the internal secret on every worker call, plaintext;
* ``tls``: the same plus TLS on both front doors and mutual TLS on the workers' gRPC ports, lanes
  and KV connections (certificates from a test CA, ``pdrouter.testing.pki``).

Workers are simulated GPUs in instant mode (``--time-scale 0``), so the figures are the router's
and the transports' own. The load generator sends the same short request (13-token prompt,
``--max-tokens`` greedy tokens) through the OpenAI HTTP door (keep-alive connections, a minimal
HTTP/1.1 client, TLS where the cluster has it) and the gRPC door; phases alternate between the
clusters, round by round. Figures per cluster and door: p50 latency at concurrency 1, requests/s
and the router's CPU per request at concurrency 32 (the router process's CPU-time clock); and each
secured cluster's figures as a ratio to ``open``'s, measured in the same run.

    python benchmarks/security_overhead.py [--quick] [--json] [--max-tokens N]
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import secrets
import ssl
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import grpc
from _report import Report, base_parser
from router_overhead import Samples, run_phase

from pdrouter.cli.local_cluster import ManagedProcess, worker_args
from pdrouter.core.tls import TlsFiles
from pdrouter.core.tokenizer import load_tokenizer
from pdrouter.engine.model_io import make_model
from pdrouter.state.embedded_redis import EmbeddedRedis
from pdrouter.testing.pki import TestCa, tls_flags
from pdrouter.wire.grpc_util import CHANNEL_OPTIONS
from pdrouter.wire.security import INTERNAL_TOKEN_ENV
from pdrouter.wire.v1 import common_pb2, router_pb2, router_pb2_grpc

PROMPT = "Hello, world"
CLUSTERS = ("open", "keys", "tls")


class HttpsCompletions:
    """``POST /v1/completions`` over one keep-alive connection per slot, TLS and a key when given."""

    def __init__(self, port: int, model: str, ids: list[int], max_tokens: int, api_key: str | None,
                 tls: ssl.SSLContext | None) -> None:
        self._port, self._tls = port, tls
        body = json.dumps({"model": model, "prompt": ids, "max_tokens": max_tokens, "temperature": 0,
                           "ignore_eos": True}).encode()
        auth = f"authorization: Bearer {api_key}\r\n" if api_key else ""
        self._request = (f"POST /v1/completions HTTP/1.1\r\nhost: 127.0.0.1:{port}\r\n{auth}"
                         f"content-type: application/json\r\ncontent-length: {len(body)}\r\n\r\n").encode() + body
        self._conns: dict[int, tuple[asyncio.StreamReader, asyncio.StreamWriter]] = {}

    async def once(self, slot: int) -> tuple[float, float]:
        conn = self._conns.get(slot)
        if conn is None or conn[0].at_eof():
            conn = self._conns[slot] = await asyncio.open_connection(
                "127.0.0.1", self._port, ssl=self._tls, server_hostname="127.0.0.1" if self._tls else None)
        reader, writer = conn
        start = time.perf_counter()
        writer.write(self._request)
        head = await reader.readuntil(b"\r\n\r\n")
        if not head.startswith(b"HTTP/1.1 200"):
            raise RuntimeError(f"the front door answered {head!r}")
        length = int(head.lower().split(b"content-length:", 1)[1].split(b"\r\n", 1)[0])
        body = await reader.readexactly(length)
        if b'"finish_reason"' not in body:
            raise RuntimeError(f"unexpected completion {body!r}")
        elapsed = time.perf_counter() - start
        return elapsed, elapsed

    async def close(self) -> None:
        for _, writer in self._conns.values():
            writer.close()
            with contextlib.suppress(OSError, ssl.SSLError):
                await writer.wait_closed()


class GrpcGenerate:
    """``Router.Generate`` on one channel (TLS and a key when given)."""

    def __init__(self, address: str, model: str, ids: list[int], max_tokens: int, api_key: str | None,
                 ca: bytes | None) -> None:
        self._channel = (grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS) if ca is None else
                         grpc.aio.secure_channel(address, grpc.ssl_channel_credentials(ca), options=CHANNEL_OPTIONS))
        self._stub = router_pb2_grpc.RouterStub(self._channel)
        self._metadata = (("authorization", f"Bearer {api_key}"),) if api_key else None
        self._request = router_pb2.GenerateRequest(
            model=model, token_ids=router_pb2.TokenIds(ids=ids),
            sampling=common_pb2.SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))

    async def once(self, slot: int) -> tuple[float, float]:
        start = time.perf_counter()
        async for _ in self._stub.Generate(self._request, metadata=self._metadata):
            pass
        elapsed = time.perf_counter() - start
        return elapsed, elapsed

    async def close(self) -> None:
        await self._channel.close()


@dataclass
class Cluster:
    """One disaggregated cluster (1 prefill, 1 decode, a router) of one security setting."""

    name: str
    model_name: str
    api_key: str | None
    pki: TlsFiles | None
    procs: list[ManagedProcess] = field(default_factory=list)
    router: ManagedProcess | None = None

    def env(self) -> dict[str, str]:
        env = {"PDROUTER_KV_TOKEN": secrets.token_hex(16)}
        if self.name != "open":
            env[INTERNAL_TOKEN_ENV] = secrets.token_hex(16)
        return env

    def start(self, model: Path, redis_url: str) -> None:
        env = self.env()
        tls = list(tls_flags(self.pki)) if self.pki is not None else []
        common = ["--served-model-name", self.model_name, *tls]
        for role in ("prefill", "decode"):
            proc = ManagedProcess(f"{self.name}-{role}", worker_args(
                role, model, redis_url=redis_url, num_blocks=2048, sim=["--gpu", "h100", "--time-scale", "0"],
                extra=("--worker-id", f"{self.name}-{role}", *common)), env=env)
            self.procs.append(proc)
            proc.wait_ready()
        router_env = {**env, "PDROUTER_API_KEYS": self.api_key or ""}
        self.router = ManagedProcess(f"{self.name}-router", [
            "router", "--model", str(model), "--redis", redis_url, "--http-port", "0", "--grpc-port", "0",
            "--local-prefill-tokens", "0", "--log-level", "WARNING", *common], env=router_env)
        self.procs.append(self.router)
        self.router.wait_ready()

    @property
    def http_port(self) -> int:
        assert self.router is not None and self.router.address is not None
        return int(self.router.address.rpartition(":")[2])

    @property
    def grpc_address(self) -> str:
        assert self.router is not None and self.router.grpc_address is not None
        return self.router.grpc_address

    def clients(self, ids: list[int], max_tokens: int) -> dict[str, HttpsCompletions | GrpcGenerate]:
        ssl_ctx = ssl.create_default_context(cafile=self.pki.ca) if self.pki is not None else None
        ca = self.pki.pem()[0] if self.pki is not None else None
        return {"http": HttpsCompletions(self.http_port, self.model_name, ids, max_tokens, self.api_key, ssl_ctx),
                "grpc": GrpcGenerate(self.grpc_address, self.model_name, ids, max_tokens, self.api_key, ca)}

    def stop(self) -> None:
        for proc in reversed(self.procs):
            proc.stop()


@contextlib.contextmanager
def clusters(model: Path, redis_url: str, folder: Path) -> Iterator[list[Cluster]]:
    pki = TestCa(folder, "bench").issue("cluster")
    made = [Cluster("open", "tiny-open", None, None), Cluster("keys", "tiny-keys", secrets.token_urlsafe(24), None),
            Cluster("tls", "tiny-tls", secrets.token_urlsafe(24), pki)]
    try:
        for cluster in made:
            cluster.start(model, redis_url)
        yield made
    finally:
        for cluster in made:
            cluster.stop()


async def measure(made: list[Cluster], ids: list[int], max_tokens: int, quick: bool) -> Report:
    report = Report()
    c1_n, c32_n, rounds, warmup = (40, 160, 2, 40) if quick else (150, 640, 4, 200)
    clients = {c.name: c.clients(ids, max_tokens) for c in made}
    pids = {c.name: c.router.proc.pid for c in made if c.router is not None}
    c1: dict[tuple[str, str], Samples] = {}
    c32: dict[tuple[str, str], Samples] = {}
    try:
        for doors in clients.values():
            for client in doors.values():
                await run_phase(client, 8, warmup, Samples(), None)
        for r in range(rounds):
            order = list(made) if r % 2 == 0 else list(reversed(made))
            for cluster in order:
                for door, client in clients[cluster.name].items():
                    await run_phase(client, 1, c1_n // rounds, c1.setdefault((cluster.name, door), Samples()), None)
                    await run_phase(client, 32, c32_n // rounds, c32.setdefault((cluster.name, door), Samples()),
                                    pids[cluster.name])
    finally:
        for doors in clients.values():
            for client in doors.values():
                await client.close()
    for door in ("http", "grpc"):
        for cluster in made:
            one, many = c1[(cluster.name, door)], c32[(cluster.name, door)]
            report.add(f"{cluster.name}_{door}_c1_p50_ms", one.p(0.5) * 1e3, "ms")
            report.add(f"{cluster.name}_{door}_c32_rps", many.rps, "req/s")
            report.add(f"{cluster.name}_{door}_router_cpu_per_request_us",
                       many.cpu_seconds / len(many.totals) * 1e6, "us")
        base1, base32 = c1[("open", door)], c32[("open", door)]
        base_cpu = base32.cpu_seconds / len(base32.totals)
        for cluster in made[1:]:
            one, many = c1[(cluster.name, door)], c32[(cluster.name, door)]
            report.add(f"{cluster.name}_vs_open_{door}_c1_p50_ratio", one.p(0.5) / base1.p(0.5), "x")
            report.add(f"{cluster.name}_vs_open_{door}_router_cpu_ratio",
                       many.cpu_seconds / len(many.totals) / base_cpu, "x")
            report.add(f"{cluster.name}_vs_open_{door}_c32_rps_ratio", many.rps / base32.rps, "x")
    return report


def main() -> None:
    parser = base_parser(__doc__.splitlines()[0])
    parser.add_argument("--max-tokens", type=int, default=2)
    args = parser.parse_args()
    os.environ.setdefault("PDROUTER_TORCH_THREADS", "1")
    with tempfile.TemporaryDirectory() as tmp, EmbeddedRedis() as redis_server:
        model = make_model("tiny", 0, Path(tmp) / "tiny")
        ids = load_tokenizer(model).encode(PROMPT)
        with clusters(model, redis_server.url, Path(tmp)) as made:
            report = asyncio.run(measure(made, ids, args.max_tokens, args.quick))
    report.emit(args.json)


if __name__ == "__main__":
    main()
