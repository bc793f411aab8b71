"""``DecodeWorker.Serve``'s logic: one disaggregated request driven from the decode worker, in dataclasses.

Reserve the prompt's blocks in the engine (reusing this worker's prefix cache), then compute the
prompt here when little of it is uncached (or no prefill route was named), else invite the KV into
the blocks and call the prefill workers the router ranked (the next one on a retryable failure),
then decode from the first token. A route is called only when it passes the registry check
(``prefill_routes``); a refused route is a ``PERMISSION_DENIED`` failure in the report. KV that
lands holding a value that is not finite is refused like a failed transfer (UNAVAILABLE, the next
route), its blocks cleared.

``DecodeServe.serve(order)`` yields what the servicer (``pdrouter.worker.roles.decode``) streams:

* ``ReportChunk``: a chunk of its own with the ``PrefillReport`` and the prefill worker's first token
  (no token when every route failed; the call then ends with the last failure);
* ``EngineStream``: the engine's outputs for the request, one chunk each (``report``, when set,
  goes on the first one: the prompt was computed here). For a caller that does not stream
  (``ServeOrder.whole``) the outputs are merged (``pdrouter.worker.whole_outputs.whole_outputs``): the
  first token by itself (its chunk brings the report, which the caller's accounting of the prefill
  workers waits for), then the rest in one output at the end, so the call is two chunks.

The report is attached once. Leaving the stream early (a cancelled call) frees everything: the
expectation is aborted, the blocks freed, a prefill call in flight cancelled.
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Container, Iterator
from contextlib import aclosing, asynccontextmanager, contextmanager
from dataclasses import dataclass

from pdrouter.core.disaggregation import (
    PrefillFailure,
    PrefillOutcome,
    PrefillReport,
    PrefillRoute,
    ServeOrder,
    computes_locally,
)
from pdrouter.core.errors import (
    InvalidRequestError,
    PdRouterError,
    TransferError,
    UnavailableError,
    error_from_grpc_code,
)
from pdrouter.core.ids import RequestId
from pdrouter.engine.outputs import KvReservation, OutputSink, RequestOutput
from pdrouter.transfer.receiver import KvReceiver
from pdrouter.wire.prefill_links import PrefillLinks
from pdrouter.worker.engine_contract import DisaggregatedEngine
from pdrouter.worker.roles.prefill_routes import RegisteredPrefillWorkers
from pdrouter.worker.transfer_tally import TransferTally
from pdrouter.worker.whole_outputs import whole_outputs

log = logging.getLogger(__name__)

REFUSED = "PERMISSION_DENIED"
"""The failure code ``Serve`` reports for a prefill route it refused to call (not registered)."""


# Events of one request's path: plain slotted dataclasses (a frozen one sets each field through
# object.__setattr__); treat them as values.
@dataclass(slots=True)
class ReportChunk:
    """A chunk with the report and the prefill worker's first token (None: every route failed)."""

    report: PrefillReport
    first_token: int | None


@dataclass(slots=True)
class EngineStream:
    """The engine's outputs, one chunk each; ``report`` goes on the first (None: it went already)."""

    outputs: AsyncIterator[RequestOutput]
    report: PrefillReport | None = None
    cached_tokens: int | None = None
    """The usage's cached tokens on the finished chunk (None: the engine's count)."""


ServeEvent = ReportChunk | EngineStream


def prefill_report(prompt_tokens: int, decode_cached_tokens: int, failures: list[PrefillFailure], *,
                   local: bool = False, worker_id: str = "", outcome: PrefillOutcome | None = None) -> PrefillReport:
    return PrefillReport(
        worker_id=worker_id, local=local, prompt_tokens=prompt_tokens,
        cached_tokens=outcome.cached_tokens if outcome is not None else 0, decode_cached_tokens=decode_cached_tokens,
        compute_ms=outcome.compute_ms if outcome is not None else 0.0,
        transfer_ms=outcome.transfer_ms if outcome is not None else 0.0,
        bytes_sent=outcome.bytes_sent if outcome is not None else 0, failures=tuple(failures))


@asynccontextmanager
async def shaped(outputs: AsyncIterator[RequestOutput], whole: bool,
                  first_alone: bool) -> AsyncIterator[AsyncIterator[RequestOutput]]:
    """The engine's outputs as the caller takes them: one by one, or (``whole``) merged, the
    first token by itself unless it went with the report already (``whole_outputs``)."""
    if not whole:
        yield outputs
        return
    async with aclosing(whole_outputs(outputs, first_alone=first_alone)) as merged:
        yield merged


class ServeSetup:
    """What ``Serve`` needs on a decode worker whichever engine computes (this one, or vLLM through its
    KV connector: ``pdrouter.worker.roles.decode_connector``): the links to prefill workers, the check
    every route passes, the transfer tally and the requests in flight."""

    def __init__(self, links: PrefillLinks, worker_id: str, kv_wait_s: float, prefill_timeout_s: float = 600.0,
                 registered: RegisteredPrefillWorkers | None = None, tally: TransferTally | None = None) -> None:
        """``registered``: the check every prefill route passes before it is called (None: none);
        ``tally``: where the transfers are counted."""
        self.tally = tally if tally is not None else TransferTally()
        self.links = links
        self.worker_id = worker_id
        self.kv_wait_s = kv_wait_s
        self.prefill_timeout_s = prefill_timeout_s
        """Limit of one prefill call when the Serve call has no deadline of its own."""
        self.registered = registered
        self._serving: set[str] = set()

    def check_new(self, request_id: str, held: Container[str] = ()) -> None:
        """InvalidRequestError when ``request_id`` is being served here or is in ``held``."""
        if request_id in self._serving or request_id in held:
            raise InvalidRequestError(f"request {request_id!r} is already on this worker")

    @contextmanager
    def serving(self, order: ServeOrder) -> Iterator[list[PrefillRoute]]:
        """The order's routes, checked (a new request; every route names an address), while it is served."""
        rid = order.request_id
        self.check_new(rid)
        routes = list(order.routes)
        for route in routes:
            PrefillLinks.key(route)  # a route without an address is the caller's error: say so now
        self._serving.add(rid)
        try:
            yield routes
        finally:
            self._serving.discard(rid)

    def prefill_timeout(self, time_remaining: Callable[[], float | None]) -> float:
        remaining = time_remaining()
        return self.prefill_timeout_s if remaining is None else remaining

    async def refused(self, route: PrefillRoute, request_id: str) -> PrefillFailure | None:
        """The failure of a route that fails the registry check (None: it may be called)."""
        refusal = await self.registered.refusal(route) if self.registered is not None else None
        if refusal is None:
            return None
        log.warning("Serve %s: prefill route refused: %s", request_id, refusal)
        return PrefillFailure(route.worker_id, REFUSED, refusal)

    def failed(self, route: PrefillRoute, request_id: str, err: PdRouterError, how: str) -> PrefillFailure:
        """``route``'s attempt failed with ``err``; ``how`` says so in the log (``{}``: the worker)."""
        log.warning("Serve %s: %s (%s)", request_id, how.format(route.worker_id), err.message)
        return PrefillFailure(route.worker_id, err.grpc_code, err.message)


class DecodeServe(ServeSetup):
    """``Serve`` on one decode worker: its engine, its KV receiver and its links to prefill workers."""

    def __init__(self, driver: DisaggregatedEngine, receiver: KvReceiver, links: PrefillLinks, worker_id: str,
                 kv_wait_s: float, prefill_timeout_s: float = 600.0,
                 registered: RegisteredPrefillWorkers | None = None, tally: TransferTally | None = None) -> None:
        super().__init__(links, worker_id, kv_wait_s, prefill_timeout_s, registered, tally)
        self.driver = driver
        self.receiver = receiver

    async def serve(self, order: ServeOrder, time_remaining: Callable[[], float | None],
                    sink: OutputSink | None = None) -> AsyncGenerator[ServeEvent, None]:
        """The request's events (see the module docstring); ``time_remaining``: the call's deadline;
        ``sink``: where the decode's unfinished outputs may go instead (``OutputSink``), after a remote
        prefill (a local one's first output carries the report, so its stream keeps them all)."""
        rid = order.request_id
        prompt = order.prompt_token_ids
        failures: list[PrefillFailure] = []
        decode_cached = 0
        with self.serving(order) as routes:
            while not (failures and not routes):
                reservation = self.driver.reserve_remote(RequestId(rid), prompt, order.sampling,
                                                         cache_salt=order.cache_salt)
                decode_cached = reservation.num_cached_tokens
                if routes and not computes_locally(len(prompt), decode_cached, order.local_prefill_tokens):
                    route = routes.pop(0)
                    outcome = await self._remote_prefill(order, reservation, route, time_remaining)
                    if isinstance(outcome, PrefillFailure):
                        failures.append(outcome)
                        continue  # that worker failed (and the blocks were freed): the next one
                    report = prefill_report(len(prompt), decode_cached, failures, worker_id=route.worker_id,
                                     outcome=outcome)
                    finished = False
                    try:
                        # The first token at once (with the report), then the decode stream from the landed KV.
                        yield ReportChunk(report, outcome.first_token)
                        cached = max(decode_cached, outcome.cached_tokens)
                        decoded = self.driver.decode_remote(RequestId(rid), outcome.first_token, whole=order.whole,
                                                            sink=sink)
                        async with aclosing(decoded) as outputs, \
                                shaped(outputs, order.whole, first_alone=False) as stream:
                            yield EngineStream(stream, cached_tokens=cached)
                        finished = True
                    finally:
                        if not finished:
                            self.driver.abort(RequestId(rid))
                    return
                # Computed here (little is uncached, or no prefill worker was named): the
                # reservation's cached prefix stays in the prefix cache, and the local request
                # reuses it at once.
                self.driver.abort(RequestId(rid))
                report = prefill_report(len(prompt), decode_cached, failures, local=True)
                async with aclosing(self.driver.generate(RequestId(rid), prompt, order.sampling,
                                                         cache_salt=order.cache_salt, priority=order.priority,
                                                         whole=order.whole)) as outputs, \
                        shaped(outputs, order.whole, first_alone=True) as stream:
                    yield EngineStream(stream, report=report)
                return
            # Every prefill worker failed: the report names them all, then the last failure ends the call.
            yield ReportChunk(prefill_report(len(prompt), decode_cached, failures), None)
            last = failures[-1]
            if last.code == REFUSED:  # the caller's view of the pool is not this worker's: try again later
                raise UnavailableError(f"prefill on {last.worker_id} refused: {last.message}")
            raise error_from_grpc_code(last.code, f"prefill on {last.worker_id} failed: {last.message}")

    async def _remote_prefill(self, order: ServeOrder, reservation: KvReservation, route: PrefillRoute,
                              time_remaining: Callable[[], float | None]) -> PrefillOutcome | PrefillFailure:
        """One prefill attempt into ``reservation``: what the prefill worker answered, or how it failed.

        A failed attempt frees the blocks (the caller reserves afresh); a cancelled one also
        cancels the prefill call, so the prefill worker drops its share. A failure that is not
        retryable ends the request.
        """
        rid = order.request_id
        timeout = self.prefill_timeout(time_remaining)
        landed = False
        invited = time.perf_counter()
        incoming = self.receiver.expect(rid, reservation.block_ids, skip_blocks=reservation.num_cached_blocks,
                                        timeout_s=timeout + self.kv_wait_s)
        try:
            refused = await self.refused(route, rid)
            if refused is not None:
                return refused
            try:
                outcome = await self.links.prefill(route, rid, order.prompt_token_ids, order.sampling,
                                                   incoming.target, self.worker_id, order.model_compat_hash,
                                                   timeout, cache_salt=order.cache_salt,
                                                   priority=order.priority)
            except PdRouterError as err:
                failure = self.failed(route, rid, err, "prefill on {} failed")
                if not err.retryable:
                    raise
                return failure
            try:
                await incoming.wait_all_async(timeout=self.kv_wait_s)
            except PdRouterError:
                self.tally.failed()
                raise
            try:  # KV that is not finite would fail this request's decode, or poison others through stale slots
                await self.driver.check_received_kv(RequestId(rid), incoming.bytes_landed)
            except TransferError as err:
                self.tally.failed()
                return self.failed(route, rid, err, "the KV from {} was refused")
            landed = True
            self.tally.received(incoming.bytes_landed, time.perf_counter() - invited)
        finally:
            if not landed:
                incoming.abort("the prefill attempt ended early")
                self.driver.abort(RequestId(rid))
        return outcome
