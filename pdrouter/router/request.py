"""The router's request vocabulary: what front doors hand the orchestrator and get back.

Front doors (gRPC and OpenAI HTTP) validate and tokenize, build a ``RouterRequest``, iterate the
orchestrator's ``TokenDelta`` stream and shape it for their protocol. They never see workers.
"""

from __future__ import annotations

import enum
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Protocol

from pdrouter.core.ids import RequestId
from pdrouter.core.sampling import SamplingParams


class RequestState(enum.Enum):
    """Lifecycle of one request inside the router."""

    WAITING = "waiting"          # queued for admission (KV room on a decode worker)
    PREFILLING = "prefilling"    # prefill running on a prefill worker
    TRANSFERRING = "transferring"  # KV moving prefill → decode
    DECODING = "decoding"        # tokens streaming from the decode worker
    FINISHED = "finished"
    FAILED = "failed"


class FinishReason(enum.Enum):
    STOP = "stop"        # eos or a stop token / string
    LENGTH = "length"    # max_tokens or the context window
    ABORT = "abort"      # cancelled


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


@dataclass(frozen=True)
class RouterRequest:
    """A validated, tokenized request."""

    request_id: RequestId
    model: str
    prompt_token_ids: tuple[int, ...]
    sampling: SamplingParams
    deadline: float | None = None
    """``time.monotonic()`` by which the request must finish (None: no deadline)."""
    priority: int = 0
    """Admission order among waiting requests: higher first, FIFO within a priority."""


@dataclass(frozen=True)
class TokenDelta:
    """New tokens of a stream; the last delta has ``finish_reason`` and ``usage``."""

    token_ids: tuple[int, ...]
    finish_reason: FinishReason | None = None
    usage: Usage | None = None


@dataclass(frozen=True)
class ModelInfo:
    """A model the router serves."""

    name: str
    max_context: int
    vocab_size: int
    block_size: int
    created: int = 0


class Orchestrator(Protocol):
    """The core the front doors call. Implementations place requests on workers.

    ``generate`` raises ``pdrouter.core.errors`` types (InvalidRequestError, CapacityError,
    UnavailableError, …) before or during the stream; closing the iterator early (client gone)
    cancels the request on every worker and frees its KV.
    """

    def models(self) -> list[ModelInfo]: ...

    def generate(self, request: RouterRequest) -> AsyncIterator[TokenDelta]: ...
