"""The router's calls to one worker, in dataclasses: the protobuf side of the router's request flow.

``WorkerClient`` wraps one worker's gRPC channel and, where the worker serves one, its worker lane
(``pdrouter.wire.lane``): request RPCs go over the lane when there is one, ``GetInfo`` / ``GetLoad``
over gRPC. What the router hands it and gets back are plain values:

* ``serve(ServeOrder)``: ``DecodeWorker.Serve``, the decode worker driving one disaggregated request
  (it calls the ranked ``PrefillRoute`` s itself); the stream's ``PrefillReport`` goes to a callback
  once, when the first chunk brings it (the values are the contract's, ``pdrouter.core.disaggregation``);
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
from typing import Any

from pdrouter.core.disaggregation import PrefillFailure, PrefillReport, PrefillRoute, ServeOrder
from pdrouter.core.errors import UnavailableError
from pdrouter.core.sampling import SamplingParams
from pdrouter.core.tokens import FinishReason, TokenDelta, TokenSink, Usage, pack_token_ids
from pdrouter.core.workers import WorkerLoad, WorkerRecord
from pdrouter.wire.convert import load_from_pb, prompt_from_pb, record_from_pb, sampling_from_pb, sampling_to_pb
from pdrouter.wire.grpc_util import CHANNEL_OPTIONS, RPC_ERRORS, from_rpc_error
from pdrouter.wire.lane import LaneChannel, StreamCall, request_stubs
from pdrouter.wire.security import OPEN, PeerSecurity
from pdrouter.wire.v1 import common_pb2, worker_pb2, worker_pb2_grpc

_FINISH = {common_pb2.FINISH_REASON_STOP: FinishReason.STOP,
           common_pb2.FINISH_REASON_LENGTH: FinishReason.LENGTH,
           common_pb2.FINISH_REASON_ABORT: FinishReason.ABORT}


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
        request_id=order.request_id,
        prompt_token_bytes=order.prompt_token_bytes or pack_token_ids(order.prompt_token_ids),
        sampling=sampling_to_pb(order.sampling), model_compat_hash=order.model_compat_hash,
        backend=order.backend, local_prefill_tokens=order.local_prefill_tokens,
        prefill=[worker_pb2.PrefillRoute(worker_id=r.worker_id, address=r.address, lane_address=r.lane_address,
                                         cached_tokens=r.cached_tokens) for r in order.routes],
        whole=order.whole, cache_salt=order.cache_salt, priority=order.priority)


def serve_order_from_pb(msg: worker_pb2.ServeRequest) -> ServeOrder:
    """The decode worker's side of ``serve_order_to_pb``; InvalidRequestError names a bad sampling field."""
    return ServeOrder(
        request_id=msg.request_id, prompt_token_ids=prompt_from_pb(msg), sampling=sampling_from_pb(msg.sampling),
        model_compat_hash=msg.model_compat_hash, backend=msg.backend, local_prefill_tokens=msg.local_prefill_tokens,
        routes=tuple([PrefillRoute(r.worker_id, r.address, r.lane_address, r.cached_tokens) for r in msg.prefill]),
        whole=msg.whole, cache_salt=msg.cache_salt, priority=msg.priority)


def _at_once(step: Any) -> Any:
    """Run ``step`` (a stream's ``__anext__()`` coroutine whose message is already there, see
    ``StreamCall.has_waiting``) to its end: the message; the end of the stream
    (``StopAsyncIteration``) and the call's errors raise."""
    try:
        step.send(None)
    except StopIteration as done:
        return done.value
    step.close()
    raise RuntimeError("a lane stream's waiting message was not there")


class TokenStream:
    """A worker's ``TokenChunk`` stream as ``TokenDelta`` s (see the module docstring); iterate once.

    Chunks that have already arrived when one is read are merged into one delta (a lane call's
    messages come in batches, and when the router falls behind a stream several of its chunks are
    waiting): the tokens are the same and in order, in fewer, longer deltas, so what a delta costs
    downstream (text, a response chunk, a write) is paid once per batch instead of once per token.
    Nothing waits to be merged: a delta is handed on as soon as no further chunk is already there.
    A failure after merged chunks comes after their delta, as it would after the chunks one by one.
    gRPC calls are read one chunk at a time (a ``grpc.aio`` read always waits for the channel).

    ``sink`` (a lane call only): chunks of plain tokens that arrive while this stream's consumer waits
    go to the sink's ``deliver``, when it is set, instead of through the stream (``TokenSink``); the
    last delta's usage counts them.
    """

    __slots__ = ("_call", "_on_report", "_produced", "_prompt_tokens", "_request_id", "_sink")

    def __init__(self, call: Any, request_id: str, prompt_tokens: int,
                 on_report: Callable[[PrefillReport], None] | None = None, sink: TokenSink | None = None) -> None:
        self._call = call
        self._request_id = request_id
        self._prompt_tokens = prompt_tokens
        self._on_report = on_report
        self._produced = 0
        self._sink = sink if isinstance(call, StreamCall) else None
        if self._sink is not None:
            call.set_sink(self._offered, self._flushed)

    def _offered(self, body: bytes) -> bool:
        """A message the lane offers while the consumer waits: a chunk of plain tokens goes to the sink's
        ``deliver`` (True when it took it); anything else (a finish, a report, no tokens), or a sink not
        set (yet), goes by the stream."""
        sink = self._sink
        assert sink is not None
        deliver = sink.deliver
        if deliver is None:
            return False
        try:
            chunk = common_pb2.TokenChunk.FromString(body)
            if chunk.finish_reason or chunk.HasField("prefill") or not chunk.token_ids:
                return False
            ids = tuple(chunk.token_ids)
            if not deliver(ids):
                return False
        except Exception as exc:  # (the stream gives its consumer the error; the connection serves on)
            sink.deliver, sink.error = None, exc
            return False
        self._produced += len(ids)
        return True

    def _flushed(self) -> None:
        """After the chunks of one read that the sink took: its ``flush`` (what it raises, the stream raises)."""
        sink = self._sink
        if sink is not None and sink.flush is not None:
            try:
                sink.flush()
            except Exception as exc:
                sink.deliver, sink.error = None, exc

    def cancel(self) -> None:
        """Cancel the call (no-op once it has ended); the worker frees the request's blocks."""
        self._call.cancel()

    async def __aiter__(self) -> AsyncIterator[TokenDelta]:
        on_report = self._on_report
        stream = self._call.__aiter__()
        # Over a lane, the chunks that have arrived are taken without waiting (``has_waiting``: asked, not
        # tried, so that a stream read a chunk at a time pays nothing for the merge).
        waiting = stream.has_waiting if isinstance(stream, StreamCall) else None
        sink = self._sink
        try:
            while True:
                try:
                    chunk = await stream.__anext__()
                except StopAsyncIteration:
                    break
                if sink is not None and sink.error is not None:
                    raise sink.error
                ids: Any = chunk.token_ids
                reason = _FINISH.get(chunk.finish_reason)
                if on_report is not None and chunk.HasField("prefill"):
                    on_report(report_from_pb(chunk.prefill))
                    on_report = None
                ended = False
                failure: Exception | None = None
                while reason is None and waiting is not None and waiting():  # the chunks here already
                    try:
                        got = _at_once(stream.__anext__())
                    except StopAsyncIteration:
                        ended = True
                        break
                    except Exception as exc:  # raised after the delta of the chunks before it
                        failure = exc
                        break
                    if on_report is not None and got.HasField("prefill"):
                        on_report(report_from_pb(got.prefill))
                        on_report = None
                    if got.token_ids:
                        if type(ids) is not list:
                            ids = list(ids)
                        ids.extend(got.token_ids)
                    reason = _FINISH.get(got.finish_reason)
                    chunk = got
                self._produced += len(ids)
                if reason is not None:
                    yield TokenDelta(tuple(ids), reason,
                                     Usage(self._prompt_tokens, self._produced, chunk.usage.cached_tokens))
                    return
                if ids:
                    yield TokenDelta(tuple(ids))
                if failure is not None:
                    raise failure
                if ended:
                    break
        except RPC_ERRORS as exc:
            raise from_rpc_error(exc) from None
        raise UnavailableError(f"request {self._request_id}: the worker ended the stream without finishing")


class WorkerClient:
    """Calls to one worker incarnation over its lane (request RPCs, when given) and gRPC."""

    def __init__(self, address: str, lane_address: str = "", security: PeerSecurity = OPEN) -> None:
        """``lane_address``: the worker's lane, used for request RPCs ("" : gRPC only); ``security``:
        the credentials every call presents (internal secret, TLS)."""
        self.channel = security.channel(address, CHANNEL_OPTIONS)
        self.lane = LaneChannel(lane_address, token=security.lane_token,
                                ssl=security.client_ssl()) if lane_address else None
        self._info = worker_pb2_grpc.WorkerInfoServiceStub(self.channel)
        _, self._decode, self._colocated = request_stubs(self.channel, self.lane)

    def serve(self, order: ServeOrder, timeout: float | None,
              on_report: Callable[[PrefillReport], None] | None = None,
              metadata: Sequence[tuple[str, str]] | None = None, sink: TokenSink | None = None) -> TokenStream:
        """``DecodeWorker.Serve``; ``on_report`` gets the stream's ``PrefillReport`` once; ``metadata``:
        the call's (its trace context: gRPC metadata, or the lane's ``META`` frame); ``sink``: the
        stream's (``TokenStream``)."""
        try:
            call = self._decode.Serve(serve_order_to_pb(order), timeout=timeout, metadata=metadata)
        except RPC_ERRORS as exc:
            raise from_rpc_error(exc) from None
        return TokenStream(call, order.request_id, len(order.prompt_token_ids), on_report, sink)

    def generate(self, request_id: str, prompt_token_ids: Sequence[int], sampling: SamplingParams,
                 timeout: float | None, whole: bool = False, cache_salt: bytes = b"",
                 metadata: Sequence[tuple[str, str]] | None = None, priority: int = 0,
                 prompt_token_bytes: bytes = b"", sink: TokenSink | None = None) -> TokenStream:
        """``ColocatedWorker.Generate``: the worker computes the prompt and streams every token
        (``whole``: every token in one chunk at the end; ``prompt_token_bytes``: the prompt already
        packed, if the caller has it; ``sink``: the stream's, ``TokenStream``)."""
        packed = prompt_token_bytes or pack_token_ids(prompt_token_ids)
        msg = worker_pb2.WorkerGenerateRequest(request_id=request_id, prompt_token_bytes=packed,
                                               sampling=sampling_to_pb(sampling), whole=whole,
                                               cache_salt=cache_salt, priority=priority)
        try:
            call = self._colocated.Generate(msg, timeout=timeout, metadata=metadata)
        except RPC_ERRORS as exc:
            raise from_rpc_error(exc) from None
        return TokenStream(call, request_id, len(prompt_token_ids), sink=sink)

    async def info(self, timeout: float = 2.0) -> tuple[WorkerRecord, WorkerLoad]:
        """The worker's record and load (``GetInfo``, ``GetLoad`` over gRPC); raises ``grpc.RpcError``."""
        info = await self._info.GetInfo(worker_pb2.GetInfoRequest(), timeout=timeout)
        load = await self._info.GetLoad(worker_pb2.GetLoadRequest(), timeout=timeout)
        return record_from_pb(info), load_from_pb(load)

    async def close(self) -> None:
        await self.channel.close()
        if self.lane is not None:
            await self.lane.close()
