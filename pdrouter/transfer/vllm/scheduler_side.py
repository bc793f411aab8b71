"""The connector's scheduler side: which requests take their KV from outside, which send it, when blocks go.

Runs in vLLM's engine-core process, called by vLLM's scheduler (single-threaded). It reads each
request's order (``pdrouter.transfer.vllm.orders``) and turns what the scheduler did into the
step's ``StepPlan`` for the worker side. Pure bookkeeping: it imports no vLLM and no torch.

Decode engine (``ReceiveOrder``):

* ``matched_tokens``: the prompt tokens not cached here come from outside (loaded asynchronously),
  unless at most ``local_prefill_tokens`` of them remain: then the prompt is computed here.
* ``after_alloc``: vLLM reserved the request's blocks; a ``ReceivePlan`` names them (and how many
  leading ones are already cached here), or a ``LocalPlan`` says the prompt is computed here.
  Decided once per request: after a preemption the prompt is computed here.
* ``finished``: a request that ends before its KV was reported landed gets a ``Cancel``; vLLM keeps
  its blocks until the worker side reports it finished receiving.

Prefill engine (``SendOrder``):

* ``build``: in the step whose forward pass completes the prompt, a ``SendPlan`` names its blocks;
  the worker side pushes them layer by layer as that pass computes them.
* ``finished``: a request whose blocks are being sent keeps them (``True``) until the worker side
  reports it finished sending (confirmed, failed, or its hold ran out).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, Protocol

from pdrouter.core.disaggregation import computes_locally
from pdrouter.core.errors import InvalidRequestError
from pdrouter.transfer.vllm.orders import Order, ReceiveOrder, SendOrder, order_from_params
from pdrouter.transfer.vllm.step_plan import Cancel, LocalPlan, ReceivePlan, SendPlan, StepPlan

log = logging.getLogger("vllm.pdrouter.connector")


class RequestView(Protocol):
    """What the scheduler side reads of vLLM's ``Request``."""

    @property
    def request_id(self) -> str: ...

    @property
    def num_prompt_tokens(self) -> int: ...

    @property
    def num_computed_tokens(self) -> int: ...

    @property
    def kv_transfer_params(self) -> dict[str, Any] | None: ...


class SchedulerSide:
    """The scheduler's half of one engine's connector (see the module docstring)."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self._matched: dict[str, int] = {}
        """Receive requests: the block-aligned local hit vLLM last asked about."""
        self._settled: set[str] = set()
        """Receive requests already placed (KV invited, or computed here)."""
        self._receiving: dict[str, str] = {}
        """Receive requests whose KV is invited and not yet reported landed: req id → key."""
        self._pending_sends: dict[str, tuple[SendOrder, RequestView]] = {}
        """Send requests whose prompt is not complete yet."""
        self._sending: set[str] = set()
        """Send requests whose ``SendPlan`` went out: their blocks are read until the worker reports."""
        self._receives: list[ReceivePlan] = []
        self._locals: list[LocalPlan] = []
        self._cancels: list[Cancel] = []
        self._bad: set[str] = set()

    # -- vLLM's scheduler hooks ---------------------------------------------------------------------
    def matched_tokens(self, request: RequestView, num_computed_tokens: int) -> tuple[int, bool]:
        """(tokens loaded from outside, asynchronously?) for a request not started yet."""
        order = self._order(request)
        rid = request.request_id
        if not isinstance(order, ReceiveOrder) or rid in self._settled:
            return 0, False
        self._matched[rid] = num_computed_tokens
        if computes_locally(request.num_prompt_tokens, num_computed_tokens, order.local_prefill_tokens):
            return 0, False
        return request.num_prompt_tokens - num_computed_tokens, True

    def after_alloc(self, request: RequestView, block_ids: Sequence[int], num_external_tokens: int) -> None:
        """vLLM allocated ``block_ids`` (the request's whole block table) for the request."""
        order = self._order(request)
        rid = request.request_id
        if isinstance(order, SendOrder):
            if rid not in self._sending:
                self._pending_sends.setdefault(rid, (order, request))
            return
        if not isinstance(order, ReceiveOrder) or rid in self._settled:
            return
        self._settled.add(rid)
        cached = self._matched.pop(rid, 0)
        if num_external_tokens <= 0:
            self._locals.append(LocalPlan(order.key, cached))
            return
        blocks = tuple(int(b) for b in block_ids[:self.blocks_of(request.num_prompt_tokens)])
        self._receives.append(ReceivePlan(rid, order.key, blocks, cached // self.block_size, order.timeout_s))
        self._receiving[rid] = order.key

    def build(self, scheduled: Mapping[str, int], block_ids_of: Callable[[str], Sequence[int]]) -> StepPlan:
        """This step's plan; ``scheduled``: tokens scheduled per request (before they are counted computed)."""
        sends = []
        for rid, (order, request) in list(self._pending_sends.items()):
            count = scheduled.get(rid, 0)
            if count and request.num_computed_tokens + count >= request.num_prompt_tokens:
                blocks = tuple(int(b) for b in block_ids_of(rid)[:self.blocks_of(request.num_prompt_tokens)])
                sends.append(SendPlan(rid, order.key, order.targets, blocks, order.hold_s))
                del self._pending_sends[rid]
                self._sending.add(rid)
        plan = StepPlan(tuple(self._receives), tuple(self._locals), tuple(sends), tuple(self._cancels))
        self._receives.clear()
        self._locals.clear()
        self._cancels.clear()
        return plan

    def transfers_reported(self, finished_recving: Iterable[str]) -> None:
        """The worker side reported these requests' receives over (landed, failed or cancelled)."""
        for rid in finished_recving:
            self._receiving.pop(rid, None)

    def finished(self, request: RequestView) -> bool:
        """The request ended in vLLM; True: keep its blocks until the worker reports it finished sending."""
        rid = request.request_id
        self._matched.pop(rid, None)
        self._settled.discard(rid)
        self._pending_sends.pop(rid, None)
        self._bad.discard(rid)
        key = self._receiving.pop(rid, None)
        if key is not None:
            self._cancels.append(Cancel(rid, key))
        if rid in self._sending:
            self._sending.discard(rid)
            return True
        return False

    # -- helpers ------------------------------------------------------------------------------------
    def blocks_of(self, tokens: int) -> int:
        return -(-tokens // self.block_size)

    def _order(self, request: RequestView) -> Order | None:
        try:
            return order_from_params(request.kv_transfer_params)
        except InvalidRequestError as exc:
            # The worker builds every order; a malformed one runs the request as a plain one
            # rather than stopping the engine.
            if request.request_id not in self._bad:
                self._bad.add(request.request_id)
                log.warning("request %s: ignoring its kv_transfer_params: %s", request.request_id, exc.message)
            return None
