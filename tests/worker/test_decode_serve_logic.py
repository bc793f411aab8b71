"""``DecodeServe``, ``Serve``'s logic, on fakes: events, the report, retries, cleanup; and its wire ends.

No processes: a fake engine driver, KV receiver and prefill links. The whole request over real
workers is ``test_decode_serve.py``.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Any

import grpc
import pytest

from pdrouter.core.disaggregation import PrefillFailure, PrefillOutcome, PrefillReport, PrefillRoute, ServeOrder
from pdrouter.core.errors import InvalidRequestError, PdRouterError, TransferError, UnavailableError
from pdrouter.core.ids import RequestId
from pdrouter.core.sampling import SamplingParams
from pdrouter.core.tokens import pack_token_ids
from pdrouter.engine.outputs import FinishReason, KvReservation, RequestOutput
from pdrouter.transfer.target import TransferTarget
from pdrouter.wire.convert import prompt_from_pb, sampling_from_pb, sampling_to_pb
from pdrouter.wire.lane import LaneError
from pdrouter.wire.prefill_links import PrefillLinks, RouteAddress
from pdrouter.wire.v1 import common_pb2, worker_pb2
from pdrouter.wire.worker_client import (
    report_from_pb,
    report_to_pb,
    serve_order_from_pb,
    serve_order_to_pb,
)
from pdrouter.worker.roles.decode_serve import REFUSED, DecodeServe, EngineStream, ReportChunk, ServeEvent

BLOCK = 16
SAMPLING = SamplingParams(max_tokens=3, temperature=0.0, seed=7)
TARGET = TransferTarget(transfer_id="t-1", peer="127.0.0.1:9", dst_block_ids=(4, 5, 6), compat_hash="k", epoch=3,
                        layer_start=0, layer_end=2, skip_blocks=1)
A, B = PrefillRoute("prefill-a", "10.0.0.1:1"), PrefillRoute("prefill-b", "10.0.0.2:1", lane_address="10.0.0.2:2")


def output(rid: str, token: int, finished: bool = False) -> RequestOutput:
    return RequestOutput(request_id=RequestId(rid), new_token_ids=(token,), finished=finished,
                         finish_reason=FinishReason.LENGTH if finished else None, num_prompt_tokens=40,
                         num_output_tokens=3, num_cached_tokens=0)


class FakeDriver:
    def __init__(self, cached_blocks: int = 1, bad_kv: int = 0) -> None:
        """``bad_kv``: how many of the first received KV checks find a value that is not finite."""
        self.cached_blocks = cached_blocks
        self.bad_kv = bad_kv
        self.aborted: list[str] = []
        self.streams: list[str] = []
        self.checked: list[tuple[str, int]] = []

    async def check_received_kv(self, request_id: RequestId, kv_bytes: int) -> None:
        self.checked.append((request_id, kv_bytes))
        if len(self.checked) <= self.bad_kv:
            raise TransferError(f"the KV received for request {request_id} holds values that are not finite")

    def reserve_remote(self, request_id: RequestId, prompt: Sequence[int], sampling: SamplingParams, *,
                       cache_salt: bytes = b"") -> KvReservation:
        blocks = -(-len(prompt) // BLOCK)
        return KvReservation(request_id, tuple(range(blocks)), self.cached_blocks, len(prompt), BLOCK)

    def abort(self, request_id: RequestId) -> bool:
        self.aborted.append(request_id)
        return True

    async def _stream(self, kind: str, rid: str, tokens: Sequence[int]) -> AsyncGenerator[RequestOutput, None]:
        self.streams.append(kind)
        for i, token in enumerate(tokens):
            yield output(rid, token, finished=i == len(tokens) - 1)

    def decode_remote(self, request_id: RequestId, first_token: int, *, whole: bool = False,
                      sink: object = None) -> AsyncGenerator[RequestOutput, None]:
        return self._stream("decode", request_id, [first_token + 1, first_token + 2])

    def generate(self, request_id: RequestId, prompt: Sequence[int], sampling: SamplingParams, *,
                 cache_salt: bytes = b"", trace_headers: object = None, priority: int = 0, whole: bool = False,
                 sink: object = None) -> AsyncGenerator[RequestOutput, None]:
        return self._stream("generate", request_id, [1, 2, 3])


class FakeIncoming:
    target = TARGET
    bytes_landed = 4096

    def __init__(self) -> None:
        self.aborted: str | None = None

    async def wait_all_async(self, timeout: float | None = None) -> None:
        return None

    def abort(self, reason: str) -> None:
        self.aborted = reason


class FakeReceiver:
    def __init__(self) -> None:
        self.expected: list[FakeIncoming] = []

    def expect(self, request_id: str, block_ids: Sequence[int], skip_blocks: int, timeout_s: float) -> FakeIncoming:
        incoming = FakeIncoming()
        self.expected.append(incoming)
        return incoming


class FakeLinks(PrefillLinks):
    """Answers (or raises) per worker id; records the calls."""

    def __init__(self, answers: dict[str, PrefillOutcome | PdRouterError]) -> None:
        super().__init__()
        self.answers = answers
        self.calls: list[tuple[str, float | None]] = []

    async def prefill(self, route: RouteAddress, request_id: str, prompt_token_ids: Sequence[int],
                      sampling: SamplingParams, target: TransferTarget, decode_worker_id: str,
                      model_compat_hash: str, timeout: float | None, cache_salt: bytes = b"",
                      priority: int = 0) -> PrefillOutcome:
        assert (target, decode_worker_id, sampling) == (TARGET, "decode-0", SAMPLING)
        self.calls.append((route.worker_id, timeout))
        answer = self.answers[route.worker_id]
        if isinstance(answer, PdRouterError):
            raise answer
        return answer


class Refusing:
    def __init__(self, *refused: str) -> None:
        self.refused = refused

    async def refusal(self, route: RouteAddress) -> str | None:
        return f"{route.worker_id!r} is not registered" if route.worker_id in self.refused else None


OK = PrefillOutcome(first_token=42, cached_tokens=32, compute_ms=1.5, transfer_ms=0.5, bytes_sent=2048)


def make(answers: dict[str, PrefillOutcome | PdRouterError], cached_blocks: int = 1,
         registered: Any = None, bad_kv: int = 0) -> tuple[DecodeServe, FakeDriver, FakeReceiver, FakeLinks]:
    driver, receiver, links = FakeDriver(cached_blocks, bad_kv), FakeReceiver(), FakeLinks(answers)
    serve = DecodeServe(driver, receiver, links, "decode-0", kv_wait_s=1.0,  # type: ignore[arg-type]
                        prefill_timeout_s=30.0, registered=registered)
    return serve, driver, receiver, links


def order(routes: Sequence[PrefillRoute] = (A, B), local_prefill_tokens: int = 0, prompt_len: int = 40) -> ServeOrder:
    return ServeOrder(request_id="r1", prompt_token_ids=list(range(prompt_len)), sampling=SAMPLING,
                      model_compat_hash="m", backend="", local_prefill_tokens=local_prefill_tokens, routes=routes)


async def drain(events: AsyncIterator[ServeEvent]) -> list[tuple[ServeEvent, list[RequestOutput]]]:
    """Every event, with the outputs of each ``EngineStream`` read while it is current."""
    seen: list[tuple[ServeEvent, list[RequestOutput]]] = []
    async for event in events:
        seen.append((event, [o async for o in event.outputs] if isinstance(event, EngineStream) else []))
    return seen


async def test_remote_prefill_reports_then_decodes() -> None:
    serve, driver, _, links = make({"prefill-a": OK})
    seen = await drain(serve.serve(order(), lambda: 5.0))
    (first, _), (stream, outputs) = seen
    assert first == ReportChunk(PrefillReport("prefill-a", False, 40, 32, BLOCK, 1.5, 0.5, 2048), 42)
    assert isinstance(stream, EngineStream) and stream.report is None and stream.cached_tokens == 32
    assert [o.new_token_ids for o in outputs] == [(43,), (44,)]
    assert links.calls == [("prefill-a", 5.0)] and driver.aborted == [] and "r1" not in serve._serving


async def test_a_failed_route_is_reported_and_the_next_is_tried() -> None:
    serve, driver, receiver, links = make({"prefill-a": UnavailableError("gone"), "prefill-b": OK})
    (first, _), _ = await drain(serve.serve(order(), lambda: None))
    assert isinstance(first, ReportChunk) and first.report.worker_id == "prefill-b"
    assert first.report.failures == (PrefillFailure("prefill-a", "UNAVAILABLE", "gone"),)
    assert links.calls == [("prefill-a", 30.0), ("prefill-b", 30.0)]  # no deadline: prefill_timeout_s
    assert receiver.expected[0].aborted and receiver.expected[1].aborted is None
    assert driver.aborted == ["r1"]


async def test_kv_that_is_not_finite_fails_that_route_and_the_next_is_tried() -> None:
    serve, driver, receiver, links = make({"prefill-a": OK, "prefill-b": OK}, bad_kv=1)
    (first, _), (_, outputs) = await drain(serve.serve(order(), lambda: None))
    assert isinstance(first, ReportChunk) and first.report.worker_id == "prefill-b"
    assert first.report.failures == (PrefillFailure(
        "prefill-a", "UNAVAILABLE", "the KV received for request r1 holds values that are not finite"),)
    assert driver.checked == [("r1", 4096), ("r1", 4096)] and links.calls == [("prefill-a", 30.0), ("prefill-b", 30.0)]
    assert receiver.expected[0].aborted and driver.aborted == ["r1"]  # the refused KV's blocks were freed
    assert [o.new_token_ids for o in outputs] == [(43,), (44,)]


async def test_every_route_failing_yields_the_report_then_the_last_error() -> None:
    serve, _, _, _ = make({"prefill-a": UnavailableError("gone"), "prefill-b": UnavailableError("down")})
    events = serve.serve(order(), lambda: None)
    first = await anext(events)
    assert first == ReportChunk(PrefillReport("", False, 40, 0, BLOCK, 0.0, 0.0, 0, (
        PrefillFailure("prefill-a", "UNAVAILABLE", "gone"), PrefillFailure("prefill-b", "UNAVAILABLE", "down"))), None)
    with pytest.raises(UnavailableError, match="prefill on prefill-b failed: down"):
        await anext(events)
    assert "r1" not in serve._serving


async def test_a_failure_that_is_not_retryable_ends_the_request() -> None:
    serve, driver, _, links = make({"prefill-a": InvalidRequestError("bad"), "prefill-b": OK})
    with pytest.raises(InvalidRequestError, match="bad"):
        await drain(serve.serve(order(), lambda: None))
    assert links.calls == [("prefill-a", 30.0)] and driver.aborted == ["r1"]


async def test_refused_routes_are_permission_denied_and_all_refused_is_unavailable() -> None:
    serve, _, _, links = make({"prefill-b": OK}, registered=Refusing("prefill-a"))
    (first, _), _ = await drain(serve.serve(order(), lambda: None))
    assert isinstance(first, ReportChunk) and first.report.worker_id == "prefill-b"
    assert [(f.worker_id, f.code) for f in first.report.failures] == [("prefill-a", REFUSED)]
    assert links.calls == [("prefill-b", 30.0)]
    serve, _, _, links = make({}, registered=Refusing("prefill-a"))
    with pytest.raises(UnavailableError, match="prefill on prefill-a refused: 'prefill-a' is not registered"):
        await drain(serve.serve(order(routes=[A]), lambda: None))
    assert links.calls == []


async def test_local_prefill_when_little_is_uncached_or_no_route() -> None:
    for o in (order(local_prefill_tokens=32), order(routes=())):
        serve, driver, _, links = make({"prefill-a": OK})
        [(stream, outputs)] = await drain(serve.serve(o, lambda: None))
        assert isinstance(stream, EngineStream) and stream.cached_tokens is None
        assert stream.report == PrefillReport("", True, 40, 0, BLOCK, 0.0, 0.0, 0)
        assert [o.new_token_ids for o in outputs] == [(1,), (2,), (3,)]
        assert links.calls == [] and driver.streams == ["generate"] and driver.aborted == ["r1"]


async def test_leaving_early_frees_the_request_and_a_duplicate_is_refused() -> None:
    serve, driver, _, _ = make({"prefill-a": OK})
    events = serve.serve(order(), lambda: None)
    assert isinstance(await anext(events), ReportChunk)
    with pytest.raises(InvalidRequestError, match="already on this worker"):
        serve.check_new("r1")
    with pytest.raises(InvalidRequestError, match="already on this worker"):
        serve.check_new("r2", held={"r2"})
    await events.aclose()
    assert driver.aborted == ["r1"] and "r1" not in serve._serving
    serve.check_new("r1")


async def test_a_route_without_an_address_is_the_callers_error() -> None:
    serve, _, _, _ = make({})
    with pytest.raises(InvalidRequestError, match="names neither an address nor a lane"):
        await drain(serve.serve(order(routes=[PrefillRoute("p", "")]), lambda: None))


# -- the wire ends: ServeRequest → ServeOrder, PrefillReport → message, PrefillLinks.prefill ----------------


def test_serve_order_and_report_convert_both_ways() -> None:
    o = ServeOrder(request_id="r", prompt_token_ids=(1, 2, 3), sampling=SAMPLING, model_compat_hash="m",
                   backend="tcp", local_prefill_tokens=32,
                   routes=(A, PrefillRoute("p", "h:1", "h:2", cached_tokens=16)))
    assert serve_order_from_pb(serve_order_to_pb(o)) == o  # the prompt read back as a tuple
    packed = ServeOrder(request_id="r", prompt_token_ids=[1, 2, 3], sampling=SAMPLING, model_compat_hash="m",
                        backend="tcp", local_prefill_tokens=32, prompt_token_bytes=pack_token_ids([1, 2, 3]))
    assert serve_order_to_pb(packed).prompt_token_bytes == pack_token_ids([1, 2, 3])  # sent as it came
    assert list(serve_order_from_pb(serve_order_to_pb(packed)).prompt_token_ids) == [1, 2, 3]
    msg = common_pb2.PrefillReport(prompt_tokens=40, decode_cached_tokens=16)
    msg.failures.add(worker_id="a", code="UNAVAILABLE", message="gone")
    msg.worker_id, msg.cached_tokens, msg.compute_ms, msg.transfer_ms, msg.bytes_sent = "b", 32, 1.25, 0.5, 4096
    assert report_to_pb(report_from_pb(msg)).SerializeToString() == msg.SerializeToString()
    local = common_pb2.PrefillReport(prompt_tokens=3, local=True)
    assert report_to_pb(report_from_pb(local)).SerializeToString() == local.SerializeToString()


@dataclass
class FakeCall:
    result: Any
    cancelled: bool = False

    def cancel(self) -> None:
        self.cancelled = True

    def __await__(self) -> Any:
        if isinstance(self.result, asyncio.Future):
            return self.result.__await__()
        if isinstance(self.result, BaseException):
            raise self.result
        return asyncio.sleep(0, self.result).__await__()


class FakeStub:
    def __init__(self, result: Any) -> None:
        self.call = FakeCall(result)
        self.requests: list[tuple[worker_pb2.PrefillRequest, float | None]] = []

    def Prefill(self, request: worker_pb2.PrefillRequest, timeout: float | None = None) -> FakeCall:
        self.requests.append((request, timeout))
        return self.call


async def call_prefill(links: PrefillLinks, sampling: SamplingParams = SAMPLING) -> PrefillOutcome:
    return await links.prefill(A, "r1", [1, 2, 3], sampling, TARGET, "decode-0", "m", 4.0)


async def test_prefill_builds_the_request_and_answers_an_outcome(monkeypatch: pytest.MonkeyPatch) -> None:
    stats = worker_pb2.PrefillStats(prompt_tokens=3, cached_tokens=16, compute_ms=2.0, transfer_ms=1.0,
                                    bytes_sent=512, blocks_sent=1)
    stub = FakeStub(worker_pb2.PrefillResponse(request_id="r1", first_token_id=9, stats=stats))
    links = PrefillLinks()
    monkeypatch.setattr(links, "stub", lambda route: stub)
    assert await call_prefill(links) == PrefillOutcome(9, 16, 2.0, 1.0, 512)
    [(request, timeout)] = stub.requests
    # The prompt goes packed, 4 little-endian bytes an id.
    assert request.prompt_token_bytes == bytes([1, 0, 0, 0, 2, 0, 0, 0, 3, 0, 0, 0]) and not request.prompt_token_ids
    assert timeout == 4.0 and list(prompt_from_pb(request)) == [1, 2, 3] and request.model_compat_hash == "m"
    assert (request.target.worker_id, request.target.transfer_id, request.target.skip_blocks) == ("decode-0", "t-1", 1)
    # The sampling the prefill worker reads is what the caller sent, top_p 0 (unset) included.
    sent = sampling_to_pb(SAMPLING)
    sent.top_p = 0.0
    assert sampling_from_pb(request.sampling) == sampling_from_pb(sent) == SAMPLING


async def test_prefill_failures_are_core_errors_and_cancelling_cancels_the_call(
        monkeypatch: pytest.MonkeyPatch) -> None:
    links = PrefillLinks()
    for failure, expected in ((LaneError(grpc.StatusCode.UNAVAILABLE, "gone"), UnavailableError),
                              (LaneError(grpc.StatusCode.INVALID_ARGUMENT, "bad"), InvalidRequestError),
                              (grpc.aio.UsageError("closed"), UnavailableError)):
        stub = FakeStub(failure)
        monkeypatch.setattr(links, "stub", lambda route, stub=stub: stub)
        with pytest.raises(expected):
            await call_prefill(links)
    stub = FakeStub(asyncio.get_running_loop().create_future())
    monkeypatch.setattr(links, "stub", lambda route: stub)
    task = asyncio.ensure_future(call_prefill(links))
    await asyncio.sleep(0)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert stub.call.cancelled
