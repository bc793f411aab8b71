"""The admission queue's order: priority classes strictly, then weighted fair shares across tenants,
then arrival; one tenant alone in arrival order, exactly as before tenants existed."""

from __future__ import annotations

import random
from collections import Counter

from pdrouter.router.admission.queue import Waiter, WaitQueue


def _drain(queue: WaitQueue, n: int | None = None) -> list[Waiter]:
    """Serve the head ``n`` times (all by default), as admission does: served, then out."""
    out: list[Waiter] = []
    while len(queue) and (n is None or len(out) < n):
        head = queue._heap[0]
        assert queue.is_head(head)
        queue.leave(head, served=True)
        out.append(head)
    return out


def _joined(queue: WaitQueue, *args: object, **kw: object) -> Waiter:
    waiter = queue.join(*args, **kw)  # type: ignore[arg-type]
    assert waiter is not None
    return waiter


def test_one_tenant_alone_is_served_in_arrival_order_whatever_the_sizes() -> None:
    rng = random.Random(3)
    for flow in (None, "team-a"):
        queue = WaitQueue(limit=1000)
        waiters = [_joined(queue, 0, flow, 2.5, rng.randint(1, 40)) for _ in range(200)]
        # Serve some, let more arrive, serve the rest: still arrival order.
        served = _drain(queue, 50)
        waiters += [_joined(queue, 0, flow, 2.5, rng.randint(1, 40)) for _ in range(100)]
        served += _drain(queue)
        assert served == waiters


def test_a_higher_priority_class_always_goes_first() -> None:
    queue = WaitQueue(limit=100)
    batch = [_joined(queue, -1, "batch-team") for _ in range(5)]
    standard = [_joined(queue, 0, "flooder", 10.0) for _ in range(5)]
    urgent = _joined(queue, 1, "ops")
    assert queue.is_head(urgent)
    assert _drain(queue) == [urgent, *standard, *batch]


def test_backlogged_tenants_are_served_in_proportion_to_their_weights() -> None:
    queue = WaitQueue(limit=10_000)
    weights = {"a": 1.0, "b": 2.0, "c": 3.0}
    for _ in range(600):
        for flow, w in weights.items():
            _joined(queue, 0, flow, w, 4)
    served = Counter(w.flow for w in _drain(queue, 600))  # the first 600 served, every tenant still waiting
    for flow, w in weights.items():
        assert abs(served[flow] / 600 - w / 6) < 0.01, served


def test_a_burst_does_not_delay_a_tenant_arriving_later() -> None:
    queue = WaitQueue(limit=10_000)
    burst = [_joined(queue, 0, "flooder", 1.0, 4) for _ in range(500)]
    _drain(queue, 10)
    late = _joined(queue, 0, "quiet", 1.0, 4)
    order = _drain(queue)
    assert order.index(late) <= 1  # at most one of the burst's waiters goes before it
    assert [w for w in order if w is not late] == burst[10:]  # the burst keeps its own order


def test_a_full_queue_pushes_out_the_waiter_served_last_for_one_served_sooner() -> None:
    queue = WaitQueue(limit=4)
    flood = [_joined(queue, 0, "flooder", 1.0, 4) for _ in range(4)]
    assert queue.full
    # Another of the flooder's would be served last: refused, nobody pushed out.
    assert queue.join(0, "flooder", 1.0, 4) is None
    assert not any(w.evicted for w in flood)
    # A quiet tenant's would be served first: the flooder's newest waiter makes room, and is told.
    quiet = _joined(queue, 0, "quiet", 1.0, 4)
    assert flood[-1].evicted and flood[-1].wake.is_set() and len(queue) == 4
    assert _drain(queue)[:2] == [flood[0], quiet]
    # Without tenants (one flow) a full queue refuses newcomers, as it always did.
    plain = WaitQueue(limit=2)
    first, second = _joined(plain), _joined(plain)
    assert plain.join() is None and not first.evicted and not second.evicted


def test_bookkeeping_is_forgotten_when_the_queue_empties() -> None:
    queue = WaitQueue(limit=100)
    for i in range(30):
        _joined(queue, i % 3, f"t{i}")
    _drain(queue)
    assert queue._finish == {} and queue._vtime == {}


def test_a_waiter_leaving_unserved_gives_its_flows_charge_back() -> None:
    queue = WaitQueue(limit=100, burst=0)  # no credit: the start tags are the virtual time's
    flood = [_joined(queue, 0, "flooder", 1.0, 4) for _ in range(10)]
    first, second, third = (_joined(queue, 0, "quiet", 1.0, 4) for _ in range(3))
    assert (first.tag, second.tag, third.tag) == (0.0, 4.0, 8.0)
    queue.leave(first)  # timed out, say: "quiet" is charged for the two still waiting only
    assert (second.tag, third.tag) == (0.0, 4.0)
    queue.leave(third)
    assert _joined(queue, 0, "quiet", 1.0, 4).tag == 4.0
    # Served waiters keep their charge.
    served = _drain(queue, 2)
    assert served == [flood[0], second]
    assert _joined(queue, 0, "quiet", 1.0, 4).tag == 8.0


def test_a_quiet_tenant_goes_ahead_of_a_backlog_for_its_burst_credit_and_no_further() -> None:
    queue = WaitQueue(limit=1000, burst=3)
    flood = [_joined(queue, 0, "flooder", 1.0, 4) for _ in range(100)]
    _drain(queue, 20)
    quiet = [_joined(queue, 0, "quiet", 1.0, 4) for _ in range(8)]
    order = _drain(queue, 16)
    # Its credit's three requests, and one starting at the virtual time, before the backlog's next.
    assert order[:4] == quiet[:4]
    # Then the two alternate as their equal weights say, each in its own order.
    assert order[4:] == [flood[20], quiet[4], flood[21], quiet[5], flood[22], quiet[6], flood[23], quiet[7],
                         flood[24], flood[25], flood[26], flood[27]]


def _wait_beside_a_flood(queue: WaitQueue, quiet_rate: float, ticks: int = 6000) -> list[int]:
    """A model of admission under a flood: one waiter admitted per tick; tenant "flood" (weight 2)
    sends 10 a tick, "b" and "c" (weight 1 each, a quarter of the admissions their fair share)
    ``quiet_rate`` a tick each; a waiter leaves unserved after 35 ticks. The ticks ``b``'s and
    ``c``'s admitted waiters waited."""
    rng = random.Random(1)
    joined: dict[int, tuple[int, Waiter]] = {}
    waits: list[int] = []
    for tick in range(ticks):
        arrivals = [("flood", 2.0)] * 10 + [(f, 1.0) for f in "bc" if rng.random() < quiet_rate]
        for flow, weight in arrivals:
            waiter = queue.join(0, flow, weight, 4)
            if waiter is not None:
                joined[id(waiter)] = (tick, waiter)
        for key, (since, waiter) in list(joined.items()):
            if waiter.evicted:
                del joined[key]
            elif tick - since > 35:
                del joined[key]
                queue.leave(waiter)
        head = queue.head
        if head is not None:
            since, _ = joined.pop(id(head))
            queue.leave(head, served=True)
            if head.flow != "flood" and tick > 500:
                waits.append(tick - since)
    return waits


def test_a_tenant_under_its_share_waits_for_hardly_anyone_beside_a_flood() -> None:
    """Beside a tenant flooding the queue (its waiters timing out by the hundred, each giving its
    charge back), tenants sending at 0.4 and 0.8 of their fair share wait for 0.1 and 0.5 ticks on
    average. Without the credit (their arrivals start at the virtual time, behind the flood's waiter
    there and as much of the flood as their own bursts) they wait 0.7 and 4.9."""
    for rate, mean_bound, p99_bound in ((0.1, 0.25, 2), (0.2, 1.0, 16)):
        waits = sorted(_wait_beside_a_flood(WaitQueue(limit=32), rate))
        without_credit = sorted(_wait_beside_a_flood(WaitQueue(limit=32, burst=0), rate))
        mean, p99 = sum(waits) / len(waits), waits[len(waits) * 99 // 100]
        assert mean <= mean_bound and p99 <= p99_bound, (rate, mean, p99)
        assert mean * 4 < sum(without_credit) / len(without_credit), (rate, mean, without_credit)


def test_a_flood_pushing_out_waiters_does_not_cost_the_others_their_shares() -> None:
    """Three tenants flooding a full queue (weights 2 : 1 : 1, the same arrivals each): the waiters
    pushed out are the smaller weights' (their tags grow faster), and pushed-out waiters are not
    charged, so admissions still follow the weights."""
    queue = WaitQueue(limit=32)
    weights = {"a": 2.0, "b": 1.0, "c": 1.0}
    served: Counter[object] = Counter()
    rng = random.Random(5)
    for step in range(6000):
        flow = rng.choice(list(weights))
        queue.join(0, flow, weights[flow], 4)
        if step % 3 == 2:  # arrivals at three times the rate of service
            head = queue._heap[0]
            queue.leave(head, served=True)
            if step > 600:
                served[head.flow] += 1
    total = sum(served.values())
    for flow, w in weights.items():
        assert abs(served[flow] / total - w / 4) / (w / 4) < 0.03, served


def test_over_its_share_takes_a_backlog_past_the_credit_not_one_large_request() -> None:
    """Tenant b, served once, waits with one large request and one small one: its small one's tag starts the
    large one's cost past the virtual time, far past its credit in small requests, yet two requests
    are no backlog past a credit of two. A flood's three past the credit are."""
    queue = WaitQueue(limit=100, burst=2)
    flood = [_joined(queue, 0, "flood", 1.0, 4) for _ in range(6)]
    _drain(queue, 1)
    first = _joined(queue, 0, "b", 1.0, 4)
    assert _drain(queue, 1) == [first]  # within its credit: served at once
    _joined(queue, 0, "b", 1.0, 40)
    small = _joined(queue, 0, "b", 1.0, 1)
    assert small.tag > queue._vtime[0] + 2 * small.charge  # by its tags alone it would be past its credit
    assert not queue.over_share("b", 0)
    assert queue.over_share("b", 0, admitted=1)  # a third just admitted: three past a credit of two
    assert queue.over_share("flood", 0) and len(flood) - 1 > queue.burst
