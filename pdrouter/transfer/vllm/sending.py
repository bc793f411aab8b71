"""The prefill half of the worker side: push a computed prompt's blocks into the decode engine's.

The engine thread drives it through one forward pass: ``plan`` (before the pass: open the
transfer when a connection to the receiver is up), ``layer`` (as each attention layer has
written its KV: queue that layer's frames, which the sender's thread puts on the wire while the
next layers compute), ``step_done`` (after the pass: hand the transfer to a waiter thread). The
waiter waits for the receiver's confirmation, at most the order's ``hold_s``, then reports the
request so vLLM frees its blocks: they are read until then and never longer.

With no connection to the receiver yet (the first request to a decode engine), nothing may dial
on the engine thread: the waiter thread dials, then sends every layer at once after the pass.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch

from pdrouter.core.errors import InvalidRequestError, PdRouterError
from pdrouter.transfer.outgoing import OutgoingTransfer
from pdrouter.transfer.sender import KvSender
from pdrouter.transfer.vllm.channel import Message, Outcome, Sent
from pdrouter.transfer.vllm.reports import Reports
from pdrouter.transfer.vllm.step_plan import SendPlan

log = logging.getLogger("vllm.pdrouter.connector")

WAITERS = 64
"""Threads waiting for receivers' confirmations: sends in flight at once, beyond which they queue."""


@dataclass(slots=True)
class _Send:
    plan: SendPlan
    transfer: OutgoingTransfer | None = None
    error: Exception | None = None
    started: float | None = None
    """When its first frames were queued (the transfer's window starts)."""
    computed: float = 0.0
    """When the forward pass that computed the prompt ended."""


class Sends:
    """The sends of one rank (see the module docstring)."""

    def __init__(self, sender: KvSender, rank: int, post: Callable[[Message], None], reports: Reports, *,
                 cuda: bool) -> None:
        self.sender = sender
        self.rank = rank
        self._post = post
        self._reports = reports
        self._cuda = cuda
        self._step: list[_Send] = []
        self._waiters = ThreadPoolExecutor(max_workers=WAITERS, thread_name_prefix=f"pdrouter-kv-send{rank}")

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
        now = time.monotonic()
        for send in sends:
            send.computed = now
            self._waiters.submit(self._finish, send)

    def close(self) -> None:
        """Stop the waiter threads (after the sender closed: its transfers have failed)."""
        self._waiters.shutdown(wait=False, cancel_futures=True)

    # -- waiter threads ---------------------------------------------------------------------------------
    def _finish(self, send: _Send) -> None:
        self._post(Sent(send.plan.key, self.rank, self._confirm(send)))

    def _confirm(self, send: _Send) -> Outcome:
        """Finish the transfer (dial first when not connected yet) and wait for the receiver's
        confirmation: the waiter wakes the moment it lands, and reports the request over from there
        (vLLM frees its blocks at its next step)."""
        plan = send.plan
        transfer = send.transfer
        try:
            if send.error is not None:
                raise send.error
            if transfer is None:  # not connected before the pass: dial now, send every layer at once
                transfer = self.sender.open_transfer(plan.targets[self.rank])
                send.transfer = transfer
                send.started = time.monotonic()
                transfer.send_layers(plan.src_block_ids)
            transfer.finish(timeout=plan.hold_s)
            done = time.monotonic()
            outcome = Outcome(True, transfer.bytes_queued, done - (send.started or done), tail_s=done - send.computed)
        except Exception as exc:  # anything: the request must still be reported, or its blocks stay held
            if transfer is not None and not transfer.state.terminal:
                transfer.abort(str(exc))
            nbytes = transfer.bytes_queued if transfer is not None else 0
            outcome = Outcome.failed(exc, nbytes, time.monotonic() - (send.started or time.monotonic()))
            log.info("request %s: KV send failed: %s", plan.key, outcome.message)
        self._reports.sent(plan.req_id)
        return outcome
