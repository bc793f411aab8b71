"""The bounded wait queue of requests waiting for KV room: priority classes, then fair shares, then arrival.

The order, strictly in this precedence:

1. **priority class**: a waiter of a higher ``priority`` is always served before any of a lower one;
2. **weighted fair share** among the *flows* (tenants) of a class: start-time fair queueing (Goyal,
   Vin and Cheng, 1996) with a bounded burst credit. Each waiter gets a virtual start tag
   ``S = max(V - burst × cost / weight, F_prev(flow))`` and its flow's finish moves to
   ``F_prev(flow) = S + cost / weight``, where ``V`` is the start tag of the class's waiter served
   last; the smallest start tag goes first. A flow that keeps a backlog is served ``weight / Σ
   weights`` of the cost (KV blocks) admitted while the others also wait (its tags run ahead of
   ``V`` and the credit never applies). A flow that has been asking for less than its share
   arrives with a start tag behind ``V``, so it is served before the backlogs, for up to ``burst``
   of its requests in a row (and one more starting at ``V``): a tenant under its share waits for
   its own earlier requests, not for a round of the others'. That round is what ordering by finish
   tags, or starting at ``V``, costs it (docs/tenants.md has the figures);
3. **arrival order** among equal tags.

A flow is charged only for what is served: a waiter that leaves without being admitted (pushed out
of a full queue, timed out, cancelled) gives its charge back, as if it had never joined: the tags
of its flow's later waiters of the class are computed again without it. Otherwise a flow whose
waiters are pushed out or time out would pay for admissions it never got, and fall further behind
at every one (under a flood, the flows of the smallest weights, whose waiters are the ones pushed
out).

One flow alone is served exactly in arrival order within each class (its tags only grow: its
finish is never behind ``V`` less its credit), which is what the queue did before it knew flows;
without tenants every request is one flow.

When the queue is full (``limit`` waiters), a newcomer that would be served before the waiter
served last (its class is higher, or its fair-share tag is smaller) takes that waiter's place,
and the waiter pushed out is told so (``Waiter.evicted``, its ``wake`` set); any other newcomer is
refused. So a flooding tenant's backlog fills the queue without locking the others out of it, and
with a single flow a full queue refuses newcomers, as before.

Nothing here touches Redis: the owner decides what "room" is and wakes the head when some comes back.
"""

from __future__ import annotations

import asyncio
import contextlib
import heapq
import itertools
from collections.abc import Hashable
from dataclasses import dataclass, field

BURST = 8.0
"""A flow's credit, in its own requests: how far ahead of the virtual time a flow that has been
asking for less than its share may start (see the module docstring)."""


@dataclass(order=True)
class Waiter:
    """One waiting request's place in the queue; ``wake`` is set when it should look for room."""

    priority: int
    """Its class, negated (the heap's smallest first)."""
    tag: float
    """Its virtual start tag within the class."""
    seq: int
    flow: Hashable = field(compare=False, default=None)
    floor: float = field(compare=False, default=0.0)
    """The earliest start it could have: its class's virtual time when it joined, less its credit."""
    charge: float = field(compare=False, default=0.0)
    """Its cost ÷ its flow's weight (its flow's finish is its start plus this)."""
    wake: asyncio.Event = field(compare=False, default_factory=asyncio.Event)
    evicted: bool = field(compare=False, default=False)
    """Pushed out of a full queue by a waiter served before it (the owner refuses the request)."""


class WaitQueue:
    """Requests waiting for room, served one at a time from the head (see the module docstring).

    ``join`` places a waiter (or returns None when the queue is full and it would not be served
    before the last waiter), ``is_head`` tells whether it is its turn, ``wait`` sleeps until it is
    woken or the timeout passes, and ``leave`` takes it out (``served``: it was admitted, which
    moves its class's virtual time) and wakes the new head.
    """

    __slots__ = ("_finish", "_flows", "_heap", "_seq", "_vtime", "burst", "limit")

    def __init__(self, limit: int, burst: float = BURST) -> None:
        if burst < 0:
            raise ValueError(f"burst must be >= 0, got {burst:g}")
        self.limit = limit
        self.burst = burst
        self._heap: list[Waiter] = []
        self._seq = itertools.count()
        self._vtime: dict[int, float] = {}
        """Per class: the start tag of the waiter last served."""
        self._finish: dict[tuple[int, Hashable], float] = {}
        """Per class and flow: its last waiter's start tag plus its charge (bounded by the classes
        and flows seen since the queue was last empty)."""
        self._flows: dict[Hashable, list[Waiter]] = {}
        """Each flow's waiters (flows with none are dropped)."""

    def __len__(self) -> int:
        return len(self._heap)

    def waiting(self, flow: Hashable) -> int:
        """Waiters of ``flow`` in the queue."""
        waiters = self._flows.get(flow)
        return 0 if waiters is None else len(waiters)

    def over_share(self, flow: Hashable, priority: int, admitted: int = 0) -> bool:
        """Whether ``flow`` has a backlog of class ``priority`` past its share by more than its credit:
        more than ``burst`` of its requests queued (``admitted``: and that many just served, gone
        from the queue), the last of them starting more than ``burst`` of its requests after the
        class's virtual time. (Credit is how far a flow's arrivals may run ahead of its share; the
        same margin the other way tells a flow that sends at its share, whose Poisson arrivals queue
        a few past it at times, from one that asks for more and keeps a backlog.)

        Both, because requests differ in size: with one large request of a flow queued, its next
        small one starts the large one's cost past the virtual time, far past a credit counted in
        small requests, though two requests are no backlog. (With one size, a last tag past the
        credit already means more than ``burst`` waiting: a flow's first waiter starts at most one
        request past the virtual time, the largest tag served.)"""
        cls = -priority
        mine = [w for w in self._flows.get(flow, ()) if w.priority == cls]
        if not mine or len(mine) + admitted <= self.burst:
            return False
        last = mine[-1]
        return last.tag > self._vtime.get(cls, 0.0) + self.burst * last.charge

    @property
    def head(self) -> Waiter | None:
        return self._heap[0] if self._heap else None

    @property
    def full(self) -> bool:
        return len(self._heap) >= self.limit

    def join(self, priority: int = 0, flow: Hashable = None, weight: float = 1.0, cost: float = 1.0) -> Waiter | None:
        """Queue a waiter of ``flow`` (None: the one flow of requests without a tenant) costing ``cost``
        (KV blocks); a higher ``priority`` goes ahead of every lower one already waiting.

        None when the queue is full and the waiter would not be served before the last one; when
        it would, the last one is pushed out (``evicted``) and the newcomer joins."""
        cls = -priority
        key = (cls, flow)
        charge = cost / weight
        floor = self._vtime.get(cls, 0.0) - self.burst * charge
        waiter = Waiter(cls, max(floor, self._finish.get(key, floor)), next(self._seq), flow, floor, charge)
        if self.full:
            if not self._heap:
                return None
            last = max(self._heap)
            if not waiter < last:
                return None
            self._heap.remove(last)
            self._forget(last)
            self._uncharge(last)
            heapq.heapify(self._heap)
            last.evicted = True
            last.wake.set()
            if last.flow == flow and last.priority == cls:  # its charge is back: the newcomer's tag moves too
                waiter.tag = max(floor, self._finish.get(key, floor))
        self._finish[key] = waiter.tag + charge
        heapq.heappush(self._heap, waiter)
        self._flows.setdefault(flow, []).append(waiter)
        return waiter

    def _forget(self, waiter: Waiter) -> None:
        waiters = self._flows.get(waiter.flow)
        if waiters is not None and waiter in waiters:
            waiters.remove(waiter)
            if not waiters:
                del self._flows[waiter.flow]

    def _uncharge(self, gone: Waiter) -> None:
        """``gone`` left unserved: its flow's later waiters of its class (and the flow's finish) are
        tagged again as if it had never joined. Call once ``gone`` is out of the heap and the flow."""
        key = (gone.priority, gone.flow)
        if key not in self._finish:
            return
        finish = gone.tag  # the flow's finish before it joined (or its floor then)
        if gone.tag + gone.charge < self._finish[key]:  # not the flow's last
            later = [w for w in self._flows.get(gone.flow, ()) if w.priority == gone.priority and w.seq > gone.seq]
            if not later:  # the later ones were admitted already: they keep the finish they set
                return
            for waiter in later:
                waiter.tag = max(waiter.floor, finish)
                finish = waiter.tag + waiter.charge
        self._finish[key] = finish

    def is_head(self, waiter: Waiter) -> bool:
        return bool(self._heap) and self._heap[0] is waiter

    def leads_its_flow(self, waiter: Waiter) -> bool:
        """Whether ``waiter`` is the first of its flow's waiters (a flow's waiters join in its order)."""
        waiters = self._flows.get(waiter.flow)
        return waiters is not None and waiters[0] is waiter

    async def wait(self, waiter: Waiter, timeout: float) -> None:
        """Sleep until ``waiter`` is woken (after this call began) or ``timeout`` seconds pass."""
        waiter.wake.clear()
        if waiter.evicted:
            return
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(waiter.wake.wait(), timeout)

    def leave(self, waiter: Waiter, served: bool = False) -> None:
        """Take ``waiter`` out (nothing if it is not queued) and wake whoever is the head now.
        ``served``: it was admitted; its class's virtual time moves to its start tag."""
        if served:
            self._vtime[waiter.priority] = max(self._vtime.get(waiter.priority, 0.0), waiter.tag)
        if waiter in self._heap:
            if self._heap[0] is waiter:
                heapq.heappop(self._heap)
                self._forget(waiter)
                if not served:
                    self._uncharge(waiter)
                    heapq.heapify(self._heap)
            else:
                self._heap.remove(waiter)
                self._forget(waiter)
                if not served:
                    self._uncharge(waiter)
                heapq.heapify(self._heap)
        if not self._heap:  # idle: every flow starts afresh (and the bookkeeping stays small)
            self._vtime.clear()
            self._finish.clear()
        self.wake_head()

    def wake_head(self) -> None:
        """Room may have come back: the head looks again, and so does every flow's first waiter (with
        several flows waiting: a head whose tenant is held back from the last room is not the only
        one that may take it, see ``Admission``). Waiters behind those are not woken: they cannot
        book before the ones ahead of them."""
        if self._heap:
            self._heap[0].wake.set()
            if len(self._flows) > 1:
                for waiters in self._flows.values():
                    waiters[0].wake.set()
