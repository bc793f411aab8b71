"""``PrefillWorker.Prefill``: compute a prompt, push its KV into a decode worker's blocks.

The transfer is opened first, on the live connection to the decode worker's receiver, and announced
if the prompt takes a while (``ANNOUNCE_AFTER_S``); the engine runs the prompt (reusing this worker's
prefix cache) and holds its blocks; the KV sender streams every layer of the blocks after
``target.skip_blocks`` into the decode worker's blocks; once the receiver confirmed them, the
blocks are released (they stay in the prefix cache) and the first token goes back. A failure or a
cancelled call aborts the transfer and frees the blocks; the decode side learns of it from the
transfer itself.

The target comes from the caller, so it is checked first (``decode_targets``): it must name a
decode worker registered in the pool at the address the KV would go to (or, without a registry,
one of ``--decode-kv-addresses``). A refused target costs no computation and opens no connection.

A worker running vLLM moves the KV inside vLLM, through its KV connector: ``ConnectorPrefillServicer``
makes the same checks, then hands the request to ``pdrouter.worker.roles.prefill_connector``.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence

import grpc

from pdrouter.core.capacity import blocks_for_tokens
from pdrouter.core.errors import InvalidRequestError, PdRouterError
from pdrouter.core.ids import RequestId
from pdrouter.core.kv_layout import KvLayout
from pdrouter.core.sampling import SamplingParams
from pdrouter.core.tracing import Tracing
from pdrouter.engine.outputs import PrefillResult
from pdrouter.transfer.outgoing import OutgoingTransfer
from pdrouter.transfer.sender import KvSender
from pdrouter.transfer.target import TransferTarget
from pdrouter.wire.convert import prompt_from_pb, sampling_from_pb
from pdrouter.wire.grpc_util import grpc_errors
from pdrouter.wire.kv_convert import target_from_pb
from pdrouter.wire.trace_context import past_span, traced
from pdrouter.wire.v1 import worker_pb2, worker_pb2_grpc
from pdrouter.worker.backend import TransferPacing
from pdrouter.worker.engine_contract import DisaggregatedEngine
from pdrouter.worker.request_checks import check_request
from pdrouter.worker.role import RoleContext, Service
from pdrouter.worker.roles.decode_targets import DecodeTargets, RegisteredDecodeWorkers, StaticDecodeTargets
from pdrouter.worker.roles.prefill_connector import ConnectorPrefill, connector_engine
from pdrouter.worker.transfer_tally import TransferTally

log = logging.getLogger(__name__)

ANNOUNCE_AFTER_S = 0.001
"""A transfer opened before its prompt computes is announced (its BEGIN sent alone) once the prompt has
computed this long: the receiver then checks and binds it during the computation, off the path from the KV
being ready to its confirmation (docs/benchmarks.md, "Announcing a transfer while its prompt computes").
A prompt done sooner sends the BEGIN with its first frame: one write and one receiver wake-up fewer."""


class PrefillServicer(worker_pb2_grpc.PrefillWorkerServicer):
    def __init__(self, driver: DisaggregatedEngine, sender: KvSender, layout: KvLayout, model_compat_hash: str,
                 targets: DecodeTargets, transfer_timeout_s: float = 60.0,
                 pacing: TransferPacing | None = None, tracing: Tracing | None = None,
                 tally: TransferTally | None = None) -> None:
        """``layout``: the engine's (real geometry, for the stats); ``targets``: the check every KV
        target passes first; ``pacing``: a simulated worker's link; ``tracing``: the process's tracer
        (the call's span, with the computation and the transfer as spans of their own)."""
        self.tracing = tracing
        self.targets = targets
        self.pacing = pacing
        self.tally = tally if tally is not None else TransferTally()
        self.driver = driver
        self.sender = sender
        self.layout = layout
        self.model_compat_hash = model_compat_hash
        self.transfer_timeout_s = transfer_timeout_s
        self._ending: set[asyncio.Future[None]] = set()  # request ends that outlived a cancelled call

    @traced("pdrouter.v1.PrefillWorker/Prefill")
    @grpc_errors
    async def Prefill(self, request: worker_pb2.PrefillRequest,
                      context: grpc.aio.ServicerContext) -> worker_pb2.PrefillResponse:
        rid, target, sampling, prompt = await checked_request(request, self.model_compat_hash, self.targets,
                                                              self.layout.block_size)
        start = time.perf_counter()
        # Connected already (the usual case): the transfer is opened now, with no thread hop, and
        # announced if the prompt computes for longer than ANNOUNCE_AFTER_S; else it is opened (and
        # the connection dialled, in a thread) once the prompt is computed.
        outgoing = self._open_early(target)
        result = await self._compute(RequestId(rid), prompt, sampling, request, outgoing)
        computed = time.perf_counter()
        done = False
        try:
            if outgoing is None:
                outgoing = await asyncio.to_thread(self.sender.open_transfer, target)
            await self._send(outgoing, result.block_ids, len(target.dst_block_ids) - target.skip_blocks)
            await outgoing.finish_async(timeout=self.transfer_timeout_s)
            done = True
        except PdRouterError:
            self.tally.failed()
            raise
        finally:
            if done or outgoing is None:  # nothing reads the blocks any more: give them back now
                self._give_back(RequestId(rid), done)
            else:
                await self._stop_then_give_back(RequestId(rid), outgoing)
        finished = time.perf_counter()
        sent = len(target.dst_block_ids) - target.skip_blocks
        self.tally.sent(sent * self.layout.block_bytes, finished - computed)
        stats = worker_pb2.PrefillStats(
            prompt_tokens=len(prompt), cached_tokens=result.num_cached_blocks * self.layout.block_size,
            compute_ms=self._ms(computed - start), transfer_ms=self._ms(finished - computed),
            bytes_sent=sent * self.layout.block_bytes, blocks_sent=sent)
        if self.tracing is not None:
            past_span(self.tracing, "prefill", start, computed,
                      {"pdrouter.prompt_tokens": len(prompt), "pdrouter.cached_tokens": stats.cached_tokens})
            past_span(self.tracing, "kv_transfer", computed, finished,
                      {"pdrouter.kv.bytes": stats.bytes_sent, "pdrouter.kv.blocks": sent,
                       "pdrouter.kv.transfer_ms": stats.transfer_ms, "pdrouter.kv.backend": target.backend,
                       "server.address": target.peer})
        return worker_pb2.PrefillResponse(request_id=rid, first_token_id=result.first_token, stats=stats)

    def _open_early(self, target: TransferTarget) -> OutgoingTransfer | None:
        """The transfer, opened on a live connection before the prompt computes, or None."""
        try:
            return self.sender.open_transfer_if_connected(target)
        except PdRouterError:
            self.tally.failed()
            raise

    async def _compute(self, rid: RequestId, prompt: Sequence[int], sampling: SamplingParams,
                       request: worker_pb2.PrefillRequest, outgoing: OutgoingTransfer | None) -> PrefillResult:
        """The prompt, computed; ``outgoing`` is announced if that takes over ``ANNOUNCE_AFTER_S``,
        and abandoned (the receiver told) if it fails. A simulated worker's transfer time is modeled
        (``pacing``): it does not announce, which would only cost a write and a wake-up on each side."""
        timer = None if outgoing is None or self.pacing is not None else \
            asyncio.get_running_loop().call_later(ANNOUNCE_AFTER_S, outgoing.announce)
        try:
            return await self.driver.prefill(rid, prompt, sampling, cache_salt=request.cache_salt,
                                             priority=request.priority)
        except BaseException:
            if outgoing is not None:
                outgoing.abort("the prompt was not computed")  # no layer was queued: nothing reads the blocks
            raise
        finally:
            if timer is not None:
                timer.cancel()

    def _ms(self, wall_s: float) -> float:
        """Milliseconds as reported: a simulated worker reports simulated time (wall ÷ its time scale)."""
        scale = self.pacing.time_scale if self.pacing is not None else 1.0
        return wall_s * 1e3 / (scale if scale > 0 else 1.0)

    def _give_back(self, rid: RequestId, done: bool) -> None:
        """The request's blocks back to the engine: released when its KV was sent, aborted if not."""
        if done:
            self.driver.release(rid)
        else:
            self.driver.abort(rid)

    async def _stop_then_give_back(self, rid: RequestId, outgoing: OutgoingTransfer) -> None:
        """Stop a transfer that did not finish (it reads the blocks until then), then abort the request.

        Shielded: a call cancelled while its transfer stops must still free the engine's blocks
        (once the transfer no longer reads them), or they stay held for good.
        """
        ending = asyncio.ensure_future(self._end(rid, outgoing))
        try:
            await asyncio.shield(ending)
        except asyncio.CancelledError:
            self._ending.add(ending)
            ending.add_done_callback(self._ending.discard)
            raise

    async def _end(self, rid: RequestId, outgoing: OutgoingTransfer) -> None:
        try:
            await asyncio.to_thread(outgoing.abort, "the prefill request ended early")
        finally:
            self._give_back(rid, False)

    async def _send(self, outgoing: OutgoingTransfer, block_ids: Sequence[int], blocks_sent: int) -> None:
        """Queue every layer; a simulated worker holds the last one back until the real bytes' modeled time."""
        if self.pacing is None:
            outgoing.send_layers(block_ids)
            return
        layers = self.layout.num_layers
        deadline = self.pacing.deadline(blocks_sent)
        if deadline <= time.monotonic():  # no modeled time left to wait (time scale 0): one frame
            outgoing.send_layers(block_ids)
            return
        if layers > 1:
            outgoing.send_layers(block_ids, range(0, layers - 1))
        delay = deadline - time.monotonic()
        if delay > 0:
            await asyncio.sleep(delay)
        outgoing.send_layers(block_ids, layers - 1)


async def checked_request(request: worker_pb2.PrefillRequest, model_compat_hash: str, targets: DecodeTargets,
                          block_size: int) -> tuple[str, TransferTarget, SamplingParams, Sequence[int]]:
    """The request's id, KV target, sampling and prompt, once they passed every check (the target
    first: it must name a registered decode worker's receiver, and the prompt's blocks)."""
    rid = request.request_id
    check_request(rid, request.model_compat_hash, model_compat_hash)
    if not request.HasField("target"):
        raise InvalidRequestError("target is required (the reply of DecodeWorker.Allocate)")
    target = target_from_pb(request.target)
    refusal = await targets.refusal(request.target.worker_id, target)
    if refusal is not None:
        log.warning("Prefill %s: KV target refused: %s", rid, refusal.message)
        raise refusal
    sampling = sampling_from_pb(request.sampling)
    prompt = prompt_from_pb(request)
    blocks_needed = blocks_for_tokens(len(prompt), block_size)
    if len(target.dst_block_ids) != blocks_needed:
        raise InvalidRequestError(f"target names {len(target.dst_block_ids)} blocks; the prompt fills "
                                  f"{blocks_needed}")
    return rid, target, sampling, prompt


class ConnectorPrefillServicer(worker_pb2_grpc.PrefillWorkerServicer):
    """``Prefill`` on a vLLM prefill worker: vLLM computes the prompt and its KV connector pushes the
    blocks (``pdrouter.worker.roles.prefill_connector``); the same checks first."""

    def __init__(self, prefill: ConnectorPrefill, block_size: int, model_compat_hash: str,
                 targets: DecodeTargets, tracing: Tracing | None = None) -> None:
        """``tracing``: the process's tracer (``Prefill`` continues its caller's trace)."""
        self.tracing = tracing
        self.prefill = prefill
        self.block_size = block_size
        self.model_compat_hash = model_compat_hash
        self.targets = targets

    @traced("pdrouter.v1.PrefillWorker/Prefill")
    @grpc_errors
    async def Prefill(self, request: worker_pb2.PrefillRequest,
                      context: grpc.aio.ServicerContext) -> worker_pb2.PrefillResponse:
        rid, target, _, prompt = await checked_request(request, self.model_compat_hash, self.targets,
                                                       self.block_size)
        done = await self.prefill.run(rid, prompt, target, cache_salt=request.cache_salt, priority=request.priority)
        stats = worker_pb2.PrefillStats(
            prompt_tokens=len(prompt), cached_tokens=done.cached_tokens, compute_ms=done.compute_s * 1e3,
            transfer_ms=done.transfer_s * 1e3, bytes_sent=done.bytes_sent,
            blocks_sent=len(target.dst_block_ids) - target.skip_blocks)
        return worker_pb2.PrefillResponse(request_id=rid, first_token_id=done.first_token, stats=stats)


class PrefillRole:
    """A prefill worker: the ``PrefillWorker`` service over a KV sender (None: vLLM's connector sends)."""

    kv_address = ""

    def __init__(self, sender: KvSender | None, servicer: PrefillServicer | ConnectorPrefillServicer) -> None:
        self.sender = sender
        self.servicer = servicer

    def services(self) -> list[Service]:
        return [Service(worker_pb2_grpc.add_PrefillWorkerServicer_to_server, self.servicer,
                        "pdrouter.v1.PrefillWorker")]

    async def close(self) -> None:
        if self.sender is not None:
            await asyncio.to_thread(self.sender.close)


async def build_prefill_role(ctx: RoleContext) -> PrefillRole:
    targets: DecodeTargets
    if ctx.registry is not None:
        targets = RegisteredDecodeWorkers(ctx.registry)
    else:
        targets = StaticDecodeTargets(ctx.config.decode_kv_addresses)
        if not ctx.config.decode_kv_addresses:
            log.warning("no registry (--redis) and no --decode-kv-addresses: Prefill refuses every KV target")
    if ctx.connector is not None:  # vLLM: its KV connector pushes the blocks
        prefill = ConnectorPrefill(connector_engine(ctx.engine), ctx.connector, hold_s=ctx.config.kv_wait_s,
                                   tally=ctx.transfers)
        return PrefillRole(None, ConnectorPrefillServicer(prefill, ctx.engine.kv_layout.block_size,
                                                          ctx.model_compat_hash, targets, tracing=ctx.tracing))
    pool = ctx.kv_pool()
    sender = KvSender(pool, pool.layout, ctx.transfer())
    servicer = PrefillServicer(ctx.disaggregated(), sender, ctx.engine.kv_layout, ctx.model_compat_hash, targets,
                               transfer_timeout_s=ctx.config.kv_wait_s, pacing=ctx.pacing, tracing=ctx.tracing,
                               tally=ctx.transfers)
    return PrefillRole(sender, servicer)
