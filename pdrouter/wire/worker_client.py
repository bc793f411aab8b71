"""The router's calls to one worker, in dataclasses: the protobuf side of the router's request flow.

``WorkerClient`` wraps one worker's gRPC channel and, where the worker serves one, its worker lane
(``pdrouter.wire.lane``): request RPCs go over the lane when there is one, ``GetInfo`` / ``GetLoad``
over gRPC. What the router hands it and gets back are plain values:

* ``serve(ServeOrder)``: ``DecodeWorker.Serve``, the decode worker driving one disaggregated request
  (it calls the ranked ``PrefillRoute`` s itself); the stream's ``PrefillReport`` goes to a callback
  once, when the first chunk brings it;
* ``generate(...)``: ``ColocatedWorker.Generate``;
* both return a ``TokenStream``: an async iterator of ``pdrouter.core.tokens.TokenDelta`` whose last
  delta carries the finish reason and ``Usage``, and ``cancel()``, which cancels the call (the worker
  frees the request's blocks). Failures arrive as ``pdrouter.core.errors`` types, never as
  ``grpc.RpcError``; a stream that ends without finishing is ``UnavailableError``.

The decode worker's ``Serve`` servicer uses the other direction of the same conversions:
``serve_order_from_pb`` (``ServeRequest`` → ``ServeOrder``) and ``report_to_pb``.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from typing import Any

import grpc

from pdrouter.core.errors import UnavailableError
from pdrouter.core.sampling import SamplingParams
from pdrouter.core.tokens import FinishReason, TokenDelta, Usage
from pdrouter.core.workers import WorkerLoad, WorkerRecord
from pdrouter.wire.convert import load_from_pb, record_from_pb, sampling_from_pb, sampling_to_pb
from pdrouter.wire.grpc_util import CHANNEL_OPTIONS, RPC_ERRORS, from_rpc_error
from pdrouter.wire.lane import LaneChannel, request_stubs
from pdrouter.wire.v1 import common_pb2, worker_pb2, worker_pb2_grpc

_FINISH = {common_pb2.FINISH_REASON_STOP: FinishReason.STOP,
           common_pb2.FINISH_REASON_LENGTH: FinishReason.LENGTH,
           common_pb2.FINISH_REASON_ABORT: FinishReason.ABORT}


# The records below are built once or twice per request on the router's path: plain slotted
# dataclasses, since a frozen one sets each field through object.__setattr__ (a ServeOrder with
# its route and a PrefillReport from its message: 13 µs frozen, 8 µs plain). Treat them as values.
@dataclass(slots=True)
class PrefillRoute:
    """How the decode worker reaches one prefill worker, and what the router expects it to hold."""

    worker_id: str
    address: str
    lane_address: str = ""
    """The prefill worker's lane (used by the decode worker when set)."""
    cached_tokens: int = 0


@dataclass(slots=True)
class ServeOrder:
    """One disaggregated request, as the router hands it to its decode worker."""

    request_id: str
    prompt_token_ids: Sequence[int]
    sampling: SamplingParams
    model_compat_hash: str
    backend: str
    local_prefill_tokens: int
    routes: Sequence[PrefillRoute] = ()
    """Prefill workers to try, best first (none: the decode worker computes the prompt)."""


@dataclass(slots=True)
class PrefillFailure:
    worker_id: str
    code: str
    """gRPC status code name, e.g. ``UNAVAILABLE``."""
    message: str


@dataclass(slots=True)
class PrefillReport:
    """How ``Serve`` got the prompt's KV: who computed it, what was cached, what the transfer cost."""

    worker_id: str
    """The prefill worker that computed the prompt ("" when ``local`` or when every attempt failed)."""
    local: bool
    prompt_tokens: int
    cached_tokens: int
    decode_cached_tokens: int
    compute_ms: float
    transfer_ms: float
    bytes_sent: int
    failures: tuple[PrefillFailure, ...] = ()


def report_from_pb(msg: common_pb2.PrefillReport) -> PrefillReport:
    return PrefillReport(
        worker_id=msg.worker_id, local=msg.local, prompt_tokens=msg.prompt_tokens,
        cached_tokens=msg.cached_tokens, decode_cached_tokens=msg.decode_cached_tokens,
        compute_ms=msg.compute_ms, transfer_ms=msg.transfer_ms, bytes_sent=msg.bytes_sent,
        failures=tuple(PrefillFailure(f.worker_id, f.code, f.message) for f in msg.failures) if msg.failures else ())


def report_to_pb(report: PrefillReport) -> common_pb2.PrefillReport:
    return common_pb2.PrefillReport(
        worker_id=report.worker_id, local=report.local, prompt_tokens=report.prompt_tokens,
        cached_tokens=report.cached_tokens, decode_cached_tokens=report.decode_cached_tokens,
        compute_ms=report.compute_ms, transfer_ms=report.transfer_ms, bytes_sent=report.bytes_sent,
        failures=[common_pb2.PrefillFailure(worker_id=f.worker_id, code=f.code, message=f.message)
                  for f in report.failures] if report.failures else None)


def serve_order_to_pb(order: ServeOrder) -> worker_pb2.ServeRequest:
    return worker_pb2.ServeRequest(
        request_id=order.request_id, prompt_token_ids=order.prompt_token_ids,
        sampling=sampling_to_pb(order.sampling), model_compat_hash=order.model_compat_hash,
        backend=order.backend, local_prefill_tokens=order.local_prefill_tokens,
        prefill=[worker_pb2.PrefillRoute(worker_id=r.worker_id, address=r.address, lane_address=r.lane_address,
                                         cached_tokens=r.cached_tokens) for r in order.routes])


def serve_order_from_pb(msg: worker_pb2.ServeRequest) -> ServeOrder:
    """The decode worker's side of ``serve_order_to_pb``; InvalidRequestError names a bad sampling field."""
    return ServeOrder(
        request_id=msg.request_id, prompt_token_ids=list(msg.prompt_token_ids), sampling=sampling_from_pb(msg.sampling),
        model_compat_hash=msg.model_compat_hash, backend=msg.backend, local_prefill_tokens=msg.local_prefill_tokens,
        routes=tuple([PrefillRoute(r.worker_id, r.address, r.lane_address, r.cached_tokens) for r in msg.prefill]))


class TokenStream:
    """A worker's ``TokenChunk`` stream as ``TokenDelta`` s (see the module docstring); iterate once."""

    __slots__ = ("_call", "_on_report", "_prompt_tokens", "_request_id")

    def __init__(self, call: Any, request_id: str, prompt_tokens: int,
                 on_report: Callable[[PrefillReport], None] | None = None) -> None:
        self._call = call
        self._request_id = request_id
        self._prompt_tokens = prompt_tokens
        self._on_report = on_report

    def cancel(self) -> None:
        """Cancel the call (no-op once it has ended); the worker frees the request's blocks."""
        self._call.cancel()

    async def __aiter__(self) -> AsyncIterator[TokenDelta]:
        on_report = self._on_report
        produced = 0
        try:
            async for chunk in self._call:
                if on_report is not None and chunk.HasField("prefill"):
                    on_report(report_from_pb(chunk.prefill))
                    on_report = None
                produced += len(chunk.token_ids)
                reason = _FINISH.get(chunk.finish_reason)
                if reason is None:
                    if chunk.token_ids:
                        yield TokenDelta(tuple(chunk.token_ids))
                    continue
                yield TokenDelta(tuple(chunk.token_ids), reason,
                                 Usage(self._prompt_tokens, produced, chunk.usage.cached_tokens))
                return
        except RPC_ERRORS as exc:
            raise from_rpc_error(exc) from None
        raise UnavailableError(f"request {self._request_id}: the worker ended the stream without finishing")


class WorkerClient:
    """Calls to one worker incarnation over its lane (request RPCs, when given) and gRPC."""

    def __init__(self, address: str, lane_address: str = "") -> None:
        """``lane_address``: the worker's lane, used for request RPCs ("" : gRPC only)."""
        self.channel = grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS)
        self.lane = LaneChannel(lane_address) if lane_address else None
        self._info = worker_pb2_grpc.WorkerInfoServiceStub(self.channel)
        _, self._decode, self._colocated = request_stubs(self.channel, self.lane)

    def serve(self, order: ServeOrder, timeout: float | None,
              on_report: Callable[[PrefillReport], None] | None = None) -> TokenStream:
        """``DecodeWorker.Serve``; ``on_report`` gets the stream's ``PrefillReport`` once."""
        try:
            call = self._decode.Serve(serve_order_to_pb(order), timeout=timeout)
        except RPC_ERRORS as exc:
            raise from_rpc_error(exc) from None
        return TokenStream(call, order.request_id, len(order.prompt_token_ids), on_report)

    def generate(self, request_id: str, prompt_token_ids: Sequence[int], sampling: SamplingParams,
                 timeout: float | None) -> TokenStream:
        """``ColocatedWorker.Generate``: the worker computes the prompt and streams every token."""
        msg = worker_pb2.WorkerGenerateRequest(request_id=request_id, prompt_token_ids=prompt_token_ids,
                                               sampling=sampling_to_pb(sampling))
        try:
            call = self._colocated.Generate(msg, timeout=timeout)
        except RPC_ERRORS as exc:
            raise from_rpc_error(exc) from None
        return TokenStream(call, request_id, len(prompt_token_ids))

    async def info(self, timeout: float = 2.0) -> tuple[WorkerRecord, WorkerLoad]:
        """The worker's record and load (``GetInfo``, ``GetLoad`` over gRPC); raises ``grpc.RpcError``."""
        info = await self._info.GetInfo(worker_pb2.GetInfoRequest(), timeout=timeout)
        load = await self._info.GetLoad(worker_pb2.GetLoadRequest(), timeout=timeout)
        return record_from_pb(info), load_from_pb(load)

    async def close(self) -> None:
        await self.channel.close()
        if self.lane is not None:
            await self.lane.close()
