"""A request inside the engine: its tokens, blocks, sampling state and lifecycle.

Lifecycle (all transitions go through :meth:`Request.transition`)::

    WAITING ──▶ RUNNING ──▶ FINISHED               normal generation
       ▲           │ ──▶ HELD ──▶ FINISHED          prefill-only: blocks kept until release()
       └─preempt───┘                                 (blocks freed; recomputed on readmission)
    AWAITING_KV ──▶ RUNNING | FINISHED              KV written from outside, then decode here
    RUNNING ──▶ FAILED                              the model step could not compute it (blocks dropped)
    any state but FINISHED or FAILED ──▶ ABORTED

A request computes its tokens in order: the first ``num_computed_tokens`` of its tokens (the prompt,
then the outputs; ``tokens(start, stop)``) have KV in its blocks; when the remaining tokens are
computed the request samples one more token. A packed prompt (``PackedPrompt``: the worker protocol's
bytes) stays packed: the simulated step needs only counts, and a step that reads ids unpacks the
span it computes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import Enum

from pdrouter.core.hashing import BlockHasher
from pdrouter.core.ids import BlockHash, RequestId
from pdrouter.core.sampling import SamplingParams
from pdrouter.core.tokens import PackedPrompt
from pdrouter.engine.outputs import FinishReason


class RequestState(Enum):
    WAITING = "waiting"
    RUNNING = "running"
    HELD = "held"
    AWAITING_KV = "awaiting_kv"
    FINISHED = "finished"
    FAILED = "failed"
    ABORTED = "aborted"


class RequestKind(Enum):
    GENERATE = "generate"
    """Prefill and decode in this engine."""
    PREFILL_ONLY = "prefill_only"
    """Prefill, sample the first token, hold the KV for export."""
    REMOTE_KV = "remote_kv"
    """Prompt KV arrives from another worker; decode here."""


_TRANSITIONS: dict[RequestState, frozenset[RequestState]] = {
    RequestState.WAITING: frozenset({RequestState.RUNNING, RequestState.ABORTED}),
    RequestState.RUNNING: frozenset({RequestState.WAITING, RequestState.HELD, RequestState.FINISHED,
                                     RequestState.FAILED, RequestState.ABORTED}),
    RequestState.HELD: frozenset({RequestState.FINISHED, RequestState.ABORTED}),
    RequestState.AWAITING_KV: frozenset({RequestState.RUNNING, RequestState.FINISHED,
                                         RequestState.ABORTED}),
    RequestState.FINISHED: frozenset(),
    RequestState.FAILED: frozenset(),
    RequestState.ABORTED: frozenset(),
}


@dataclass(eq=False, slots=True)
class Request:
    request_id: RequestId
    prompt_token_ids: Sequence[int]
    sampling: SamplingParams
    kind: RequestKind
    stop_ids: frozenset[int]
    """Token ids that end the request (eos unless ignored, plus ``stop_token_ids``)."""
    max_context: int
    sampler_state: object | None = None
    """The model step's own per-request sampling state, made at the first sample (the torch step: a
    ``torch.Generator`` for random sampling; the simulated step: the key of its token stream)."""
    state: RequestState = RequestState.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    """The tokens sampled so far (kept across a preemption: recomputed after the prompt)."""
    num_computed_tokens: int = 0
    block_ids: list[int] = field(default_factory=list)
    block_hashes: list[BlockHash] = field(default_factory=list)
    num_committed_blocks: int = 0
    num_cached_tokens: int = -1
    """Prefix-cache hit of the first admission (-1 until then)."""
    num_preemptions: int = 0
    finish_reason: FinishReason | None = None
    in_flight: bool = False
    """Part of the model step running now, or its received KV being checked (its blocks must not be
    freed until that ends)."""
    kv_finite: bool | None = None
    """A remote-KV request's received blocks: None until checked, then whether every value was finite."""
    root: BlockHash | None = None
    """The parent of its first block: its cache salt's root (``BlockHasher.salted_root``), None
    when it has no salt (the hasher's own root)."""
    priority: int = 0
    """Scheduling priority, lower first (``pdrouter.engine.scheduler``); 0 for all: first come first served."""
    num_prompt_tokens: int = field(init=False)
    """``len(prompt_token_ids)``, kept: read several times per token by the step's bookkeeping."""
    num_tokens: int = field(init=False)
    """Prompt and output tokens so far."""

    def __post_init__(self) -> None:
        self.num_prompt_tokens = len(self.prompt_token_ids)
        self.num_tokens = self.num_prompt_tokens + len(self.output_token_ids)

    # -- lifecycle ----------------------------------------------------------------------------
    def transition(self, new: RequestState) -> None:
        if new not in _TRANSITIONS[self.state]:
            raise RuntimeError(f"request {self.request_id}: illegal transition "
                               f"{self.state.name} -> {new.name}")
        self.state = new

    @property
    def is_done(self) -> bool:
        return self.state in (RequestState.FINISHED, RequestState.FAILED, RequestState.ABORTED)

    # -- tokens -------------------------------------------------------------------------------
    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_uncomputed_tokens(self) -> int:
        return self.num_tokens - self.num_computed_tokens

    def tokens(self, start: int, stop: int) -> Sequence[int]:
        """Its tokens at positions ``start .. stop - 1`` (prompt, then outputs)."""
        prompt = self.num_prompt_tokens
        if stop <= prompt:
            return self.prompt_token_ids[start:stop]
        if start >= prompt:
            return self.output_token_ids[start - prompt:stop - prompt]
        return (*self.prompt_token_ids[start:], *self.output_token_ids[:stop - prompt])

    def hashes(self, hasher: BlockHasher, num_tokens: int | None = None) -> list[BlockHash]:
        """Chained hashes of the full blocks among the first ``num_tokens`` tokens (memoized)."""
        limit = self.num_tokens if num_tokens is None else num_tokens
        want = limit // hasher.block_size
        have = len(self.block_hashes)
        if want > have:
            bs = hasher.block_size
            parent = self.block_hashes[-1] if have else self.root
            prompt = self.prompt_token_ids
            if type(prompt) is PackedPrompt and want * bs <= self.num_prompt_tokens:  # the prompt's own bytes
                self.block_hashes.extend(hasher.hash_packed(prompt.packed[have * bs * 4:want * bs * 4], parent))
            else:
                self.block_hashes.extend(hasher.hash_blocks(self.tokens(have * bs, want * bs), parent))
        return self.block_hashes[:want]

    def append_token(self, token: int) -> FinishReason | None:
        """Record a sampled token; returns why the request ends with it, if it does."""
        outputs = self.output_token_ids
        outputs.append(token)
        self.num_tokens += 1
        if token in self.stop_ids:
            return FinishReason.STOP
        if len(outputs) >= self.sampling.max_tokens or self.num_tokens >= self.max_context:
            return FinishReason.LENGTH
        return None

    def reset_for_recompute(self) -> None:
        """After preemption: no blocks, nothing computed; generated tokens are kept and recomputed."""
        self.block_ids = []
        self.num_computed_tokens = 0
        self.num_committed_blocks = 0
        self.num_preemptions += 1
