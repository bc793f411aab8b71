"""The prefill half of the worker side: push a computed prompt's blocks into the decode engine's.

The engine thread drives it through one forward pass: ``plan`` (before the pass: open the
transfer when a connection to the receiver is up), ``layer`` (as each attention layer has
written its KV: queue that layer's frames, which the sender's thread puts on the wire while the
next layers compute), ``step_done`` (after the pass: hand the transfer to the I/O loop). The I/O
loop waits for the receiver's confirmation, at most the order's ``hold_s``, then reports the
request so vLLM frees its blocks: they are read until then and never longer.

With no connection to the receiver yet (the first request to a decode engine), nothing may dial
on the engine thread: the I/O loop dials, then sends every layer at once after the pass.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from pdrouter.core.errors import InvalidRequestError, PdRouterError
from pdrouter.transfer.outgoing import OutgoingTransfer
from pdrouter.transfer.sender import KvSender
from pdrouter.transfer.vllm.channel import Message, Outcome, Sent
from pdrouter.transfer.vllm.io_thread import IoThread
from pdrouter.transfer.vllm.reports import Reports
from pdrouter.transfer.vllm.step_plan import SendPlan

log = logging.getLogger("vllm.pdrouter.connector")


@dataclass(slots=True)
class _Send:
    plan: SendPlan
    transfer: OutgoingTransfer | None = None
    error: Exception | None = None
    started: float | None = None
    """When its first frames were queued (the transfer's window starts)."""


class Sends:
    """The sends of one rank (see the module docstring)."""

    def __init__(self, sender: KvSender, rank: int, io: IoThread, post: Callable[[Message], None],
                 reports: Reports, *, cuda: bool) -> None:
        self.sender = sender
        self.rank = rank
        self._io = io
        self._post = post
        self._reports = reports
        self._cuda = cuda
        self._step: list[_Send] = []

    # -- engine thread --------------------------------------------------------------------------------
    def plan(self, plan: SendPlan) -> None:
        send = _Send(plan)
        self._reports.sending(plan.req_id)
        self._step.append(send)
        if self.rank >= len(plan.targets):
            send.error = InvalidRequestError(f"request {plan.key}: no target for tensor-parallel rank {self.rank} "
                                             f"(the decode engine has {len(plan.targets)} ranks)")
            return
        try:
            send.transfer = self.sender.open_transfer_if_connected(plan.targets[self.rank])
        except Exception as exc:  # anything: the request must still be reported, or its blocks stay held
            send.error = exc

    def layer(self, index: int) -> None:
        if not self._step:
            return
        if self._cuda:
            torch.cuda.current_stream().synchronize()  # the layer's KV is written before a frame reads it
        for send in self._step:
            if send.transfer is not None and send.error is None:
                if send.started is None:
                    send.started = time.monotonic()
                try:
                    send.transfer.send_layers(send.plan.src_block_ids, index)
                except PdRouterError as exc:
                    send.error = exc  # failed meanwhile (receiver gone, aborted): the finish reports it

    def step_done(self) -> None:
        sends, self._step = self._step, []
        for send in sends:
            self._io.spawn(self._finish(send))

    # -- I/O loop -------------------------------------------------------------------------------------
    async def _finish(self, send: _Send) -> None:
        plan = send.plan
        transfer = send.transfer
        try:
            if send.error is not None:
                raise send.error
            if transfer is None:  # not connected before the pass: dial now, send every layer at once
                loop = asyncio.get_running_loop()
                transfer = await loop.run_in_executor(None, self.sender.open_transfer, plan.targets[self.rank])
                send.transfer = transfer
                send.started = time.monotonic()
                transfer.send_layers(plan.src_block_ids)
            await transfer.finish_async(timeout=plan.hold_s)
            outcome = Outcome(True, transfer.bytes_queued, time.monotonic() - (send.started or time.monotonic()))
        except Exception as exc:  # anything: the request must still be reported, or its blocks stay held
            if transfer is not None and not transfer.state.terminal:
                transfer.abort(str(exc))
            nbytes = transfer.bytes_queued if transfer is not None else 0
            outcome = Outcome.failed(exc, nbytes, time.monotonic() - (send.started or time.monotonic()))
            log.info("request %s: KV send failed: %s", plan.key, outcome.message)
        self._reports.sent(plan.req_id)
        self._post(Sent(plan.key, self.rank, outcome))
