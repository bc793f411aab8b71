"""Sampling parameters, validated once at the edge and passed down unchanged."""

from __future__ import annotations

from dataclasses import dataclass, field

from pdrouter.core.errors import InvalidRequestError

MAX_TOP_K = 2**20
"""The largest ``top_k``: above any vocabulary (a ``top_k`` at or above the vocabulary size keeps every token)."""
MAX_TOKENS = 2**31 - 1
"""The largest ``max_tokens`` (the front doors bound it by the model's context first)."""
MAX_TOKEN_ID = 2**31 - 1
"""The largest token id a stop token may have (the front doors bound it by the vocabulary first)."""
MAX_STOP_TOKEN_IDS = 1024
"""The most stop token ids a request may name (each generated token is looked up among them)."""
MAX_TEMPERATURE = 100.0
GREEDY_TEMPERATURE = 1e-5
"""Temperatures below this are greedy, as in vLLM (its ``_SAMPLING_EPS``): dividing logits by a
tiny temperature overflows to infinities, whose softmax is not a distribution."""


@dataclass(frozen=True)
class SamplingParams:
    """How to pick each next token. A temperature below :data:`GREEDY_TEMPERATURE` (0 included) means greedy."""

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        self.validate()

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE

    def validate(self) -> None:
        """InvalidRequestError naming the field first when a value is out of range.

        Every value that passes fits the wire's fields (``uint32`` counts and ids, ``uint64``
        seed, ``float`` temperature and top_p), so a request accepted at a front door is never
        refused, or worse, fails, on its way to a worker.
        """
        if not isinstance(self.max_tokens, int) or not 0 < self.max_tokens <= MAX_TOKENS:
            raise InvalidRequestError(f"max_tokens must be a positive integer (at most {MAX_TOKENS}), "
                                      f"got {self.max_tokens!r}")
        if not isinstance(self.temperature, int | float) or not 0.0 <= self.temperature <= MAX_TEMPERATURE:
            raise InvalidRequestError(f"temperature must be in [0, {MAX_TEMPERATURE:g}], got {self.temperature!r}")
        if not isinstance(self.top_p, int | float) or not 0.0 < self.top_p <= 1.0:
            raise InvalidRequestError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not 0 <= self.top_k <= MAX_TOP_K:
            raise InvalidRequestError(f"top_k must be in [0, {MAX_TOP_K}] (0 disables it), got {self.top_k!r}")
        if self.seed is not None and not 0 <= self.seed < 2**63:
            raise InvalidRequestError(f"seed must be in [0, 2^63), got {self.seed!r}")
        if len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            raise InvalidRequestError(f"stop_token_ids may name at most {MAX_STOP_TOKEN_IDS} tokens, "
                                      f"got {len(self.stop_token_ids)}")
        if any(not 0 <= t <= MAX_TOKEN_ID for t in self.stop_token_ids):
            raise InvalidRequestError(f"stop_token_ids must be token ids in [0, {MAX_TOKEN_ID}]")
