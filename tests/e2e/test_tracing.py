"""Tracing end to end: a disaggregated request through a router, a prefill and a decode worker (three
processes) gives one trace, received by an in-process OTLP receiver, with every process's spans
parented correctly and the KV transfer's bytes on its span. Over the lane and over gRPC."""

from __future__ import annotations

import asyncio
import secrets
from collections.abc import Iterator
from pathlib import Path

import grpc
import httpx
import pytest

from pdrouter.cli.local_cluster import ManagedProcess, worker_args
from pdrouter.testing.otlp import CLIENT, INTERNAL, SERVER, OtlpSink, ReceivedSpan
from pdrouter.wire.security import INTERNAL_TOKEN_ENV
from pdrouter.wire.v1 import common_pb2, router_pb2, router_pb2_grpc

from .conftest import Cluster


@pytest.fixture
def backend() -> str:
    return "sim"


@pytest.fixture
def sink() -> Iterator[OtlpSink]:
    with OtlpSink() as running:
        yield running


def _start(cluster: Cluster, sink: OtlpSink, transport: str, prefill_fleet: int = 0) -> ManagedProcess:
    """A prefill worker exporting over OTLP/gRPC (``prefill_fleet``: that many, one fleet process), a
    decode worker and a router over OTLP/HTTP."""
    token = {INTERNAL_TOKEN_ENV: cluster.internal_token}
    for role, protocol in (("prefill", "grpc"), ("decode", "http/protobuf")):
        fleet = prefill_fleet if role == "prefill" else 0
        proc = ManagedProcess(role, worker_args(role, cluster.model, redis_url=cluster.redis_url, num_blocks=256,
                                                sim=["--gpu", "h100", "--time-scale", "0"], count=fleet or None,
                                                extra=("--worker-id", role if fleet else f"{role}-0")),
                              env={**token, **sink.environment(protocol)})
        cluster.procs.append(proc)
        if fleet:
            proc.wait_ready_all(fleet)
        else:
            proc.wait_ready()
    router = ManagedProcess("router", [
        "router", "--model", str(cluster.model), "--redis", cluster.redis_url, "--http-port", "0", "--grpc-port", "0",
        "--local-prefill-tokens", "0", "--worker-transport", transport, "--log-level", "WARNING"],
        env={**token, **sink.environment("http/protobuf")})
    cluster.procs.append(router)
    router.wait_ready()
    return router


async def _wait_for_trace(sink: OtlpSink, trace_id: str, services: set[str]) -> list[ReceivedSpan]:
    for _ in range(200):
        spans = sink.trace(trace_id)
        if {s.service for s in spans} >= services and any(s.name == "kv_transfer" for s in spans) \
                and any(s.name == "decode" for s in spans):
            await asyncio.sleep(0.3)  # late spans of the same trace
            return sink.trace(trace_id)
        await asyncio.sleep(0.05)
    raise AssertionError(f"trace {trace_id} incomplete: {[(s.service, s.name) for s in sink.trace(trace_id)]}")


def _one(spans: list[ReceivedSpan], service: str, name: str, kind: int | None = None) -> ReceivedSpan:
    found = [s for s in spans if s.service == service and s.name == name and (kind is None or s.kind == kind)]
    assert len(found) == 1, (service, name, [(s.service, s.name) for s in spans])
    return found[0]


@pytest.mark.parametrize("transport", ["lane", "grpc"])
async def test_a_disaggregated_request_is_one_trace_across_three_processes(cluster: Cluster, sink: OtlpSink,
                                                                           transport: str) -> None:
    router = _start(cluster, sink, transport)
    trace_id, parent_id = secrets.token_hex(16), secrets.token_hex(8)
    body = {"model": "tiny", "prompt": list(range(3, 83)), "max_tokens": 4, "ignore_eos": True}
    async with httpx.AsyncClient(timeout=30) as http:
        for _ in range(100):  # the router sees both workers
            resp = await http.post(f"http://{router.address}/v1/completions", json=body)
            if resp.status_code == 200 and resp.json()["usage"]["prompt_tokens_details"] is not None:
                break
            await asyncio.sleep(0.1)
        body["prompt"] = list(range(100, 180))  # not cached anywhere: prefilled on the prefill worker
        resp = await http.post(f"http://{router.address}/v1/completions", json=body,
                               headers={"traceparent": f"00-{trace_id}-{parent_id}-01", "tracestate": "client=1"})
    assert resp.status_code == 200, resp.text
    spans = await _wait_for_trace(sink, trace_id, {"pdrouter-router", "pdrouter-prefill", "pdrouter-decode"})
    by_id = {s.span_id: s for s in spans}
    root = _one(spans, "pdrouter-router", "POST /v1/completions", SERVER)
    assert root.parent_id == parent_id  # continues the client's trace
    assert root.attributes["gen_ai.usage.input_tokens"] == 80
    for name in ("admission", "placement", "first_token"):
        assert _one(spans, "pdrouter-router", name, INTERNAL).parent_id == root.span_id
    placement = _one(spans, "pdrouter-router", "placement")
    assert placement.attributes["pdrouter.prefill_workers"] == ["prefill-0"]
    assert placement.attributes["pdrouter.decode_worker"] == "decode-0"
    call = _one(spans, "pdrouter-router", "pdrouter.v1.DecodeWorker/Serve", CLIENT)
    assert call.parent_id == root.span_id
    serve = _one(spans, "pdrouter-decode", "pdrouter.v1.DecodeWorker/Serve", SERVER)
    assert serve.parent_id == call.span_id
    assert _one(spans, "pdrouter-decode", "decode", INTERNAL).parent_id == serve.span_id
    prefill_call = _one(spans, "pdrouter-decode", "pdrouter.v1.PrefillWorker/Prefill", CLIENT)
    assert prefill_call.parent_id == serve.span_id
    prefill = _one(spans, "pdrouter-prefill", "pdrouter.v1.PrefillWorker/Prefill", SERVER)
    assert prefill.parent_id == prefill_call.span_id
    compute = _one(spans, "pdrouter-prefill", "prefill", INTERNAL)
    transfer = _one(spans, "pdrouter-prefill", "kv_transfer", INTERNAL)
    assert compute.parent_id == transfer.parent_id == prefill.span_id
    assert transfer.attributes["pdrouter.kv.bytes"] > 0 and transfer.attributes["pdrouter.kv.blocks"] == 5
    assert transfer.attributes["pdrouter.kv.bytes"] == call.attributes["pdrouter.kv.bytes"]  # the router's report
    assert compute.end_ns <= transfer.start_ns + 1000 and transfer.end_ns <= prefill.end_ns
    # Every span of the trace hangs off the client's span through spans of the trace: nothing dangles.
    for span in spans:
        assert span.parent_id == parent_id or span.parent_id in by_id, span
        assert span.status_code != 2, span


async def test_the_workers_of_a_fleet_join_the_trace(cluster: Cluster, sink: OtlpSink) -> None:
    """Simulated prefill workers run as one fleet process (``--count``) export their spans too, each
    naming its worker: the fleet shares one tracer among its workers."""
    router = _start(cluster, sink, "lane", prefill_fleet=2)
    async with httpx.AsyncClient(timeout=30) as http:
        for i in range(200):
            trace_id = secrets.token_hex(16)
            body = {"model": "tiny", "prompt": list(range(100 + i, 180 + i)), "max_tokens": 2, "ignore_eos": True}
            resp = await http.post(f"http://{router.address}/v1/completions", json=body,
                                   headers={"traceparent": f"00-{trace_id}-{secrets.token_hex(8)}-01"})
            if resp.status_code == 200 and resp.json()["usage"]["prompt_tokens_details"] is not None:
                break
            await asyncio.sleep(0.1)
    assert resp.status_code == 200, resp.text
    spans = await _wait_for_trace(sink, trace_id, {"pdrouter-router", "pdrouter-prefill", "pdrouter-decode"})
    call = _one(spans, "pdrouter-decode", "pdrouter.v1.PrefillWorker/Prefill", CLIENT)
    prefill = _one(spans, "pdrouter-prefill", "pdrouter.v1.PrefillWorker/Prefill", SERVER)
    assert prefill.parent_id == call.span_id
    assert call.attributes["pdrouter.prefill_worker"] in ("prefill-0", "prefill-1")


async def test_the_grpc_door_continues_the_calls_trace_and_errors_mark_the_span(cluster: Cluster,
                                                                                 sink: OtlpSink) -> None:
    router = _start(cluster, sink, "lane")
    trace_id, parent_id = secrets.token_hex(16), secrets.token_hex(8)
    metadata = [("traceparent", f"00-{trace_id}-{parent_id}-01")]
    async with grpc.aio.insecure_channel(router.grpc_address or "") as channel:
        stub = router_pb2_grpc.RouterStub(channel)
        for _ in range(100):
            try:
                await stub.Generate(router_pb2.GenerateRequest(model="tiny", text="warm up",
                                                               sampling=common_pb2.SamplingParams(max_tokens=2))).read()
                break
            except grpc.aio.AioRpcError:
                await asyncio.sleep(0.1)
        with pytest.raises(grpc.aio.AioRpcError):  # a model it does not serve
            await stub.Generate(router_pb2.GenerateRequest(model="nope", text="x"), metadata=metadata).read()
    for _ in range(100):
        spans = sink.trace(trace_id)
        if spans:
            break
        await asyncio.sleep(0.05)
    [door] = spans
    assert door.name == "pdrouter.v1.Router/Generate" and door.parent_id == parent_id
    assert door.status_code == 2 and door.service == "pdrouter-router"


def test_tracing_is_off_without_the_variables(tmp_path: Path) -> None:
    from pdrouter.core.tracing import tracing_from_env, wants_tracing

    assert not wants_tracing({})
    assert not wants_tracing({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://x", "OTEL_SDK_DISABLED": "true"})
    assert not wants_tracing({"OTEL_TRACES_EXPORTER": "none", "OTEL_EXPORTER_OTLP_ENDPOINT": "http://x"})
    assert wants_tracing({"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://x"})
    assert wants_tracing({"OTEL_TRACES_EXPORTER": "console"})
    assert tracing_from_env("pdrouter-router", {}) is None
    from pdrouter.core.errors import ConfigError

    with pytest.raises(ConfigError, match="OTEL_TRACES_EXPORTER='zipkin'"):
        tracing_from_env("x", {"OTEL_TRACES_EXPORTER": "zipkin"})
    with pytest.raises(ConfigError, match="use http/protobuf or grpc"):
        tracing_from_env("x", {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://x", "OTEL_EXPORTER_OTLP_PROTOCOL": "thrift"})
