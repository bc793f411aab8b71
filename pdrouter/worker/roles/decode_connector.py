"""``DecodeWorker.Serve`` on a vLLM decode worker: vLLM reserves, its KV connector invites, a prefill worker sends.

The same decode-driven request as with pd-router's own engine (``decode_serve``), with vLLM holding
the blocks and its KV connector (``pdrouter.transfer.vllm``) moving them:

1. the request goes to vLLM at once, with a ``ReceiveOrder``: vLLM allocates the blocks of the prompt
   tokens this engine does not hold, and the connector invites the KV into them and says so on its
   side channel (``Placement``: the targets), or says the prompt is computed here (``LocalPrefill``:
   at most ``local_prefill_tokens`` of it are not cached here, or no prefill route was named);
2. the prefill routes the router ranked are called in turn with the targets (each checked against the
   registry first); once one answered and the KV landed, vLLM recomputes the prompt's last position
   over it and decodes. A failed attempt (refused route, prefill worker gone, transfer broken or late)
   invites the KV afresh into the same blocks for the next route (``retry``: the old expectation is
   gone first, so nothing of it lands); after the last one, vLLM computes the prompt itself
   (``give_up``): the client still gets its answer, never one computed from partial KV;
3. the engine's outputs are the stream, the ``PrefillReport`` on the first.

The first token is the decode engine's own: vLLM samples it from the prompt's last position, which it
computes over the received KV, so the stream is one engine's, whatever the sampling. Usage's cached
tokens are what no engine had to compute: the decode worker's prefix hit, or the prefill worker's.

Leaving the stream early (a cancelled call) aborts the request in vLLM (its connector aborts the
expectation, which tells the sender, then vLLM frees the blocks) and cancels a prefill call in flight.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from typing import TypeVar

from pdrouter.core.disaggregation import PrefillFailure, PrefillOutcome, PrefillRoute, ServeOrder
from pdrouter.core.errors import DeadlineExceededError, PdRouterError
from pdrouter.core.ids import RequestId
from pdrouter.engine.outputs import RequestOutput
from pdrouter.transfer.vllm.channel import ChannelError
from pdrouter.transfer.vllm.host import ConnectorHost, Landed, LocalPrefill, Placement, ReceiveLink
from pdrouter.transfer.vllm.orders import ReceiveOrder
from pdrouter.wire.prefill_links import PrefillLinks
from pdrouter.worker.roles.decode_serve import EngineStream, ServeEvent, ServeSetup, prefill_report, shaped
from pdrouter.worker.roles.prefill_connector import KvParamsEngine
from pdrouter.worker.roles.prefill_routes import RegisteredPrefillWorkers
from pdrouter.worker.transfer_tally import TransferTally

log = logging.getLogger(__name__)

T = TypeVar("T")
ALWAYS_HERE = 2**31 - 1
"""``local_prefill_tokens`` of a request with no prefill route: the prompt is computed here."""


class EngineOutputs:
    """The engine's output stream, pulled from the start (vLLM takes the request on the first pull).

    ``stream`` yields the outputs (and raises the stream's error); ``close`` leaves the stream, which
    aborts the request in vLLM when it has not finished.
    """

    def __init__(self, outputs: AsyncGenerator[RequestOutput, None]) -> None:
        self._outputs = outputs
        self._queue: asyncio.Queue[RequestOutput | BaseException | None] = asyncio.Queue()
        self.started = asyncio.Event()
        """Set once the engine produced (or failed): the KV is in place, or no longer awaited."""
        self._task = asyncio.ensure_future(self._pull())

    async def _pull(self) -> None:
        try:
            async for out in self._outputs:
                self._queue.put_nowait(out)
                self.started.set()
            self._queue.put_nowait(None)
        except Exception as exc:
            self._queue.put_nowait(exc)
        finally:
            self.started.set()

    async def stream(self) -> AsyncIterator[RequestOutput]:
        while (item := await self._queue.get()) is not None:
            if isinstance(item, BaseException):
                raise item
            yield item

    async def until(self, waiting: Awaitable[T]) -> T | None:
        """``waiting``'s result, or None when the engine started producing first (``waiting`` is dropped)."""
        task = asyncio.ensure_future(waiting)
        started = asyncio.ensure_future(self.started.wait())
        try:
            await asyncio.wait({task, started}, return_when=asyncio.FIRST_COMPLETED)
            if task.done():
                return task.result()
            return None
        finally:
            for pending in (task, started):
                pending.cancel()
                with contextlib.suppress(asyncio.CancelledError, PdRouterError):
                    await pending

    async def close(self) -> None:
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task
        await self._outputs.aclose()


class ConnectorDecodeServe(ServeSetup):
    """``Serve`` on one vLLM decode worker (see the module docstring)."""

    def __init__(self, engine: KvParamsEngine, host: ConnectorHost, links: PrefillLinks, worker_id: str,
                 kv_wait_s: float, prefill_timeout_s: float = 600.0,
                 registered: RegisteredPrefillWorkers | None = None, tally: TransferTally | None = None) -> None:
        super().__init__(links, worker_id, kv_wait_s, prefill_timeout_s, registered, tally)
        self.engine = engine
        self.host = host

    async def serve(self, order: ServeOrder,
                    time_remaining: Callable[[], float | None]) -> AsyncGenerator[ServeEvent, None]:
        rid = order.request_id
        with self.serving(order) as routes:
            timeout = self.prefill_timeout(time_remaining)
            receive = ReceiveOrder(rid, order.local_prefill_tokens if routes else ALWAYS_HERE,
                                   timeout + self.kv_wait_s)
            with self.host.receive(rid) as link:
                outputs = EngineOutputs(self.engine.generate(RequestId(rid), order.prompt_token_ids, order.sampling,
                                                             extra_args={"kv_transfer_params": receive.params()},
                                                             cache_salt=order.cache_salt,
                                                             priority=order.priority))
                try:
                    event = await self._place(order, link, routes, outputs, timeout)
                    async with shaped(outputs.stream(), order.whole, first_alone=True) as stream:
                        event.outputs = stream
                        yield event
                finally:
                    await outputs.close()

    async def _place(self, order: ServeOrder, link: ReceiveLink, routes: list[PrefillRoute],
                     outputs: EngineOutputs, timeout: float) -> EngineStream:
        """Get the prompt's KV in place (or computed here); the event the engine's outputs go out with."""
        prompt_tokens = len(order.prompt_token_ids)
        failures: list[PrefillFailure] = []
        placement = await self._placement(link, outputs, timeout, failures)
        decode_cached = placement.cached_tokens if isinstance(placement, Placement | LocalPrefill) else 0
        while isinstance(placement, Placement) and routes:
            route = routes.pop(0)
            outcome = await self._attempt(order, link, placement, route, timeout)
            if isinstance(outcome, PrefillFailure):
                failures.append(outcome)
            else:
                report = prefill_report(prompt_tokens, decode_cached, failures, worker_id=route.worker_id,
                                        outcome=outcome)
                return EngineStream(outputs.stream(), report=report,
                                    cached_tokens=max(decode_cached, outcome.cached_tokens))
            if routes:
                link.retry()
                placement = await self._placement(link, outputs, timeout, failures)
        if isinstance(placement, Landed):  # an attempt counted failed landed after all
            return EngineStream(outputs.stream(), report=prefill_report(prompt_tokens, decode_cached, failures),
                                cached_tokens=decode_cached)
        if isinstance(placement, Placement):  # every route failed: vLLM computes the prompt here
            log.warning("Serve %s: every prefill route failed; computing the prompt here", order.request_id)
            link.give_up("every prefill worker failed")
        report = prefill_report(prompt_tokens, decode_cached, failures, local=True)
        # Computed here with no word of what this engine held (``placement`` None: it could not invite the
        # KV, or it started producing before the connector said where the prompt goes, which a busy
        # machine makes likely for a prompt it mostly holds): the engine's own count is the usage's.
        here = placement is None or isinstance(placement, LocalPrefill)
        return EngineStream(outputs.stream(), report=report, cached_tokens=None if here else decode_cached)

    async def _placement(self, link: ReceiveLink, outputs: EngineOutputs, timeout: float,
                         failures: list[PrefillFailure]) -> Placement | LocalPrefill | Landed | None:
        """The connector's word on the current attempt; None when the engine computes the prompt here
        anyway (it could not invite the KV, or it started producing first). The engine going away and
        the call's deadline are the call's errors."""
        try:
            return await outputs.until(link.placement(timeout))
        except (ChannelError, DeadlineExceededError):
            raise
        except PdRouterError as err:  # the invitation failed: the connector gave the prompt to vLLM
            failures.append(PrefillFailure(self.worker_id, err.grpc_code, err.message))
            log.warning("Serve %s: the KV could not be invited (%s); computing the prompt here", link.key,
                        err.message)
            return None

    async def _attempt(self, order: ServeOrder, link: ReceiveLink, placement: Placement, route: PrefillRoute,
                       timeout: float) -> PrefillOutcome | PrefillFailure:
        """One prefill worker into the invited blocks: its outcome once the KV landed, or how it failed."""
        rid = order.request_id
        refused = await self.refused(route, rid)
        if refused is not None:
            return refused
        try:
            outcome = await self.links.prefill(route, rid, order.prompt_token_ids, order.sampling, placement.targets[0],
                                               self.worker_id, order.model_compat_hash, timeout,
                                               cache_salt=order.cache_salt, priority=order.priority)
            landed = await link.landed(self.kv_wait_s)
            outcome.bytes_sent = landed.nbytes  # what this engine received
            self.tally.received(landed.nbytes, landed.seconds)
            return outcome
        except PdRouterError as err:
            self.tally.failed()
            failure = self.failed(route, rid, err, "prefill on {} failed")
            if link.host.lost is not None:
                raise link.host.lost from None  # this worker's engine went away: no route helps
            return failure
