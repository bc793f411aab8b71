"""Scheduler decisions without a model: chunk sizes, decode priority, admission, preemption order."""

from __future__ import annotations

from pdrouter.core.hashing import BlockHasher
from pdrouter.core.ids import RequestId
from pdrouter.core.sampling import SamplingParams
from pdrouter.engine.block_manager import BlockManager
from pdrouter.engine.outputs import FinishReason
from pdrouter.engine.request import Request, RequestKind, RequestState
from pdrouter.engine.scheduler import ScheduledWork, Scheduler

BS = 4


def make(num_blocks: int = 16, budget: int = 8, max_seqs: int = 8) -> Scheduler:
    return Scheduler(BlockManager(num_blocks, BS), BlockHasher(BS), max_seqs, budget)


def request(name: str, prompt_len: int, max_tokens: int = 4, base: int = 0) -> Request:
    return Request(RequestId(name), tuple(range(base, base + prompt_len)), SamplingParams(max_tokens=max_tokens),
                   RequestKind.GENERATE, frozenset(), max_context=1024)


def finish_step(s: Scheduler, work: list[ScheduledWork], token: int = 7) -> None:
    """What the engine does after the model ran: count tokens, append a sampled token, retire."""
    for w in work:
        s.advance(w)
        if w.samples and w.request.append_token(token) is FinishReason.LENGTH:
            s.remove(w.request)
            s.release_blocks(w.request)
            w.request.transition(RequestState.FINISHED)


def plan(work: list[ScheduledWork]) -> list[tuple[str, int, int, bool]]:
    return [(w.request.request_id, w.start, w.num_tokens, w.samples) for w in work]


def test_long_prompt_is_chunked_under_the_budget() -> None:
    s = make(budget=8)
    s.add_waiting(request("a", 19))
    chunks = []
    for _ in range(3):
        work = s.schedule()
        chunks += plan(work)
        finish_step(s, work)
    assert chunks == [("a", 0, 8, False), ("a", 8, 8, False), ("a", 16, 3, True)]
    assert s.running[0].num_computed_tokens == 19 and len(s.running[0].block_ids) == 5


def test_decodes_go_first_and_prefills_take_the_rest() -> None:
    s = make(budget=8)
    s.add_waiting(request("a", 3))
    finish_step(s, s.schedule())
    s.add_waiting(request("b", 20, base=100))
    s.add_waiting(request("c", 5, base=200))
    work = s.schedule()
    assert plan(work) == [("a", 3, 1, True), ("b", 0, 7, False)]
    finish_step(s, work)
    assert plan(s.schedule()) == [("a", 4, 1, True), ("b", 7, 7, False)]


def test_admission_reuses_the_cache_but_recomputes_the_last_token() -> None:
    s = make(budget=64)
    s.add_waiting(request("a", 8))
    finish_step(s, s.schedule())  # both blocks of "a" are now cached
    s.add_waiting(request("b", 8))
    s.add_waiting(request("c", 9))
    work = s.schedule()
    # "b" equals "a": only its first block can be a hit, its last block is computed again;
    # "c" extends "a": both blocks hit, one token left.
    assert plan(work)[1:] == [("b", 4, 4, True), ("c", 8, 1, True)]
    b, c = work[1].request, work[2].request
    assert (b.num_cached_tokens, c.num_cached_tokens) == (4, 8)
    assert b.block_ids[0] == c.block_ids[0] == s.running[0].block_ids[0]
    assert s.blocks.ref_count(b.block_ids[0]) == 3


def test_max_num_seqs_limits_admission() -> None:
    s = make(budget=64, max_seqs=2)
    for name in "abc":
        s.add_waiting(request(name, 2, base=ord(name) * 10))
    assert [w.request.request_id for w in s.schedule()] == ["a", "b"]
    assert [r.request_id for r in s.waiting] == ["c"]


def test_the_latest_admitted_request_is_preempted_and_requeued_first() -> None:
    s = make(num_blocks=4, budget=64)
    a, b = request("a", 8, max_tokens=2), request("b", 8, max_tokens=10, base=50)
    s.add_waiting(a)
    s.add_waiting(b)
    finish_step(s, s.schedule())  # a and b: 8 prompt tokens (2 blocks each) + 1 sampled: pool full
    assert s.blocks.num_free_blocks == 0
    work = s.schedule()  # a needs a third block for its 9th token: b, admitted last, must go
    assert plan(work) == [("a", 8, 1, True)]
    assert (b.state, b.block_ids, b.num_computed_tokens, b.num_preemptions) == (RequestState.WAITING, [], 0, 1)
    assert list(s.waiting) == [b] and s.running == [a] and s.num_preemptions == 1
    finish_step(s, work)  # a finishes
    # b is readmitted and recomputes its prompt and the token it had generated. Its blocks were
    # released tail first, so a's growth evicted b's second block; its first block is still a hit.
    assert a.state is RequestState.FINISHED
    assert plan(s.schedule()) == [("b", 4, 5, True)]
    assert b.num_cached_tokens == 0  # reported from the first admission


def test_a_request_that_cannot_grow_preempts_itself() -> None:
    s = make(num_blocks=2, budget=64)
    held = s.blocks.allocate([], 4)  # someone else (a held prefill) owns a block
    assert held is not None
    a = request("a", 4, max_tokens=10)
    s.add_waiting(a)
    finish_step(s, s.schedule())
    assert s.schedule() == []  # a needs a second block: it preempts itself
    assert a.state is RequestState.WAITING and s.blocks.num_free_blocks == 1
    s.blocks.free(held.block_ids)
    assert plan(s.schedule()) == [("a", 4, 1, True)]  # its own full block survived as a cache hit


def prioritized(name: str, prompt_len: int, priority: int, base: int = 0, max_tokens: int = 4) -> Request:
    req = request(name, prompt_len, max_tokens=max_tokens, base=base)
    req.priority = priority
    return req


def test_a_waiting_prompt_of_a_lower_value_takes_the_next_step_from_a_chunked_one() -> None:
    s = make(num_blocks=32, budget=8)
    s.add_waiting(prioritized("flood", 24, 1))
    s.add_waiting(prioritized("flood2", 24, 1, base=100))
    assert plan(s.schedule()) == [("flood", 0, 8, False)]
    s.running[0].num_computed_tokens = 8  # the step ran
    s.add_waiting(prioritized("fair", 6, 0, base=200))
    # The fair prompt arrives behind two of the flood's: it is computed in the very next step, ahead
    # of the flood's next chunk, which takes what is left of the budget; the second flood prompt waits.
    assert plan(s.schedule()) == [("fair", 0, 6, True), ("flood", 8, 2, False)]
    assert [r.request_id for r in s.waiting] == ["flood2"]


def test_waiting_prompts_are_admitted_by_priority_then_in_arrival_order() -> None:
    s = make(budget=64)
    for name, prio in (("b1", 2), ("a1", 0), ("b2", 2), ("a2", 0), ("c", -1)):
        s.add_waiting(prioritized(name, 2, prio, base=ord(name[0]) * 10 + len(s.waiting)))
    assert [w.request.request_id for w in s.schedule()] == ["c", "a1", "a2", "b1", "b2"]


def test_equal_priorities_keep_first_come_first_served() -> None:
    s = make(num_blocks=32, budget=8)
    for i, name in enumerate("abc"):
        s.add_waiting(prioritized(name, 12, 5, base=i * 100))
    seen = []
    for _ in range(5):
        work = s.schedule()
        seen += [(w.request.request_id, w.num_tokens) for w in work if not w.samples or w.start < 12]
        finish_step(s, work)
    # b's second chunk shares its step with a's first decode; c comes only after b, as before priorities
    assert seen[:5] == [("a", 8), ("a", 4), ("b", 4), ("b", 7), ("b", 1)]


def test_the_lowest_priority_running_request_is_preempted_first() -> None:
    s = make(num_blocks=4, budget=64)
    low, high = prioritized("low", 8, 3, max_tokens=10), prioritized("high", 8, 0, max_tokens=10, base=50)
    s.add_waiting(low)
    s.add_waiting(high)
    finish_step(s, s.schedule())  # both admitted (high first), pool full
    assert s.blocks.num_free_blocks == 0
    work = s.schedule()  # high needs a block: low goes, though it was admitted first
    assert plan(work) == [("high", 8, 1, True)]
    assert low.state is RequestState.WAITING and s.running == [high]
