"""The decode half of the worker side: one expectation per reserved request, steered by the worker process.

Every method runs on the connector's I/O loop. A request's receive moves through::

    EXPECTING ──KV landed──────────────────────────▶ OVER  (finished receiving)
        │  ▲ Retry: a fresh expectation (attempt + 1)
        ▼  │
    PARKED (the attempt failed; the worker process decides)
        │ GiveUp, the decision's deadline, the channel lost ──▶ OVER  (failed: vLLM computes the prompt)
    any ── Cancel (the request ended in vLLM) ──▶ OVER  (finished receiving: vLLM frees the blocks)

A failed attempt is never reported to vLLM as landed, nor one whose KV holds a value that is not
finite (checked once every block landed). The blocks are reported only once the expectation is
gone (``IncomingTransfer.abort`` returned), so nothing writes into them any more, and a failed
receive makes vLLM compute the prompt itself (its ``recompute`` policy) or fail it.
Each request is reported exactly once.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from pdrouter.core.aio import BackgroundTasks
from pdrouter.core.errors import PdRouterError, TransferError
from pdrouter.transfer.incoming import IncomingTransfer
from pdrouter.transfer.receiver import KvReceiver
from pdrouter.transfer.vllm.channel import Local, Message, Outcome, Received, Reserved
from pdrouter.transfer.vllm.orders import target_to_dict
from pdrouter.transfer.vllm.paged_pool import PagedPool
from pdrouter.transfer.vllm.reports import Reports
from pdrouter.transfer.vllm.step_plan import Cancel, LocalPlan, ReceivePlan

log = logging.getLogger("vllm.pdrouter.connector")


class Phase(enum.Enum):
    EXPECTING = "expecting"
    PARKED = "parked"
    OVER = "over"


@dataclass(slots=True)
class _Receive:
    plan: ReceivePlan
    attempt: int = 0
    phase: Phase = Phase.EXPECTING
    handle: IncomingTransfer | None = None
    started: float = field(default_factory=time.monotonic)
    parked_until: asyncio.TimerHandle | None = None


class Receives:
    """The receives of one rank (see the module docstring)."""

    def __init__(self, receiver: KvReceiver, pool: PagedPool, rank: int, block_size: int,
                 post: Callable[[Message], None], reports: Reports, decision_s: float) -> None:
        self.receiver = receiver
        self.pool = pool
        self.rank = rank
        self.block_size = block_size
        self._post = post
        self._reports = reports
        self._decision_s = decision_s
        self._open: dict[str, _Receive] = {}
        self._tasks = BackgroundTasks(log, "a KV receive's watcher failed")

    def __len__(self) -> int:
        return len(self._open)

    def plan(self, plan: ReceivePlan) -> None:
        receive = _Receive(plan)
        self._open[plan.key] = receive
        self._expect(receive)

    def local(self, plan: LocalPlan) -> None:
        self._post(Local(plan.key, self.rank, plan.cached_tokens))

    async def retry(self, key: str) -> None:
        receive = self._open.get(key)
        if receive is None:
            return  # over already (cancelled, given up): the worker process hears of it otherwise
        await self._drop_attempt(receive, "the worker process retries with another prefill worker")
        if receive.phase is not Phase.OVER:
            self._expect(receive)

    async def give_up(self, key: str, reason: str) -> None:
        receive = self._open.get(key)
        if receive is not None:
            await self._drop_attempt(receive, reason)
            self._conclude(receive, failed=True)

    async def cancel(self, cancel: Cancel) -> None:
        receive = self._open.get(cancel.key)
        if receive is not None and receive.plan.req_id == cancel.req_id:
            await self._drop_attempt(receive, "the request ended")
            self._conclude(receive, failed=False)

    async def give_up_all(self, reason: str) -> None:
        for key in list(self._open):
            await self.give_up(key, reason)

    # -- helpers ------------------------------------------------------------------------------------
    def _transfer_id(self, receive: _Receive) -> str:
        key = receive.plan.key
        return key if receive.attempt == 0 else f"{key}#{receive.attempt}"

    def _expect(self, receive: _Receive) -> None:
        plan = receive.plan
        receive.phase = Phase.EXPECTING
        receive.started = time.monotonic()
        try:
            handle = self.receiver.expect(self._transfer_id(receive), plan.dst_block_ids,
                                          skip_blocks=plan.skip_blocks, timeout_s=plan.timeout_s)
        except PdRouterError as exc:
            log.warning("request %s: cannot invite its KV (%s); computing the prompt here", plan.key, exc.message)
            self._post(Received(plan.key, self.rank, receive.attempt, Outcome.failed(exc)))
            self._conclude(receive, failed=True)
            return
        receive.handle = handle
        self._post(Reserved(plan.key, self.rank, receive.attempt, target_to_dict(handle.target),
                            plan.skip_blocks * self.block_size))
        self._tasks.spawn(self._watch(receive, handle, receive.attempt))

    async def _watch(self, receive: _Receive, handle: IncomingTransfer, attempt: int) -> None:
        error: PdRouterError | None = None
        try:
            await handle.wait_all_async()
            blocks = receive.plan.dst_block_ids[receive.plan.skip_blocks:]
            if not await asyncio.get_running_loop().run_in_executor(None, self.pool.finite, blocks):
                error = TransferError(f"transfer {handle.transfer_id}: the received KV holds values that are not "
                                      f"finite")
        except PdRouterError as exc:
            error = exc
        if receive.attempt != attempt or receive.phase is not Phase.EXPECTING:
            return  # replaced by a retry, or dropped
        seconds = time.monotonic() - receive.started
        if error is None:
            self._post(Received(receive.plan.key, self.rank, attempt, Outcome(True, handle.bytes_landed, seconds)))
            self._conclude(receive, failed=False)
            return
        self._post(Received(receive.plan.key, self.rank, attempt, Outcome.failed(error, handle.bytes_landed, seconds)))
        receive.phase = Phase.PARKED
        receive.parked_until = asyncio.get_running_loop().call_later(
            self._decision_s, lambda: self._tasks.spawn(
                self.give_up(receive.plan.key, "no decision from the worker process in time")))

    async def _drop_attempt(self, receive: _Receive, reason: str) -> None:
        """End the current attempt; returns once nothing writes into the blocks any more."""
        receive.attempt += 1
        if receive.parked_until is not None:
            receive.parked_until.cancel()
            receive.parked_until = None
        handle, receive.handle = receive.handle, None
        if handle is not None and not handle.state.terminal:
            await asyncio.get_running_loop().run_in_executor(None, handle.abort, reason)

    def _conclude(self, receive: _Receive, *, failed: bool) -> None:
        if receive.phase is Phase.OVER:
            return
        receive.phase = Phase.OVER
        self._open.pop(receive.plan.key, None)
        self._reports.received(receive.plan.req_id, failed=failed)
