"""The batching engine both backends share: requests, continuous batching, paged KV accounting, prefix reuse.

``BatchEngine`` is everything an engine is except the model: the scheduler, the block manager,
the prefix cache, chunked prefill, preemption, the request lifecycle and block events. One
:class:`ModelStep` runs each scheduled step and returns the sampled tokens:

* ``pdrouter.engine.torch_engine.TorchEngine``: the torch model over a real KV tensor;
* ``pdrouter.engine.sim.engine.SimEngine``: a roofline timing model of a GPU, with no tensors.

This module imports no torch. Threading: exactly one driver thread calls :meth:`BatchEngine.step`
in a loop; any other thread may call the request methods at any time (they take a short lock and
never wait for a model step)::

    while serving:
        if engine.wait_for_work(timeout=0.1):
            for out in engine.step():
                deliver(out)                     # e.g. loop.call_soon_threadsafe(...)

Three ways in, one way out:

* :meth:`add_request`: prefill and decode here (colocated worker). ``step()`` yields one
  :class:`RequestOutput` per sampled token; the last one has ``finished=True``.
* :meth:`add_prefill_request` (prefill worker): ``step()`` yields exactly one output, with
  ``finish_reason=PREFILLED`` and a :class:`PrefillResult` (prompt, block ids, first token). The
  blocks stay untouched until :meth:`release` (after the KV was shipped) or :meth:`abort`.
* :meth:`reserve_remote` (decode worker): allocates blocks for a prompt, reusing cached prefix
  blocks, and returns a :class:`KvReservation` (fill ``blocks_to_fill`` only). After the KV has
  landed, :meth:`commit_remote` with the first token (sampled by the prefill side) puts the request
  into the decode batch; ``step()`` then yields tokens from the second one on.
* :meth:`abort` ends a request in any state and frees its blocks; afterwards ``step()`` never
  mentions it (an output already returned by a concurrent step may still be in the driver's hands).
  Blocks freed by ``abort`` or ``release`` may be reused at once: stop any KV transfer reading or
  writing them first (the engine itself defers the free of a request in the running model step).

Bad input raises ``pdrouter.core.errors`` types (InvalidRequestError, PromptTooLongError,
RequestTooLargeError, CapacityError for a reservation that does not fit now, NotFoundError,
FailedPreconditionError) before anything is allocated. Preemption is invisible to callers.

A failing request fails alone. A model step that cannot compute one request (its logits are not
finite) says so for that request (:class:`RequestFault`): the request ends with
``FinishReason.ERROR`` and its blocks are dropped (unreferenced ones lose their prefix-cache entry
and are cleared, so no stale value reaches attention again), while the rest of the batch goes on.
KV written from outside is checked before it is used (:meth:`check_remote_kv`, and at the latest
by :meth:`commit_remote`): values that are not finite clear the blocks and raise TransferError.
Only a step that raises, a fault of the engine itself, propagates from :meth:`step`; the engine
then serves no more (its driver reports it).

Block events (``event_sink``, see :mod:`pdrouter.engine.events`) fire when a full block's KV is complete
(computed here, or committed with ``commit_remote``) and when a cached block is evicted.
"""

from __future__ import annotations

import threading
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple, Protocol

from mypy_extensions import mypyc_attr

from pdrouter.core.errors import (
    CapacityError,
    FailedPreconditionError,
    InvalidRequestError,
    NotFoundError,
    TransferError,
)
from pdrouter.core.hashing import BlockHasher
from pdrouter.core.ids import RequestId
from pdrouter.core.kv_layout import KvLayout
from pdrouter.core.model_spec import ModelSpec
from pdrouter.core.sampling import SamplingParams
from pdrouter.engine.block_manager import BlockManager
from pdrouter.engine.events import BlockEventSink
from pdrouter.engine.outputs import EngineStats, FinishReason, KvReservation, PrefillResult, RequestOutput
from pdrouter.engine.request import Request, RequestKind, RequestState
from pdrouter.engine.scheduler import ScheduledWork, Scheduler
from pdrouter.engine.validation import token_ids, validate_request


@dataclass(frozen=True)
class SchedulingConfig:
    """How the shared scheduler batches: the part of an engine's configuration both backends have."""

    max_num_seqs: int = 64
    """Most requests admitted to the running batch by local scheduling."""
    max_num_batched_tokens: int = 512
    """Token budget of one step; longer prompts are prefilled in chunks of at most this many tokens."""
    enable_prefix_caching: bool = True
    hash_seed: int | str | bytes = 0
    """Seed of the chained block hashes; must equal the router's."""


_ABORTED, _PREFILL_ONLY = RequestState.ABORTED, RequestKind.PREFILL_ONLY
"""Module constants for the per-step checks (an enum member read through its class costs about 150 ns
more on CPython 3.11, once per request and step)."""


class StepWork(NamedTuple):
    """One request's share of one step, taken under the engine's lock: compute ``token_ids`` at
    positions ``start ..`` into ``block_ids`` (which cover every position up to the last); when
    ``samples``, the step samples the request's next token.

    A named tuple: the engine makes one per request and step, and a frozen dataclass took about
    four times as long to make."""

    request: Request
    token_ids: Sequence[int]
    start: int
    block_ids: Sequence[int]
    samples: bool


_new = tuple.__new__
"""``_new(StepWork, (...))``: a named tuple made in C, every field given. The class's own ``__new__`` is
Python code, and the step makes a ``StepWork`` and a ``RequestOutput`` per request and step."""


@dataclass(frozen=True, slots=True)
class RequestFault:
    """What a model step gives instead of a token for a request it could not compute."""

    reason: str
    """Why, in words for the request's caller (no internals)."""


class ModelStep(Protocol):
    """Runs one scheduled step on the model (real or simulated), and guards the KV pool it owns."""

    def run(self, work: Sequence[StepWork]) -> Sequence[int | RequestFault]:
        """The sampled token (or the request's fault) of every item with ``samples``, in order.
        Raising leaves nothing advanced, and stops the engine."""
        ...

    def kv_finite(self, block_ids: Sequence[int]) -> bool:
        """Whether every value these blocks hold is finite (KV written from outside)."""
        ...

    def clear_kv(self, block_ids: Sequence[int]) -> None:
        """Zero these blocks: what they held must never reach attention (stale slots are masked,
        and a masked NaN still poisons the sum as 0 × NaN)."""
        ...


@mypyc_attr(allow_interpreted_subclasses=True)  # the torch engine subclasses it uncompiled
class BatchEngine:
    """A synchronous inference engine over a :class:`ModelStep` (see the module docstring for the contract)."""

    def __init__(self, spec: ModelSpec, eos_token_ids: Sequence[int], kv_layout: KvLayout,
                 scheduling: SchedulingConfig, model_step: ModelStep, *,
                 event_sink: BlockEventSink | None = None) -> None:
        self.spec = spec
        self.eos_token_ids = tuple(eos_token_ids)
        self.kv_layout = kv_layout
        self.scheduling = scheduling
        self.model_step = model_step
        self.hasher = BlockHasher(kv_layout.block_size, scheduling.hash_seed)
        self.block_manager = BlockManager(kv_layout.num_blocks, kv_layout.block_size, sink=event_sink,
                                          enable_prefix_caching=scheduling.enable_prefix_caching)
        self.scheduler = Scheduler(self.block_manager, self.hasher, scheduling.max_num_seqs,
                                   scheduling.max_num_batched_tokens)
        self._requests: dict[RequestId, Request] = {}
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._step_lock = threading.Lock()
        self._stalled = False

    @property
    def block_size(self) -> int:
        return self.kv_layout.block_size

    # -- requests in ---------------------------------------------------------------------------
    def add_request(self, request_id: RequestId, prompt_token_ids: Sequence[int],
                    sampling: SamplingParams, *, cache_salt: object = b"", priority: int = 0) -> None:
        """Queue a request to prefill and decode here. ``cache_salt`` (every method taking one): its
        blocks are hashed under it (``pdrouter.core.hashing``), so it shares prefix blocks only with
        requests of the same salt. ``priority`` (every method taking one): lower first, as the
        scheduler orders prompts (``pdrouter.engine.scheduler``); equal for all, first come first served.

        ``cache_salt`` is bytes; it is typed ``object`` so that anything else reaches the engine's own
        check (``InvalidRequestError`` naming it) in a compiled build too, whose functions check their
        arguments' declared types on entry (``docs/simulation.md``, "A compiled engine")."""
        self._enqueue(self._new_request(request_id, prompt_token_ids, sampling, RequestKind.GENERATE, cache_salt,
                                        priority))

    def add_prefill_request(self, request_id: RequestId, prompt_token_ids: Sequence[int],
                            sampling: SamplingParams, *, cache_salt: object = b"", priority: int = 0) -> None:
        """Queue a prefill-only request; its one output carries a :class:`PrefillResult`."""
        self._enqueue(self._new_request(request_id, prompt_token_ids, sampling, RequestKind.PREFILL_ONLY,
                                        cache_salt, priority))

    def reserve_remote(self, request_id: RequestId, prompt_token_ids: Sequence[int],
                       sampling: SamplingParams, *, cache_salt: object = b"") -> KvReservation:
        """Allocate blocks for a prompt whose KV another worker will write; CapacityError if short now."""
        req = self._new_request(request_id, prompt_token_ids, sampling, RequestKind.REMOTE_KV, cache_salt)
        hashes = req.hashes(self.hasher)
        with self._lock:
            self._check_new_id(request_id)
            alloc = self.block_manager.allocate(hashes, req.num_prompt_tokens)
            if alloc is None:
                raise CapacityError(f"no room for {self.block_manager.blocks_needed(req.num_prompt_tokens)} "
                                    f"KV blocks now ({self.block_manager.num_free_blocks} free)")
            req.block_ids = alloc.block_ids
            req.num_committed_blocks = alloc.num_cached_blocks
            req.num_cached_tokens = alloc.num_cached_blocks * self.block_size
            self._requests[request_id] = req
            return KvReservation(request_id, tuple(alloc.block_ids), alloc.num_cached_blocks,
                                 req.num_prompt_tokens, self.block_size)

    def commit_remote(self, request_id: RequestId, first_token: int) -> FinishReason | None:
        """The reserved blocks now hold the prompt's KV; decode from ``first_token`` on.

        Returns the finish reason when ``first_token`` alone ends the request (its blocks are freed
        and ``step()`` will not mention it); None when it joined the decode batch.
        """
        (token,) = token_ids([first_token], self.spec.vocab_size, "first_token")
        self.check_remote_kv(request_id)
        with self._lock:
            req = self._get(request_id, RequestState.AWAITING_KV)
            self.block_manager.commit(req.block_ids, req.hashes(self.hasher), req.num_committed_blocks)
            req.num_committed_blocks = req.num_prompt_tokens // self.block_size
            req.num_computed_tokens = req.num_prompt_tokens
            reason = req.append_token(token)
            if reason is not None:
                self._finish(req, reason)
                return reason
            req.transition(RequestState.RUNNING)
            self.scheduler.add_running(req)
            self._stalled = False
            self._wake.notify_all()
            return None

    def check_remote_kv(self, request_id: RequestId) -> None:
        """Check the KV written into a reservation's blocks (those it did not have cached) before use.

        TransferError when a value is not finite: those blocks are cleared first, and the request
        stays reserved, never to be committed (abort it). The check runs once; later calls give its
        verdict. May run on any thread (the blocks stay the request's while it runs, even if it is
        aborted meanwhile).
        """
        with self._lock:
            req = self._get(request_id, RequestState.AWAITING_KV)
            finite = req.kv_finite
            if finite is None:
                blocks = list(req.block_ids[req.num_committed_blocks:])
                req.in_flight = True
        if finite is None:
            finite = False
            try:
                finite = self.model_step.kv_finite(blocks)
                if not finite:
                    self.model_step.clear_kv(blocks)
            finally:
                with self._lock:
                    req.in_flight = False
                    req.kv_finite = finite
                    if req.state is RequestState.ABORTED:
                        self.scheduler.release_blocks(req)
        if not finite:
            raise TransferError(f"the KV received for request {request_id} holds values that are not finite")

    def release(self, request_id: RequestId) -> None:
        """Free the blocks of a prefill-only request after its KV was shipped."""
        with self._lock:
            self._finish(self._get(request_id, RequestState.HELD), None)
            self._stalled = False
            self._wake.notify_all()

    def abort(self, request_id: RequestId) -> bool:
        """End a request in any state, freeing its blocks; False when the id is unknown (or done)."""
        with self._lock:
            req = self._requests.pop(request_id, None)
            if req is None:
                return False
            in_flight = req.in_flight
            self.scheduler.remove(req)
            req.transition(RequestState.ABORTED)
            if not in_flight:
                self.scheduler.release_blocks(req)
            self._stalled = False
            self._wake.notify_all()
            return True

    # -- driving -----------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Run one scheduling iteration and one model step; the outputs of the tokens it sampled."""
        with self._step_lock:
            with self._lock:
                preemptions = self.scheduler.num_preemptions
                work = self.scheduler.schedule()
                # Nothing to run and nothing freed: only another call (add, release, abort…) helps.
                self._stalled = not work and self.scheduler.num_preemptions == preemptions
                # The request's own block list, not a copy: only ``schedule`` (on this thread, under the
                # step lock) grows a list in place; a release replaces it.
                items = [_new(StepWork, (w.request, w.request.tokens(w.start, w.start + w.num_tokens), w.start,
                                         w.request.block_ids, w.samples)) for w in work]
                for w in work:
                    w.request.in_flight = True
            if not work:
                return []
            sampling = [w.request for w in work if w.samples]
            try:
                tokens = self.model_step.run(items)
            except BaseException:
                with self._lock:  # nothing advanced: the same work can be scheduled again
                    self._complete(work, None)
                raise
            with self._lock:
                return self._complete(work, dict(zip(sampling, tokens, strict=True)))

    def _complete(self, work: list[ScheduledWork],
                  tokens: dict[Request, int | RequestFault] | None) -> list[RequestOutput]:
        """Account for a finished model step (``tokens`` None: the step failed, account nothing)."""
        outputs: list[RequestOutput] = []
        for w in work:
            req = w.request
            req.in_flight = False
            token = tokens.get(req) if tokens is not None else None
            if isinstance(token, RequestFault):  # this step computed nothing usable for it
                if req.state is RequestState.ABORTED:
                    self._drop_blocks(req)
                else:
                    outputs.append(self._fail(req, token.reason))
                continue
            if req.state is _ABORTED:
                self.scheduler.release_blocks(req)
                continue
            if tokens is None:
                continue
            self.scheduler.advance(w)
            if token is None:
                continue
            reason = req.append_token(token)
            prefill = None
            if req.kind is _PREFILL_ONLY:
                self.scheduler.remove(req)
                req.transition(RequestState.HELD)
                prefill = PrefillResult(req.request_id, req.prompt_token_ids, tuple(req.block_ids),
                                        tuple(req.hashes(self.hasher, req.num_prompt_tokens)), token,
                                        req.num_cached_tokens // self.block_size, reason)
                reason = FinishReason.PREFILLED
            elif reason is not None:
                self._finish(req, reason)
            prompt = req.num_prompt_tokens
            outputs.append(_new(RequestOutput, (req.request_id, (token,), reason is not None, reason,
                                                prompt, req.num_tokens - prompt, req.num_cached_tokens, prefill, None)))
        return outputs

    def wait_for_work(self, timeout: float | None = None) -> bool:
        """Block until a step could make progress (or ``timeout`` seconds pass); True if it could."""
        with self._wake:
            return self._wake.wait_for(self._has_work, timeout)

    def _has_work(self) -> bool:
        s = self.scheduler
        return bool(s.running) or (bool(s.waiting) and not self._stalled)

    def has_unfinished_requests(self) -> bool:
        with self._lock:
            return bool(self._requests)

    def stats(self) -> EngineStats:
        with self._lock:
            states = [r.state for r in self._requests.values()]
            bm = self.block_manager
            return EngineStats(len(self.scheduler.waiting), len(self.scheduler.running),
                               states.count(RequestState.HELD), states.count(RequestState.AWAITING_KV),
                               bm.num_blocks, bm.num_free_blocks, bm.num_cached_blocks,
                               self.scheduler.num_preemptions, self.scheduler.prefix_cache_queries,
                               self.scheduler.prefix_cache_hits)

    def queued_prefill_tokens(self) -> int:
        """Prompt tokens admitted or waiting but not yet computed (the prefill backlog)."""
        return sum(tokens for _, tokens in self.queued_prefill_by_priority())

    def queued_prefill_by_priority(self) -> tuple[tuple[int, int], ...]:
        """The prefill backlog by scheduling priority: (priority, tokens) pairs, lowest priority value
        first, one per priority present. The scheduler computes a prompt of a lower value before
        those of higher values, so a prompt of priority p waits for the pairs at or below p only
        (and at most one step of the others)."""
        by: dict[int, int] = {}
        with self._lock:
            s = self.scheduler
            for r in s.waiting:
                by[r.priority] = by.get(r.priority, 0) + r.num_uncomputed_tokens
            for r in s.running:
                if r.num_uncomputed_tokens > 1:
                    by[r.priority] = by.get(r.priority, 0) + r.num_uncomputed_tokens
        return tuple(sorted(by.items()))

    def cached_prefix_tokens(self, prompt_token_ids: Sequence[int], cache_salt: bytes = b"") -> int:
        """Tokens of this prompt's longest prefix whose KV is cached here under ``cache_salt`` (a pure query)."""
        hashes = self.hasher.hash_blocks(token_ids(prompt_token_ids, self.spec.vocab_size),
                                         self.hasher.salted_root(cache_salt))
        with self._lock:
            return len(self.block_manager.match_prefix(hashes)) * self.block_size

    def generate(self, prompts: Sequence[Sequence[int]],
                 sampling: SamplingParams | Sequence[SamplingParams]) -> list[list[int]]:
        """Run prompts to completion on the calling thread (tests, benchmarks, offline use)."""
        params = [sampling] * len(prompts) if isinstance(sampling, SamplingParams) else list(sampling)
        ids = [RequestId(f"gen-{uuid.uuid4().hex}") for _ in prompts]
        for rid, prompt, p in zip(ids, prompts, params, strict=True):
            self.add_request(rid, prompt, p)
        result: dict[RequestId, list[int]] = {rid: [] for rid in ids}
        pending = set(ids)
        while pending:
            for out in self.step():
                result[out.request_id].extend(out.new_token_ids)
                if out.finished:
                    pending.discard(out.request_id)
        return [result[rid] for rid in ids]

    # -- internals ---------------------------------------------------------------------------
    def _new_request(self, request_id: RequestId, prompt: Sequence[int], sampling: SamplingParams,
                     kind: RequestKind, cache_salt: object = b"", priority: int = 0) -> Request:
        if not isinstance(request_id, str) or not request_id:
            raise InvalidRequestError(f"request_id must be a non-empty string, got {request_id!r}")
        ids = validate_request(prompt, sampling, self.spec, num_blocks=self.kv_layout.num_blocks,
                               block_size=self.block_size, hold_prompt_only=kind is RequestKind.PREFILL_ONLY)
        stop = set(sampling.stop_token_ids)
        if not sampling.ignore_eos:
            stop.update(self.eos_token_ids)
        state = RequestState.AWAITING_KV if kind is RequestKind.REMOTE_KV else RequestState.WAITING
        if not isinstance(cache_salt, bytes):
            raise InvalidRequestError(f"cache_salt must be bytes, got {type(cache_salt).__name__}")
        if not isinstance(priority, int) or isinstance(priority, bool) or not -2**31 <= priority < 2**31:
            raise InvalidRequestError(f"priority must be a 32-bit integer, got {priority!r}")
        return Request(request_id, ids, sampling, kind, frozenset(stop), self.spec.max_context, state=state,
                       root=self.hasher.salted_root(cache_salt), priority=priority)

    def _check_new_id(self, request_id: RequestId) -> None:
        if request_id in self._requests:
            raise InvalidRequestError(f"request id {request_id!r} is already in use")

    def _enqueue(self, req: Request) -> None:
        with self._lock:
            self._check_new_id(req.request_id)
            self._requests[req.request_id] = req
            self.scheduler.add_waiting(req)
            self._stalled = False
            self._wake.notify_all()

    def _get(self, request_id: RequestId, state: RequestState) -> Request:
        req = self._requests.get(request_id)
        if req is None:
            raise NotFoundError(f"unknown request id {request_id!r}")
        if req.state is not state:
            raise FailedPreconditionError(f"request {request_id!r} is {req.state.value}, not {state.value}")
        return req

    def _fail(self, req: Request, reason: str) -> RequestOutput:
        """End a request the model step could not compute; its blocks are dropped, not cached."""
        self.scheduler.remove(req)
        self._drop_blocks(req)
        req.finish_reason = FinishReason.ERROR
        req.transition(RequestState.FAILED)
        del self._requests[req.request_id]
        return RequestOutput(req.request_id, (), True, FinishReason.ERROR, req.num_prompt_tokens,
                             req.num_output_tokens, req.num_cached_tokens, error=reason)

    def _drop_blocks(self, req: Request) -> None:
        """Free a request's blocks, forgetting and clearing those no other request holds."""
        unused = self.block_manager.discard(req.block_ids)
        req.block_ids = []
        if unused:
            self.model_step.clear_kv(unused)

    def _finish(self, req: Request, reason: FinishReason | None) -> None:
        self.scheduler.remove(req)
        self.scheduler.release_blocks(req)
        req.finish_reason = reason
        req.transition(RequestState.FINISHED)
        del self._requests[req.request_id]
