"""Dispatch: decide where one request goes, then make the one worker call that serves it. The
decisions are ``DispatchCore``'s (``pdrouter.router.placing``), the worker calls ``PoolDispatcher``'s.

Deciding yields a ``Placement`` value: admission books the decode blocks (Redis), the prefix index
ranks the prefill workers (looked up while admission runs), and the ``ServeOrder`` is written.
Sending hands that order to its decode worker, which drives the prefill/decode pair::

    DecodeWorker.Serve(prompt, ranked prefill routes)
        decode worker: reserve blocks ──▶ PrefillWorker.Prefill(into those blocks) ──▶ first token
                                                                         └─▶ decode ──▶ the rest

* The router makes one worker call per request (not three), so it adds one hop, not three, and
  the first token reaches it one hop after the prefill worker produced it.
* Conditional disaggregation (``pdrouter.core.disaggregation``): when the prompt's part not already
  cached on the decode worker is at most ``local_prefill_tokens``, the decode worker computes it
  itself (no KV transfer); a prompt that short costs no index lookup and names no prefill worker.
* A prefill that fails before the first token (worker gone, transfer broken) is retried by the
  decode worker on the next ranked prefill worker, up to ``max_prefill_attempts`` in all; the
  report on the first chunk names the failures, and their circuit breakers count them.
* Whatever ends the request (finish, error, client gone, deadline) cancels the call: the decode
  worker frees its blocks and cancels the prefill in flight. The booking is released in Redis.
* A request that brings no deadline of its own gets ``DispatchConfig.default_deadline_s``: the
  admission wait and the worker call all run within it.
* A decode (or colocated) worker that fails the call UNAVAILABLE before anything of the request
  came back (stopped, restarting, unreachable: no token and no prefill report) is passed over: its
  breaker counts the failure, the booking goes back, and the request is admitted again on another
  worker, up to ``max_worker_attempts`` workers in all. Nothing reached the client, so nothing is
  repeated to it.
* A worker's error reaches the client in the router's words (``pdrouter.router.worker_errors``):
  its status stands, its text, which names internals, goes to the log.
* When Redis cannot be reached for a booking, ``AdmissionConfig.on_redis_error`` decides: ``fail``
  refuses the request (UNAVAILABLE / 503), ``local`` places it by load alone; either way
  ``TransferStats.admission_redis_errors`` counts it, by outcome.

Colocated: the request goes to one colocated worker, which streams every token.

Either way, a request the front door marks ``whole`` (not streamed, no stop strings) asks its
worker for the tokens in one chunk at the end (``Serve``: after the first token, which brings the
prefill report), so its cost here does not grow with its output.

A request's ``cache_salt`` salts the hashes its prefix is looked up under and goes to its workers,
whose engines hash its blocks the same way. Its tenant places it in the admission queue (priority
class, fair-share weight), and on the workers' engines (``engine_priority``: a prompt of a higher
class, or of a tenant within its share, is computed before those of a tenant past its share, which
otherwise fill the prefill workers' queues whenever KV room comes back). A traced request
(``RouterRequest.trace``: the router traces) gets spans for its admission wait, its placement, the
worker call (whose trace context goes with it) and its first token, all under the request's span;
an untraced one pays an ``is None`` test per step.
"""
from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import AsyncIterator

from pdrouter.core.errors import PdRouterError, UnavailableError
from pdrouter.core.ids import WorkerId
from pdrouter.core.workers import WorkerRole
from pdrouter.router.placing import DEFAULT_DEADLINE_S as DEFAULT_DEADLINE_S
from pdrouter.router.placing import DispatchConfig as DispatchConfig
from pdrouter.router.placing import DispatchCore, Placement, ServeCall
from pdrouter.router.placing import engine_priority as engine_priority
from pdrouter.router.request import RouterRequest, TokenDelta
from pdrouter.router.worker_errors import client_error
from pdrouter.wire.worker_client import TokenStream

log = logging.getLogger(__name__)


class PoolDispatcher(DispatchCore):
    """The front doors' ``pdrouter.router.request.Dispatcher`` over a ``WorkerPool``: each request is
    placed (decode worker, ranked prefill workers), then sent in one worker call (see the module docstring)."""

    def generate(self, request: RouterRequest) -> AsyncIterator[TokenDelta]:
        if request.deadline is None:
            request = dataclasses.replace(request, deadline=time.monotonic() + self.config.default_deadline_s)
        if self.config.mode == "colocated":
            return self._colocated(request)
        return self._disaggregated(request)


    async def _colocated(self, request: RouterRequest) -> AsyncIterator[TokenDelta]:
        tried: set[WorkerId] = set()
        while True:
            handle, reservation, engine_priority = await self._admit(request, WorkerRole.COLOCATED, tried)
            handle.inflight += 1
            handle.breaker.on_attempt()
            call: TokenStream | None = None
            answered = ok = False
            try:
                call = handle.client.generate(request.request_id, request.prompt_token_ids, request.sampling,
                                              timeout=self._timeout(request), whole=request.whole,
                                              cache_salt=request.cache_salt, metadata=self._call_metadata(request),
                                              priority=engine_priority, prompt_token_bytes=request.prompt_token_bytes,
                                              sink=request.sink)
                async for delta in call:
                    if not answered and request.trace is not None:
                        self._first_token(request)
                    answered = True
                    yield delta
                handle.breaker.on_success()
                ok = True
                return
            except UnavailableError as exc:
                handle.breaker.on_failure()
                if answered or not self._retry_elsewhere(handle, tried, WorkerRole.COLOCATED):
                    raise client_error(exc, "colocated", handle.worker_id, request.request_id) from None
                log.debug("request %s: %s", request.request_id, exc.message)
            except PdRouterError as exc:
                raise client_error(exc, "colocated", handle.worker_id, request.request_id) from None
            finally:
                handle.inflight -= 1
                self.policy.on_request_complete(request, handle, ok)
                if call is not None:
                    call.cancel()
                if reservation is not None and self.admission is not None:
                    self._unbook(reservation)

    async def _disaggregated(self, request: RouterRequest) -> AsyncIterator[TokenDelta]:
        """Decide (``_place``), then send: one ``DecodeWorker.Serve`` call, in which the decode worker
        reserves, has the ranked prefill workers compute the prompt (or computes it itself), and
        streams every token. Placed again on another decode worker when one fails it unanswered."""
        lookup = self._early_lookup(request)  # runs while admission books the decode blocks
        tried: set[WorkerId] = set()
        placement: Placement | None = None
        while True:
            placement = await self._place(request, tried, lookup, placement)
            decode = placement.decode
            serve = ServeCall(self, request, placement)
            stream: TokenStream | None = None
            try:
                decode.breaker.on_attempt()
                try:
                    metadata = None
                    if request.trace is not None:
                        serve.span = self._span("pdrouter.v1.DecodeWorker/Serve", request, {
                            "rpc.system": "grpc", "rpc.service": "pdrouter.v1.DecodeWorker", "rpc.method": "Serve",
                            "pdrouter.decode_worker": decode.worker_id}, kind=self.tracing.CLIENT)  # type: ignore[union-attr]
                        metadata = self._call_metadata(request, serve.span)
                    stream = decode.client.serve(placement.order, timeout=self._timeout(request),
                                                 on_report=serve.on_report, metadata=metadata, sink=request.sink)
                    first = serve.span is not None
                    async for delta in stream:
                        if first:
                            first = False
                            self._first_token(request)
                        serve.answered = True
                        yield delta
                except UnavailableError as exc:
                    # With a report, the decode worker answered: the failure was the prefill side's.
                    if serve.answered:
                        raise client_error(exc, serve.failed_role, decode.worker_id, request.request_id) from None
                    decode.breaker.on_failure()
                    if not self._retry_elsewhere(decode, tried, WorkerRole.DECODE):
                        raise client_error(exc, "decode", decode.worker_id, request.request_id) from None
                    log.debug("request %s: %s", request.request_id, exc.message)
                    continue
                except PdRouterError as exc:
                    raise client_error(exc, serve.failed_role, decode.worker_id, request.request_id) from None
                decode.breaker.on_success()
                serve.ok = True
                return
            except BaseException as exc:
                if serve.span is not None and not isinstance(exc, GeneratorExit):  # not a consumer that stopped
                    self._failed(serve.span, exc)
                    serve.span = None
                raise
            finally:
                if serve.span is not None:
                    serve.span.end()
                decode.inflight -= 1
                serve.settle()
                self.policy.on_request_complete(request, decode, serve.ok)
                if stream is not None:
                    stream.cancel()
                if placement.reservation is not None and self.admission is not None:
                    self._unbook(placement.reservation)
