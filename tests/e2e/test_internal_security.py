"""Internal calls are authenticated: the shared secret on plaintext ports, mutual TLS end to end.

Real worker processes (simulated GPUs, no sleeping), real Redis, a real router, certificates from
two independent test CAs (``pdrouter.testing.pki``).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import secrets
import ssl
import time
from typing import Any

import grpc
import httpx
import pytest
import redis.asyncio as aioredis

from pdrouter.core.ids import WorkerId
from pdrouter.core.tls import TlsFiles
from pdrouter.core.workers import WorkerLoad, WorkerRole
from pdrouter.state.registry import WorkerRegistry
from pdrouter.testing.pki import TestCa, tls_flags
from pdrouter.wire.call_proofs import CALL_PROOF_METADATA, TARGET_METADATA, call_proof, new_call_proof
from pdrouter.wire.security import PeerSecurity, grpc_channel_credentials
from pdrouter.wire.v1 import common_pb2, router_pb2, router_pb2_grpc, worker_pb2, worker_pb2_grpc
from pdrouter.wire.worker_client import WorkerClient

from .conftest import Cluster
from .test_router_e2e import wait_workers

PROMPT = "Mutual TLS from the front door to the KV"


@pytest.fixture
def backend() -> str:
    return "sim"


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> TlsFiles:
    """A certificate for this machine from the cluster's CA."""
    return TestCa(tmp_path_factory.mktemp("pki"), "cluster").issue("member")


@pytest.fixture(scope="module")
def other_pki(tmp_path_factory: pytest.TempPathFactory) -> TlsFiles:
    """The same names, from another CA."""
    return TestCa(tmp_path_factory.mktemp("pki"), "other").issue("stranger")


async def _code_of(call: object) -> grpc.StatusCode:
    try:
        await call  # type: ignore[misc]
    except grpc.aio.AioRpcError as exc:
        return exc.code()
    return grpc.StatusCode.OK


async def test_worker_refuses_internal_calls_without_the_secret(cluster: Cluster) -> None:
    decode = cluster.spawn("decode")
    address = decode.address
    assert address is not None
    secret = cluster.internal_token.encode()
    allocate = worker_pb2.AllocateRequest(request_id="intruder", prompt_token_ids=[1] * 64, max_tokens=1, lease_ms=1000)
    get_load = "/pdrouter.v1.WorkerInfoService/GetLoad"
    async with grpc.aio.insecure_channel(address) as channel:
        stub = worker_pb2_grpc.DecodeWorkerStub(channel)
        info = worker_pb2_grpc.WorkerInfoServiceStub(channel)

        async def load_code(proof: str, target: str = address) -> grpc.StatusCode:
            return await _code_of(info.GetLoad(worker_pb2.GetLoadRequest(),
                                               metadata=((CALL_PROOF_METADATA, proof), (TARGET_METADATA, target))))

        assert await _code_of(stub.Allocate(allocate)) == grpc.StatusCode.UNAUTHENTICATED
        assert await _code_of(info.GetLoad(worker_pb2.GetLoadRequest())) == grpc.StatusCode.UNAUTHENTICATED
        # The secret itself is no credential (no caller sends it), nor a proof under another secret.
        assert await _code_of(stub.Allocate(allocate, metadata=(("x-pdrouter-internal-token",
                                                                 cluster.internal_token),))) \
            == grpc.StatusCode.UNAUTHENTICATED
        assert await load_code(new_call_proof(b"w" * 32, get_load, address)) == grpc.StatusCode.UNAUTHENTICATED
        # A proof made for another address (collected by a server a forged record named), for
        # another method, or stamped outside the window, is refused.
        elsewhere = "127.0.0.1:1"
        assert await load_code(new_call_proof(secret, get_load, elsewhere), elsewhere) \
            == grpc.StatusCode.UNAUTHENTICATED
        assert await load_code(new_call_proof(secret, "/pdrouter.v1.WorkerInfoService/GetInfo", address)) \
            == grpc.StatusCode.UNAUTHENTICATED
        stale_ms, nonce = int(time.time() * 1000) - 120_000, secrets.token_bytes(16)
        stale = f"{stale_ms}.{nonce.hex()}.{call_proof(secret, get_load, address, stale_ms, nonce).hex()}"
        assert await load_code(stale) == grpc.StatusCode.UNAUTHENTICATED
        # A valid proof opens the call, once: the same proof again is a replay.
        proof = new_call_proof(secret, get_load, address)
        assert await load_code(proof) == grpc.StatusCode.OK
        assert await load_code(proof) == grpc.StatusCode.UNAUTHENTICATED
        load = await info.GetLoad(worker_pb2.GetLoadRequest(), metadata=(
            (CALL_PROOF_METADATA, new_call_proof(secret, get_load, address)), (TARGET_METADATA, address)))
        assert load.free_blocks == load.total_blocks  # nothing the refused calls asked for was booked
    # The router, which has the secret, is served (WorkerClient presents it on every call).
    client = WorkerClient(decode.address, security=PeerSecurity(cluster.internal_token))
    try:
        record, _ = await client.info()
        assert record.role is WorkerRole.DECODE
    finally:
        await client.close()


async def test_disaggregated_request_over_tls_doors_and_mutual_tls(cluster: Cluster, pki: TlsFiles) -> None:
    cluster.spawn("prefill", extra=tls_flags(pki))
    decode = cluster.spawn("decode", extra=tls_flags(pki))
    router = await cluster.router(tls=pki)
    await wait_workers(router, {WorkerRole.PREFILL: 1, WorkerRole.DECODE: 1})
    verify = ssl.create_default_context(cafile=pki.ca)
    async with httpx.AsyncClient(base_url=f"https://127.0.0.1:{router.http_port}", verify=verify) as http:
        answer = await http.post("/v1/completions", json={"model": "tiny", "prompt": PROMPT, "max_tokens": 6,
                                                          "temperature": 0})
        assert answer.status_code == 200, answer.text
        body = answer.json()
        assert body["usage"]["completion_tokens"] > 0
    assert router.metrics is not None
    # The gRPC door over TLS gives the same tokens' count.
    credentials = grpc.ssl_channel_credentials(root_certificates=pki.pem()[0])
    async with grpc.aio.secure_channel(router.grpc_address, credentials) as channel:
        stub = router_pb2_grpc.RouterStub(channel)
        got = [msg async for msg in stub.Generate(router_pb2.GenerateRequest(
            model="tiny", text=PROMPT, sampling=common_pb2.SamplingParams(max_tokens=6, temperature=0)))]
        assert got[-1].usage.completion_tokens == body["usage"]["completion_tokens"]
    # Plaintext clients on TLS ports are refused: the HTTP door and a worker's gRPC port.
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{router.http_port}") as plain:
        with pytest.raises(httpx.HTTPError):
            await plain.get("/health")
    assert decode.address is not None
    async with grpc.aio.insecure_channel(decode.address) as channel:
        info = worker_pb2_grpc.WorkerInfoServiceStub(channel)
        assert await _code_of(info.GetLoad(worker_pb2.GetLoadRequest(), timeout=5)) == grpc.StatusCode.UNAVAILABLE


async def test_a_certificate_from_another_ca_is_refused(cluster: Cluster, pki: TlsFiles, other_pki: TlsFiles) -> None:
    stranger = cluster.spawn("decode", extra=tls_flags(other_pki))
    member = cluster.spawn("decode", extra=tls_flags(pki))
    assert stranger.address is not None and member.address is not None
    token = cluster.internal_token
    # The router's side (CA a) does not accept a worker whose certificate CA b signed...
    client = WorkerClient(stranger.address, security=PeerSecurity(token, pki))
    try:
        with pytest.raises(grpc.RpcError) as refused:
            await client.info(timeout=5)
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
    finally:
        await client.close()
    # ...and a worker of CA a does not accept a caller presenting CA b's certificate, secret or not.
    credentials = grpc_channel_credentials(TlsFiles(pki.ca, other_pki.cert, other_pki.key))
    async with grpc.aio.secure_channel(member.address, credentials) as channel:
        info = worker_pb2_grpc.WorkerInfoServiceStub(channel)
        proof = new_call_proof(token.encode(), "/pdrouter.v1.WorkerInfoService/GetLoad", member.address)
        code = await _code_of(info.GetLoad(worker_pb2.GetLoadRequest(), timeout=5,
                                           metadata=((CALL_PROOF_METADATA, proof), (TARGET_METADATA, member.address))))
        assert code == grpc.StatusCode.UNAVAILABLE
    # The member's own CA opens it.
    client = WorkerClient(member.address, security=PeerSecurity(token, pki))
    try:
        record, _ = await client.info(timeout=5)
        assert record.role is WorkerRole.DECODE
    finally:
        await client.close()


class ForeignServer:
    """What an attacker with write access to Redis points a forged worker record at: a gRPC server
    and a lane listener that greets like a worker that asks for no token. Both record everything
    they are sent: each gRPC call's method, metadata and request bytes, every lane byte."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, dict[str, str], bytes]] = []
        self.lane_bytes = bytearray()
        self.server = grpc.aio.server()
        self.server.add_generic_rpc_handlers((self,))
        self.address = f"127.0.0.1:{self.server.add_insecure_port('127.0.0.1:0')}"
        self.lane: asyncio.Server | None = None
        self.lane_address = ""

    def service(self, details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler:
        metadata = {key: str(value) for key, value in details.invocation_metadata}

        async def record(requests: Any, context: grpc.aio.ServicerContext) -> None:
            body = b"".join([r async for r in requests])
            self.calls.append((details.method, metadata, body))
            await context.abort(grpc.StatusCode.UNIMPLEMENTED, "a foreign server")

        return grpc.stream_stream_rpc_method_handler(record)

    async def _greet(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(ConnectionError, asyncio.IncompleteReadError):
            hello = await reader.readexactly(8)
            self.lane_bytes += hello
            writer.write(hello[:5] + b"\0\0\0")  # the client's own version, asking for no token
            while chunk := await reader.read(65536):
                self.lane_bytes += chunk
        writer.close()

    async def start(self) -> None:
        await self.server.start()
        self.lane = await asyncio.start_server(self._greet, "127.0.0.1", 0)
        self.lane_address = f"127.0.0.1:{self.lane.sockets[0].getsockname()[1]}"

    async def stop(self) -> None:
        await self.server.stop(0)
        if self.lane is not None:
            self.lane.close()


@pytest.mark.parametrize("transport", ["lane", "grpc"])
async def test_a_forged_registry_record_gets_no_prompt_and_no_secret(cluster: Cluster, transport: str) -> None:
    """A worker record planted in Redis names a foreign server, with more free KV than the real
    worker: the router sends it no prompt and no form of the internal secret, over the lane or gRPC
    (it asks it to prove the secret first, and it cannot)."""
    real = cluster.spawn("worker")
    foreign = ForeignServer()
    await foreign.start()
    client = aioredis.Redis.from_url(cluster.redis_url)
    registry = WorkerRegistry(client, "tiny")
    [live] = await registry.live_workers()
    forged = dataclasses.replace(live.record, worker_id=WorkerId("worker-forged"), epoch=await registry.new_epoch(),
                                 address=foreign.address,
                                 lane_address=foreign.lane_address if transport == "lane" else "",
                                 capacity_blocks=100_000)
    load = WorkerLoad(free_blocks=100_000, total_blocks=100_000)
    await registry.register(forged)

    async def keep_alive() -> None:
        while True:
            await registry.heartbeat(forged.worker_id, forged.epoch, load)
            await asyncio.sleep(0.3)

    beating = asyncio.ensure_future(keep_alive())
    try:
        router = await cluster.router("colocated", worker_transport=transport)
        await wait_workers(router, {WorkerRole.COLOCATED: 2})
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{router.http_port}", timeout=60) as http:
            for i in range(10):
                await http.post("/v1/completions", json={"model": "tiny", "prompt": f"{PROMPT} {i}", "max_tokens": 2})
        secret = cluster.internal_token
        assert all(method == "/grpc.health.v1.Health/Check" for method, _, _ in foreign.calls), foreign.calls
        assert not any(secret in value for _, metadata, _ in foreign.calls for value in metadata.values())
        assert secret.encode() not in foreign.lane_bytes
        # The lane got greetings with a challenge each, and nothing after them.
        greeting = 8 + 16 + 32
        assert len(foreign.lane_bytes) % greeting == 0 and b"pdrouter" not in foreign.lane_bytes
        assert real.alive
    finally:
        beating.cancel()
        await foreign.stop()
        await client.aclose()
