"""``DecodeWorker``: reserve blocks for a request, receive its KV, decode it in the continuous batch.

Per request: ``Allocate`` reserves the prompt's blocks in the engine (reusing this worker's own
prefix cache) and invites the KV into them (``KvReceiver.expect``); the reply's target goes to a
prefill worker. The allocation is a lease: if no ``Generate`` follows within ``lease_ms`` it is
freed. A caller may ask for its own lease, up to ``max_lease_ms`` (``--max-lease-ms``); a longer
one is refused (INVALID_ARGUMENT), so no caller can pin blocks for longer than that. ``Generate``
waits for the KV to land, checks it (a value that is not finite: UNAVAILABLE, the blocks cleared
and freed), then decodes from the prefill worker's first token.
``Release``, a cancelled call, a failed transfer or an expired lease free everything: the
expectation is aborted first (so nothing writes into the blocks any more), then the blocks.

``Serve`` is the same request driven from here in one call (the router's path): reserve, then
compute the prompt here when little of it is uncached, else call the prefill workers the router
ranked (the next one on a retryable failure) into the reserved blocks, then decode. The router
makes one call per request instead of three, and the first token reaches it one hop after the
prefill worker produced it. Its logic is ``pdrouter.worker.roles.decode_serve`` (dataclasses
only); the servicer here turns the ``ServeRequest`` into a ``ServeOrder`` and the logic's events
into ``TokenChunk`` s.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass, field

import grpc

from pdrouter.core.disaggregation import ServeOrder
from pdrouter.core.errors import FailedPreconditionError, IncompatibleError, InvalidRequestError, NotFoundError
from pdrouter.core.ids import RequestId
from pdrouter.core.sampling import SamplingParams
from pdrouter.core.tracing import Tracing
from pdrouter.engine.outputs import KvReservation
from pdrouter.transfer.incoming import IncomingTransfer
from pdrouter.transfer.receiver import KvReceiver
from pdrouter.wire.convert import sampling_from_pb
from pdrouter.wire.grpc_util import grpc_errors
from pdrouter.wire.kv_convert import target_to_pb
from pdrouter.wire.prefill_links import PrefillLinks
from pdrouter.wire.trace_context import traced
from pdrouter.wire.v1 import common_pb2, worker_pb2, worker_pb2_grpc
from pdrouter.wire.worker_client import report_to_pb, serve_order_from_pb
from pdrouter.worker.engine_contract import DisaggregatedEngine
from pdrouter.worker.request_checks import check_request
from pdrouter.worker.role import RoleContext, Service
from pdrouter.worker.roles.decode_connector import ConnectorDecodeServe
from pdrouter.worker.roles.decode_serve import DecodeServe, ReportChunk, ServeEvent
from pdrouter.worker.roles.prefill_connector import connector_engine
from pdrouter.worker.roles.prefill_routes import RegisteredPrefillWorkers
from pdrouter.worker.token_chunks import chunk_sink, token_chunks
from pdrouter.worker.transfer_tally import TransferTally

log = logging.getLogger(__name__)


@dataclass
class _Allocation:
    reservation: KvReservation
    incoming: IncomingTransfer
    response: worker_pb2.AllocateResponse
    lease: asyncio.TimerHandle | None = None
    decoding: bool = field(default=False)


class DecodeServicer(worker_pb2_grpc.DecodeWorkerServicer):
    def __init__(self, driver: DisaggregatedEngine, receiver: KvReceiver, worker_id: str, model_compat_hash: str,
                 backend: str, lease_ms: int, kv_wait_s: float, links: PrefillLinks | None = None,
                 prefill_timeout_s: float = 600.0, registered: RegisteredPrefillWorkers | None = None,
                 max_lease_ms: int = 120_000, tracing: Tracing | None = None,
                 tally: TransferTally | None = None) -> None:
        """``registered``: the check every prefill route passes before it is called (None: none);
        ``max_lease_ms``: the longest lease an ``Allocate`` may ask for; ``tracing``: the process's
        tracer (each call continues its caller's trace; ``Serve``'s decode is a span of its own)."""
        self.tracing = tracing
        self.driver = driver
        self.links = links if links is not None else PrefillLinks()  # an empty one is falsy
        self.serving = DecodeServe(driver, receiver, self.links, worker_id, kv_wait_s,
                                   prefill_timeout_s=prefill_timeout_s, registered=registered, tally=tally)
        """``Serve``'s logic (``prefill_timeout_s``: the limit of one prefill call without a deadline)."""
        self.receiver = receiver
        self.worker_id = worker_id
        self.model_compat_hash = model_compat_hash
        self.backend = backend
        self.lease_ms = lease_ms
        self.max_lease_ms = max_lease_ms
        self.kv_wait_s = kv_wait_s
        self._allocs: dict[str, _Allocation] = {}

    @property
    def allocations(self) -> int:
        return len(self._allocs)

    # -- lifecycle helpers ------------------------------------------------------------------
    def _drop(self, request_id: str, reason: str) -> tuple[bool, int]:
        """Abort the expectation, then free the blocks; (anything held?, blocks of the allocation)."""
        alloc = self._allocs.pop(request_id, None)
        if alloc is None:
            return self.driver.abort(RequestId(request_id)), 0
        if alloc.lease is not None:
            alloc.lease.cancel()
        alloc.incoming.abort(reason)
        self.driver.abort(RequestId(request_id))
        return True, len(alloc.reservation.block_ids)

    def _expire(self, request_id: str) -> None:
        alloc = self._allocs.get(request_id)
        if alloc is not None and not alloc.decoding:
            log.warning("allocation %s: lease expired with no Generate; freeing its blocks", request_id)
            self._drop(request_id, "the allocation's lease expired")

    def _arm_lease(self, request_id: str, alloc: _Allocation, lease_ms: int) -> None:
        if alloc.lease is not None:
            alloc.lease.cancel()
        alloc.lease = asyncio.get_running_loop().call_later(lease_ms / 1000, self._expire, request_id)

    def _check_backend(self, backend: str) -> None:
        check_backend(backend, self.backend)

    # -- RPCs -------------------------------------------------------------------------------
    @traced("pdrouter.v1.DecodeWorker/Allocate")
    @grpc_errors
    async def Allocate(self, request: worker_pb2.AllocateRequest,
                       context: grpc.aio.ServicerContext) -> worker_pb2.AllocateResponse:
        rid = request.request_id
        check_request(rid, request.model_compat_hash, self.model_compat_hash)
        self._check_backend(request.backend)
        lease_ms = request.lease_ms or self.lease_ms
        if lease_ms > self.max_lease_ms:
            raise InvalidRequestError(f"lease_ms {lease_ms} is over this worker's cap of {self.max_lease_ms} ms "
                                      f"(--max-lease-ms); ask for {self.max_lease_ms} or less")
        existing = self._allocs.get(rid)
        if existing is not None:
            self._arm_lease(rid, existing, lease_ms)
            return existing.response
        if request.HasField("sampling"):
            sampling = sampling_from_pb(request.sampling)
            if request.max_tokens and request.max_tokens != sampling.max_tokens:
                raise InvalidRequestError("max_tokens and sampling.max_tokens disagree")
        else:
            sampling = SamplingParams(max_tokens=int(request.max_tokens))
        reservation = self.driver.reserve_remote(RequestId(rid), list(request.prompt_token_ids), sampling,
                                                 cache_salt=request.cache_salt)
        try:
            incoming = self.receiver.expect(rid, reservation.block_ids, skip_blocks=reservation.num_cached_blocks,
                                            timeout_s=self.kv_wait_s + lease_ms / 1000)
        except BaseException:
            self.driver.abort(RequestId(rid))
            raise
        response = worker_pb2.AllocateResponse(target=target_to_pb(incoming.target, self.worker_id),
                                               cached_blocks=reservation.num_cached_blocks,
                                               num_blocks=len(reservation.block_ids))
        alloc = _Allocation(reservation, incoming, response)
        self._allocs[rid] = alloc
        self._arm_lease(rid, alloc, lease_ms)
        return response

    @traced("pdrouter.v1.DecodeWorker/Generate")
    @grpc_errors
    async def Generate(self, request: worker_pb2.DecodeRequest,
                       context: grpc.aio.ServicerContext) -> AsyncIterator[common_pb2.TokenChunk]:
        rid = request.request_id
        if not rid:
            raise InvalidRequestError("request_id is required")
        if request.local_prefill:
            # Conditional disaggregation: compute the prompt here; an allocation, if any, is dropped
            # (its cached prefix blocks stay in this worker's prefix cache and are reused at once).
            if rid in self._allocs:
                self._drop(rid, "prefilled locally instead")
            sampling = sampling_from_pb(request.sampling)
            async with aclosing(self.driver.generate(RequestId(rid), list(request.prompt_token_ids),
                                                     sampling, cache_salt=request.cache_salt)) as outputs:
                async for chunk in token_chunks(rid, outputs):
                    yield chunk
            return
        alloc = self._allocs.get(rid)
        if alloc is None:
            raise NotFoundError(f"no allocation for request {rid!r} (Allocate first; it may have expired)")
        if alloc.decoding:
            raise InvalidRequestError(f"request {rid!r} is already decoding")
        if not request.HasField("first_token_id"):
            raise InvalidRequestError("first_token_id is required unless local_prefill is set")
        alloc.decoding = True
        if alloc.lease is not None:
            alloc.lease.cancel()
        finished = False
        try:
            await alloc.incoming.wait_all_async(timeout=self.kv_wait_s)
            await self.driver.check_received_kv(RequestId(rid), alloc.incoming.bytes_landed)
            async with aclosing(self.driver.decode_remote(RequestId(rid), request.first_token_id)) as outputs:
                async for chunk in token_chunks(rid, outputs, cached_tokens=alloc.reservation.num_cached_tokens):
                    yield chunk
            finished = True
        finally:
            if self._allocs.get(rid) is alloc:
                del self._allocs[rid]
                if not finished:
                    alloc.incoming.abort("decode ended early")
                    self.driver.abort(RequestId(rid))

    @traced("pdrouter.v1.DecodeWorker/Serve")
    @grpc_errors
    async def Serve(self, request: worker_pb2.ServeRequest,
                    context: grpc.aio.ServicerContext) -> AsyncIterator[common_pb2.TokenChunk]:
        order = checked_order(request, self.model_compat_hash, self.backend)
        self.serving.check_new(order.request_id, self._allocs)
        # Over the lane, a streamed token's chunk leaves as the engine delivers it (``chunk_sink``).
        sink = None if order.whole else chunk_sink(order.request_id, context)
        async with aclosing(self.serving.serve(order, context.time_remaining, sink)) as events:
            async for chunk in serve_chunks(order.request_id, events, self.tracing):
                yield chunk

    @grpc_errors
    async def Release(self, request: worker_pb2.ReleaseRequest,
                      context: grpc.aio.ServicerContext) -> worker_pb2.ReleaseResponse:
        if not request.request_id:
            raise InvalidRequestError("request_id is required")
        released, freed = self._drop(request.request_id, request.reason or "released")
        return worker_pb2.ReleaseResponse(released=released, freed_blocks=freed)


def check_backend(asked: str, own: str) -> None:
    """A caller asking for a KV transport names this worker's own ``own`` ("" : whichever it has)."""
    if asked and asked != own:
        raise IncompatibleError(f"this decode worker receives KV over {own!r}, not {asked!r}")


def checked_order(request: worker_pb2.ServeRequest, model_compat_hash: str, backend: str) -> ServeOrder:
    """A ``ServeRequest`` as the ``ServeOrder`` it names, once it passed the checks every decode worker makes."""
    check_request(request.request_id, request.model_compat_hash, model_compat_hash)
    check_backend(request.backend, backend)
    if not request.HasField("sampling"):
        raise InvalidRequestError("sampling is required (max_tokens at least)")
    return serve_order_from_pb(request)


async def serve_chunks(rid: str, events: AsyncIterator[ServeEvent],
                       tracing: Tracing | None = None) -> AsyncIterator[common_pb2.TokenChunk]:
    """``Serve``'s events as ``TokenChunk`` s: a report chunk (with the prefill worker's first token), or
    the engine's outputs, the report (when the event has one) on the first. With ``tracing``, the
    decode (from its first token on) is a span of its own."""
    decoding = None
    try:
        async for event in events:
            if isinstance(event, ReportChunk):
                yield common_pb2.TokenChunk(request_id=rid, prefill=report_to_pb(event.report),
                                            token_ids=() if event.first_token is None else (event.first_token,))
                continue
            if tracing is not None and decoding is None:
                decoding = tracing.span("decode", attributes={"pdrouter.local_prefill": event.report is not None})
            chunks = token_chunks(rid, event.outputs, cached_tokens=event.cached_tokens)
            if event.report is not None:  # the report rides on the first chunk
                first = await anext(chunks, None)
                if first is None:
                    continue
                first.prefill.CopyFrom(report_to_pb(event.report))
                yield first
            async for chunk in chunks:
                yield chunk
    finally:
        if decoding is not None:
            decoding.end()


class ConnectorDecodeServicer(worker_pb2_grpc.DecodeWorkerServicer):
    """``DecodeWorker`` on a vLLM decode worker: ``Serve``, the router's path (vLLM holds the blocks, its
    KV connector receives: ``pdrouter.worker.roles.decode_connector``). The three-call path
    (``Allocate``, ``Generate``, ``Release``) moves KV through pd-router's own engine and is refused."""

    def __init__(self, serving: ConnectorDecodeServe, model_compat_hash: str, backend: str,
                 tracing: Tracing | None = None) -> None:
        """``tracing``: the process's tracer (``Serve`` continues its caller's trace, the decode a span)."""
        self.tracing = tracing
        self.serving = serving
        self.model_compat_hash = model_compat_hash
        self.backend = backend

    @traced("pdrouter.v1.DecodeWorker/Serve")
    @grpc_errors
    async def Serve(self, request: worker_pb2.ServeRequest,
                    context: grpc.aio.ServicerContext) -> AsyncIterator[common_pb2.TokenChunk]:
        order = checked_order(request, self.model_compat_hash, self.backend)
        self.serving.check_new(order.request_id)
        async with aclosing(self.serving.serve(order, context.time_remaining)) as events:
            async for chunk in serve_chunks(order.request_id, events, self.tracing):
                yield chunk

    def _three_calls(self) -> FailedPreconditionError:
        return FailedPreconditionError("a vLLM decode worker serves DecodeWorker.Serve (the router's path); "
                                       "Allocate, Generate and Release need pd-router's own engine")

    @grpc_errors
    async def Allocate(self, request: worker_pb2.AllocateRequest,
                       context: grpc.aio.ServicerContext) -> worker_pb2.AllocateResponse:
        raise self._three_calls()

    @grpc_errors
    async def Generate(self, request: worker_pb2.DecodeRequest,
                       context: grpc.aio.ServicerContext) -> AsyncIterator[common_pb2.TokenChunk]:
        raise self._three_calls()
        yield  # pragma: no cover  (a stream method)

    @grpc_errors
    async def Release(self, request: worker_pb2.ReleaseRequest,
                      context: grpc.aio.ServicerContext) -> worker_pb2.ReleaseResponse:
        raise self._three_calls()


class DecodeRole:
    """A decode worker: the ``DecodeWorker`` service over a KV receiver (None: vLLM's connector receives)."""

    def __init__(self, receiver: KvReceiver | None, servicer: DecodeServicer | ConnectorDecodeServicer,
                 links: PrefillLinks, kv_address: str) -> None:
        self.receiver = receiver
        self.servicer = servicer
        self.links = links
        self.kv_address = kv_address

    def services(self) -> list[Service]:
        return [Service(worker_pb2_grpc.add_DecodeWorkerServicer_to_server, self.servicer, "pdrouter.v1.DecodeWorker")]

    async def close(self) -> None:
        await self.links.close()
        if self.receiver is not None:
            await asyncio.to_thread(self.receiver.close)


async def build_decode_role(ctx: RoleContext) -> DecodeRole:
    cfg = ctx.config
    registered = RegisteredPrefillWorkers(ctx.registry) if ctx.registry is not None else None
    if registered is None:
        log.warning("no registry (--redis): Serve calls whichever prefill addresses its callers name")
    links = PrefillLinks(connect_timeout_s=cfg.kv_wait_s, security=cfg.security, tracing=ctx.tracing)
    if ctx.connector is not None:  # vLLM: its KV connector receives into the blocks vLLM reserves
        assert ctx.connector.pool is not None
        serving = ConnectorDecodeServe(connector_engine(ctx.engine), ctx.connector, links, cfg.worker_id,
                                       cfg.kv_wait_s, registered=registered, tally=ctx.transfers)
        servicer = ConnectorDecodeServicer(serving, ctx.model_compat_hash, cfg.kv_backend, tracing=ctx.tracing)
        return DecodeRole(None, servicer, links, ctx.connector.pool.receivers[0])
    pool = ctx.kv_pool()
    receiver = await asyncio.to_thread(KvReceiver, pool, pool.layout, ctx.transfer(),
                                       host=cfg.host, port=cfg.kv_port, advertise_host=cfg.public_host)
    servicer = DecodeServicer(ctx.disaggregated(), receiver, cfg.worker_id, ctx.model_compat_hash, cfg.kv_backend,
                              cfg.lease_ms, cfg.kv_wait_s, links,
                              registered=registered, max_lease_ms=cfg.max_lease_ms, tracing=ctx.tracing,
                              tally=ctx.transfers)
    return DecodeRole(receiver, servicer, links, receiver.address)
