"""PD orchestration: one request's path through the worker pools.

Disaggregated::

    Allocate(decode) ──▶ Prefill(prefill, target = the decode blocks) ──▶ first token to the client
                     └─▶ Generate(decode, first token) ──▶ the rest of the stream

* Conditional disaggregation: when the prompt's part not already cached on the decode worker is
  at most ``local_prefill_tokens``, the decode worker computes it itself (no KV transfer).
* A prefill that fails before the first token (worker gone, transfer broken) is retried on another
  prefill worker with a fresh allocation, up to ``max_prefill_attempts`` in all.
* Whatever ends the request (finish, error, client gone, deadline) releases the decode allocation;
  cancelling the in-flight call makes the prefill worker drop its share.

Colocated: the request goes to one colocated worker, which streams every token.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Coroutine, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import grpc
from redis.exceptions import RedisError

from pdcommon.errors import DeadlineExceededError, PdRouterError, UnavailableError
from pdcommon.hashing import BlockHasher
from pdcommon.ids import WorkerId
from pdcommon.workers import WorkerRole
from pdrouter.convert import sampling_to_pb
from pdrouter.grpc_util import from_rpc_error
from pdrouter.v1 import common_pb2, worker_pb2
from pdstate.prefix_index import PrefixIndex
from pdstate.reservations import DecodeCapacity, Reservation
from router.admission import Admission
from router.metrics import RouterMetrics
from router.policy import CacheAware, LeastLoaded, PlacementPolicy
from router.request import FinishReason, ModelInfo, RouterRequest, TokenDelta, Usage
from router.worker_pool import WorkerHandle, WorkerPool

log = logging.getLogger(__name__)

_GRPC_ERRORS = (grpc.RpcError, grpc.aio.UsageError)  # UsageError: the channel closed under us

_FINISH = {common_pb2.FINISH_REASON_STOP: FinishReason.STOP,
           common_pb2.FINISH_REASON_LENGTH: FinishReason.LENGTH,
           common_pb2.FINISH_REASON_ABORT: FinishReason.ABORT}


@dataclass(frozen=True)
class OrchestratorConfig:
    mode: Literal["disaggregated", "colocated"] = "disaggregated"
    local_prefill_tokens: int = 32
    """Prompts with at most this many uncached tokens are prefilled on the decode worker."""
    max_prefill_attempts: int = 3
    lease_ms: int = 30_000
    kv_backend: str = ""
    """KV transport to ask decode workers for ("" = each worker's default)."""
    rpc_timeout_s: float = 600.0
    """Per-call limit when the request has no deadline of its own."""


class TransferStats:
    """Counters the orchestrator keeps about KV hand-offs (exported as metrics by the server)."""

    def __init__(self) -> None:
        self.bytes = 0
        self.seconds = 0.0
        self.transfers = 0
        self.local_prefills = 0
        self.prefill_retries = 0
        self.lookups = 0
        self.lookup_seconds = 0.0
        self.index_errors = 0
        self.admission_errors = 0
        self.match_tokens: dict[str, int] = {}
        """Per prefill worker: prompt tokens its cache held when it was chosen (index view)."""
        self.placed_tokens: dict[str, int] = {}
        """Per prefill worker: prompt tokens placed on it."""
        self.prompt_tokens = 0
        self.cached_prompt_tokens = 0


class PdOrchestrator:
    """Implements ``router.request.Orchestrator`` over a ``WorkerPool``."""

    def __init__(self, pool: WorkerPool, model: ModelInfo, config: OrchestratorConfig | None = None,
                 policy: PlacementPolicy | None = None, prefix_index: PrefixIndex | None = None,
                 admission: Admission | None = None, hash_seed: int | str | bytes = 0,
                 metrics: RouterMetrics | None = None) -> None:
        self.pool = pool
        self.model = model
        self.config = config or OrchestratorConfig()
        self.prefix_index = prefix_index
        self.admission = admission
        self.metrics = metrics
        self.policy = policy or (CacheAware() if prefix_index is not None else LeastLoaded())
        self.hasher = BlockHasher(model.block_size, hash_seed)
        self.index_ok = prefix_index is not None
        self.admission_ok = admission is not None
        self.stats = TransferStats()
        self._background: set[asyncio.Task[Any]] = set()

    def models(self) -> list[ModelInfo]:
        return [self.model]

    def generate(self, request: RouterRequest) -> AsyncIterator[TokenDelta]:
        if self.config.mode == "colocated":
            return self._colocated(request)
        return self._disaggregated(request)

    # -- helpers ------------------------------------------------------------------------------
    def _timeout(self, request: RouterRequest) -> float:
        if request.deadline is None:
            return self.config.rpc_timeout_s
        left = request.deadline - time.monotonic()
        if left <= 0:
            raise DeadlineExceededError(f"request {request.request_id} passed its deadline")
        return left

    def _blocks_needed(self, request: RouterRequest) -> int:
        total = len(request.prompt_token_ids) + request.sampling.max_tokens
        return -(-total // self.model.block_size)

    def _release_later(self, handle: WorkerHandle, request_id: str, reason: str) -> None:
        """Release a decode allocation in a task of its own: it survives the caller's cancellation."""
        async def release() -> None:
            try:
                await handle.decode.Release(worker_pb2.ReleaseRequest(request_id=request_id, reason=reason),
                                            timeout=5.0)
            except _GRPC_ERRORS as exc:
                # The worker's lease expiry frees the blocks if it cannot be told now.
                log.warning("release of %s on %s failed: %s", request_id, handle.worker_id, exc)

        self._background_task(release(), f"release-{request_id}-on-{handle.worker_id}")

    def _background_task(self, coro: Coroutine[Any, Any, Any], name: str) -> None:
        """Run ``coro`` to completion even if the request's own task is cancelled."""
        task = asyncio.ensure_future(coro)
        task.set_name(name)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def drain(self, timeout: float = 15.0) -> None:
        """Wait for outstanding releases (shutdown); cancel what is still running after ``timeout``.

        A cancelled release is not lost: the decode worker's lease and the Redis booking's lease
        both expire on their own.
        """
        if not self._background:
            return
        _, pending = await asyncio.wait(set(self._background), timeout=timeout)
        if pending:
            log.warning("shutdown: %d background release(s) still running after %.1fs; cancelled: %s",
                        len(pending), timeout, sorted(t.get_name() for t in pending))
            for task in pending:
                task.cancel()
            await asyncio.wait(pending, timeout=1.0)

    async def _relay(self, call: Any, request: RouterRequest, usage_base: Usage,
                     already: int) -> AsyncIterator[TokenDelta]:
        """Turn a worker's TokenChunk stream into TokenDeltas; the last one carries usage."""
        produced = already
        try:
            async for chunk in call:
                produced += len(chunk.token_ids)
                reason = _FINISH.get(chunk.finish_reason)
                if reason is None:
                    if chunk.token_ids:
                        yield TokenDelta(tuple(chunk.token_ids))
                    continue
                cached = max(usage_base.cached_tokens, chunk.usage.cached_tokens)
                yield TokenDelta(tuple(chunk.token_ids), reason,
                                 Usage(len(request.prompt_token_ids), produced, cached))
                return
        except _GRPC_ERRORS as exc:
            raise from_rpc_error(exc) from None
        raise UnavailableError(f"request {request.request_id}: the worker ended the stream without finishing")

    async def _cached_tokens(self, request: RouterRequest,
                             candidates: Sequence[WorkerHandle]) -> dict[WorkerId, int]:
        """Per candidate, the prompt tokens its prefix cache holds (empty without an index).

        A prompt shorter than one block cannot hit, so it costs no lookup.
        """
        if self.prefix_index is None or not candidates or len(request.prompt_token_ids) < self.model.block_size:
            return {}
        start = time.perf_counter()
        hashes = self.hasher.hash_blocks(request.prompt_token_ids)
        try:
            matches = await self.prefix_index.lookup(hashes, [(h.worker_id, h.record.epoch) for h in candidates])
        except (RedisError, OSError) as exc:
            if self.index_ok:
                log.warning("prefix index unreachable (%s): placing by load alone", exc)
            self.index_ok = False
            self.stats.index_errors += 1
            return {}
        if not self.index_ok:
            log.info("prefix index reachable again")
        self.index_ok = True
        self.stats.lookup_seconds += time.perf_counter() - start
        self.stats.lookups += 1
        return {m.worker_id: m.blocks * self.model.block_size for m in matches}

    def _early_lookup(self, request: RouterRequest) -> asyncio.Task[dict[WorkerId, int]] | None:
        """Start the first prefill placement's index lookup now, to run while Allocate does.

        Only for prompts that may need the prefill pool (longer than ``local_prefill_tokens``) and
        can hit (one block or more). The task never raises (``_cached_tokens`` degrades to {}); it
        is left to finish when the request does not use it (a local prefill, an early error).
        """
        n = len(request.prompt_token_ids)
        if self.prefix_index is None or n < self.model.block_size or n <= self.config.local_prefill_tokens:
            return None
        candidates = self.pool.available(WorkerRole.PREFILL)
        if not candidates:
            return None
        task = asyncio.ensure_future(self._cached_tokens(request, candidates))
        task.set_name(f"prefix-lookup-{request.request_id}")
        self._background.add(task)
        task.add_done_callback(self._background.discard)
        return task

    # -- colocated ----------------------------------------------------------------------------
    async def _colocated(self, request: RouterRequest) -> AsyncIterator[TokenDelta]:
        handle, reservation = await self._admit(request, WorkerRole.COLOCATED)
        msg = worker_pb2.WorkerGenerateRequest(request_id=request.request_id,
                                               prompt_token_ids=request.prompt_token_ids,
                                               sampling=sampling_to_pb(request.sampling))
        handle.inflight += 1
        handle.breaker.on_attempt()
        call = None
        try:
            try:
                call = handle.colocated.Generate(msg, timeout=self._timeout(request))
            except _GRPC_ERRORS as exc:
                raise from_rpc_error(exc) from None
            async for delta in self._relay(call, request, Usage(len(request.prompt_token_ids), 0), 0):
                yield delta
            handle.breaker.on_success()
        except UnavailableError:
            handle.breaker.on_failure()
            raise
        finally:
            handle.inflight -= 1
            if call is not None:
                call.cancel()
            if reservation is not None and self.admission is not None:
                self._background_task(self.admission.release(reservation), f"unbook-{request.request_id}")

    # -- disaggregated ------------------------------------------------------------------------
    async def _admit(self, request: RouterRequest, role: WorkerRole) -> tuple[WorkerHandle, Reservation | None]:
        """Pick the decode (or colocated) worker; with admission, book its KV first."""
        candidates = self.pool.available(role)
        blocks = self._blocks_needed(request)
        if self.admission is None:
            return self.policy.pick_decode(request, candidates, blocks), None
        if not candidates:
            raise UnavailableError(f"no {role.value} worker is available (none registered, or all failing)")
        by_id = {h.worker_id: h for h in candidates}
        caps = [DecodeCapacity(h.worker_id, h.record.epoch, h.record.capacity_blocks) for h in candidates]
        start = time.perf_counter()
        try:
            reservation = await self.admission.admit(request.request_id, blocks, caps, priority=request.priority,
                                                     deadline=request.deadline)
        except (RedisError, OSError) as exc:
            # Redis is the only shared state: without it keep serving, each decode worker still
            # guards its own pool (Allocate answers RESOURCE_EXHAUSTED when it is full).
            if self.admission_ok:
                log.warning("KV admission unavailable (%s): placing decode by load alone", exc)
            self.admission_ok = False
            self.stats.admission_errors += 1
            return self.policy.pick_decode(request, candidates, blocks), None
        if not self.admission_ok:
            log.info("KV admission available again")
        self.admission_ok = True
        if self.metrics is not None:
            self.metrics.observe_queue_time(time.perf_counter() - start)
        return by_id[reservation.worker_id], reservation

    async def _allocate(self, request: RouterRequest, handle: WorkerHandle,
                        sampling: common_pb2.SamplingParams) -> worker_pb2.AllocateResponse:
        msg = worker_pb2.AllocateRequest(request_id=request.request_id,
                                         prompt_token_ids=request.prompt_token_ids,
                                         max_tokens=request.sampling.max_tokens,
                                         model_compat_hash=self.pool.model_compat_hash,
                                         lease_ms=self.config.lease_ms, backend=self.config.kv_backend,
                                         sampling=sampling)
        handle.breaker.on_attempt()
        try:
            resp = await handle.decode.Allocate(msg, timeout=min(self._timeout(request), 30.0))
        except _GRPC_ERRORS as exc:
            err = from_rpc_error(exc)
            if isinstance(err, UnavailableError):
                handle.breaker.on_failure()
            raise err from None
        handle.breaker.on_success()
        return resp

    async def _release_now(self, handle: WorkerHandle, request_id: str) -> None:
        try:
            await handle.decode.Release(worker_pb2.ReleaseRequest(request_id=request_id, reason="prefill retry"),
                                        timeout=5.0)
        except _GRPC_ERRORS as exc:
            log.warning("release of %s on %s failed: %s", request_id, handle.worker_id, exc)

    async def _prefill(self, request: RouterRequest, target: common_pb2.TransferTarget, exclude: set[str],
                       sampling: common_pb2.SamplingParams,
                       lookup: asyncio.Task[dict[WorkerId, int]] | None = None) -> worker_pb2.PrefillResponse:
        """Prefill on the best candidate not in ``exclude``; ``lookup``: the index lookup, if started."""
        candidates = [h for h in self.pool.available(WorkerRole.PREFILL) if h.worker_id not in exclude]
        if lookup is not None:
            cached_tokens = await asyncio.shield(lookup)  # a cancelled request leaves it to finish
        else:
            cached_tokens = await self._cached_tokens(request, candidates)
        handle = self.policy.pick_prefill(request, candidates, cached_tokens)
        wid = handle.worker_id
        self.stats.match_tokens[wid] = self.stats.match_tokens.get(wid, 0) + cached_tokens.get(wid, 0)
        self.stats.placed_tokens[wid] = self.stats.placed_tokens.get(wid, 0) + len(request.prompt_token_ids)
        msg = worker_pb2.PrefillRequest(request_id=request.request_id,
                                        prompt_token_ids=request.prompt_token_ids,
                                        sampling=sampling, target=target,
                                        model_compat_hash=self.pool.model_compat_hash)
        tokens = len(request.prompt_token_ids)
        handle.inflight += 1
        handle.inflight_prefill_tokens += tokens
        handle.assigned_tokens += tokens - cached_tokens.get(wid, 0)
        handle.breaker.on_attempt()
        call = handle.prefill.Prefill(msg, timeout=self._timeout(request))
        try:
            resp = await call
        except _GRPC_ERRORS as exc:
            err = from_rpc_error(exc)
            if isinstance(err, UnavailableError):
                handle.breaker.on_failure()
            raise _PrefillFailed(handle, err) from None
        except asyncio.CancelledError:
            call.cancel()
            raise
        finally:
            handle.inflight -= 1
            handle.inflight_prefill_tokens -= tokens
        handle.breaker.on_success()
        self.stats.prompt_tokens += resp.stats.prompt_tokens
        self.stats.cached_prompt_tokens += resp.stats.cached_tokens
        self.stats.transfers += 1
        self.stats.bytes += resp.stats.bytes_sent
        self.stats.seconds += resp.stats.transfer_ms / 1e3
        if self.metrics is not None:
            self.metrics.observe_prefix_match(resp.stats.prompt_tokens, resp.stats.cached_tokens)
            self.metrics.observe_kv_transfer(resp.stats.bytes_sent, resp.stats.transfer_ms / 1e3,
                                             target.backend or "tcp")
        return resp

    async def _disaggregated(self, request: RouterRequest) -> AsyncIterator[TokenDelta]:
        decode, reservation = await self._admit(request, WorkerRole.DECODE)
        sampling = sampling_to_pb(request.sampling)
        decode.inflight += 1
        allocated = done = False
        try:
            lookup = self._early_lookup(request)
            tried: set[str] = set()
            for attempt in range(1, self.config.max_prefill_attempts + 1):
                alloc = await self._allocate(request, decode, sampling)
                allocated = True
                uncached = len(request.prompt_token_ids) - alloc.cached_blocks * self.model.block_size
                if uncached <= self.config.local_prefill_tokens:
                    self.stats.local_prefills += 1
                    msg = worker_pb2.DecodeRequest(request_id=request.request_id, sampling=sampling,
                                                   local_prefill=True, prompt_token_ids=request.prompt_token_ids)
                    base, produced = Usage(len(request.prompt_token_ids), 0), 0
                    break
                try:
                    # Only the first attempt's candidates are the ones the early lookup asked about.
                    resp = await self._prefill(request, alloc.target, tried, sampling,
                                               lookup if attempt == 1 else None)
                except _PrefillFailed as failed:
                    tried.add(failed.handle.worker_id)
                    if not failed.error.retryable or attempt == self.config.max_prefill_attempts:
                        raise failed.error from None
                    self.stats.prefill_retries += 1
                    log.warning("prefill of %s on %s failed (%s); retrying elsewhere", request.request_id,
                                failed.handle.worker_id, failed.error.message)
                    # The decode side may hold half-written blocks: free them before allocating again.
                    await self._release_now(decode, request.request_id)
                    allocated = False
                    continue
                yield TokenDelta((resp.first_token_id,))
                msg = worker_pb2.DecodeRequest(request_id=request.request_id, sampling=sampling,
                                               first_token_id=resp.first_token_id)
                base, produced = Usage(len(request.prompt_token_ids), 1, resp.stats.cached_tokens), 1
                break
            try:
                call = decode.decode.Generate(msg, timeout=self._timeout(request))
            except _GRPC_ERRORS as exc:
                raise from_rpc_error(exc) from None
            try:
                async for delta in self._relay(call, request, base, produced):
                    yield delta
                done = True
            finally:
                call.cancel()
        finally:
            decode.inflight -= 1
            if allocated and not done:
                self._release_later(decode, request.request_id, "router: request ended early")
            if reservation is not None and self.admission is not None:
                self._background_task(self.admission.release(reservation), f"unbook-{request.request_id}")

class _PrefillFailed(Exception):
    def __init__(self, handle: WorkerHandle, error: PdRouterError) -> None:
        super().__init__(error.message)
        self.handle = handle
        self.error = error
