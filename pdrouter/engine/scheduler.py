"""Continuous batching: which requests compute how many tokens in the next step.

Every step starts from the requests' state, so requests join and leave between any two steps.

1. Running requests that need one token (decodes) go first, then running requests in the middle
   of their prompt (chunked prefill), by priority and then in admission order, each taking at most
   what is left of the step's token budget (``max_num_batched_tokens``).
2. A running request that needs a new block and finds the pool empty preempts the running request
   of the lowest priority (the highest value) admitted last (possibly itself): its blocks are freed
   and it goes back to the waiting queue, ahead of the waiting requests of its priority, to be
   recomputed later (its full blocks usually survive as prefix-cache hits). Nothing crashes for
   lack of blocks.
3. If nothing was preempted, waiting requests are admitted by priority, first come first served
   within one, while the budget, ``max_num_seqs`` and the pool allow; each reuses its longest
   cached prefix (at most ``len - 1`` tokens, since the last token must be computed to sample from)
   and gets blocks only for the chunk it computes now. A waiting request of a higher priority (a
   lower value, vLLM's convention) than a running prompt is admitted before that prompt's next
   chunk: a prompt computed in chunks yields the step to it at the next step, instead of making it
   wait for the whole of its own prompt. With every priority equal (0 by default) this is first
   come first served, as before priorities.

The scheduler only decides and does the block bookkeeping; the engine runs the model.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from pdrouter.core.hashing import BlockHasher
from pdrouter.engine.block_manager import BlockManager
from pdrouter.engine.request import Request, RequestState

_RUNNING = RequestState.RUNNING
"""A module constant for the per-step check: an enum member read through its class costs about 150 ns
more on CPython 3.11, once per request and step."""


def _priority(request: Request) -> int:
    return request.priority


@dataclass(slots=True)
class ScheduledWork:
    """``request`` computes ``num_tokens`` tokens from position ``start`` on."""

    request: Request
    start: int
    num_tokens: int
    samples: bool
    """True when this work reaches the request's last token, so a new token is sampled."""


class Scheduler:
    def __init__(self, blocks: BlockManager, hasher: BlockHasher, max_num_seqs: int,
                 max_num_batched_tokens: int) -> None:
        self.blocks = blocks
        self.hasher = hasher
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0
        self.prefix_cache_queries = 0
        """Prompt tokens looked up in the prefix cache at requests' first admission (as vLLM counts)."""
        self.prefix_cache_hits = 0
        """Of those, tokens found cached."""

    # -- membership ---------------------------------------------------------------------------
    def add_waiting(self, request: Request) -> None:
        self.waiting.append(request)

    def add_running(self, request: Request) -> None:
        """A request that already holds its blocks and computed tokens (KV written from outside)."""
        self.running.append(request)

    def remove(self, request: Request) -> None:
        """Forget a request (it keeps its blocks; the caller frees or holds them)."""
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)

    def release_blocks(self, request: Request) -> None:
        self.blocks.free(request.block_ids)
        request.block_ids = []

    # -- scheduling ---------------------------------------------------------------------------
    def schedule(self) -> list[ScheduledWork]:
        budget = self.max_num_batched_tokens
        scheduled: dict[Request, int] = {}
        preempted = False
        # ``num_tokens - num_computed_tokens`` written out (``Request.num_uncomputed_tokens``): this runs
        # for every running request at every step.
        decodes = [r for r in self.running if r.num_tokens - r.num_computed_tokens == 1]
        prefills = sorted((r for r in self.running if r.num_tokens - r.num_computed_tokens > 1),
                          key=_priority)  # stable
        # The lowest value waiting: one pass per step (and per admission ahead of a prompt), so that
        # equal priorities, the usual case, cost no scan of the waiting queue per running prompt.
        lowest = min(map(_priority, self.waiting), default=None)
        bs = self.blocks.block_size
        for req in decodes + prefills:
            if budget == 0:
                break
            if req.state is not _RUNNING:
                continue
            if lowest is not None and lowest < req.priority and not preempted and req.num_uncomputed_tokens > 1:
                budget = self._admit(budget, scheduled, below=req.priority)  # waiting prompts ahead of it
                lowest = min(map(_priority, self.waiting), default=None)
                if budget == 0:
                    break
            n = min(req.num_tokens - req.num_computed_tokens, budget)
            if req.num_computed_tokens + n <= len(req.block_ids) * bs:  # its blocks hold them: most decodes
                scheduled[req] = n
                budget -= n
                continue
            while not self.blocks.grow(req.block_ids, req.num_computed_tokens + n):
                victim = self._victim()
                budget += scheduled.pop(victim, 0)
                self._preempt(victim)
                preempted = True
                if victim is req:
                    break
            else:
                scheduled[req] = n
                budget -= n
        if not preempted:
            budget = self._admit(budget, scheduled)
        return [ScheduledWork(r, r.num_computed_tokens, n, r.num_computed_tokens + n == r.num_tokens)
                for r, n in scheduled.items()]

    def _victim(self) -> Request:
        """The running request to preempt: the lowest priority (highest value), admitted last."""
        running = self.running
        return running[max(range(len(running)), key=lambda i: (running[i].priority, i))]

    def _admit(self, budget: int, scheduled: dict[Request, int], below: int | None = None) -> int:
        """Admit waiting requests (of a priority value under ``below``, when given), best first."""
        bs = self.blocks.block_size
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            req = min(self.waiting, key=_priority)  # the first of the lowest value: FIFO within a priority
            if below is not None and req.priority >= below:
                break
            total = req.num_tokens
            hashes = req.hashes(self.hasher)
            matched = self.blocks.match_prefix(hashes[:(total - 1) // bs])
            hits = len(matched)
            cached = hits * bs
            n = min(total - cached, budget)
            alloc = self.blocks.allocate(hashes[:hits], cached + n, matched=matched)
            if alloc is None:
                break
            self.waiting.remove(req)
            req.block_ids = alloc.block_ids
            req.num_computed_tokens = cached
            req.num_committed_blocks = alloc.num_cached_blocks
            if req.num_cached_tokens < 0:
                req.num_cached_tokens = cached
                self.prefix_cache_queries += total
                self.prefix_cache_hits += cached
            req.transition(RequestState.RUNNING)
            self.running.append(req)
            scheduled[req] = n
            budget -= n
        return budget

    def _preempt(self, req: Request) -> None:
        self.running.remove(req)
        self.release_blocks(req)
        req.reset_for_recompute()
        req.transition(RequestState.WAITING)
        self.waiting.appendleft(req)
        self.num_preemptions += 1

    # -- after the model ran ------------------------------------------------------------------
    def advance(self, work: ScheduledWork) -> None:
        """Count the computed tokens and register newly completed blocks in the prefix cache."""
        req = work.request
        req.num_computed_tokens += work.num_tokens
        full = req.num_computed_tokens // self.blocks.block_size
        if full > req.num_committed_blocks:
            hashes = req.hashes(self.hasher, req.num_computed_tokens)
            self.blocks.commit(req.block_ids, hashes, start=req.num_committed_blocks)
            req.num_committed_blocks = full
