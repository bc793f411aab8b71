"""Value objects the engine hands to its driver (the worker): step outputs and KV hand-off records.

These are the types the prefill and decode workers are written against; they hold plain Python
values only (block ids, token ids), never tensors.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from enum import Enum
from typing import NamedTuple

from pdrouter.core.ids import BlockHash, RequestId


class FinishReason(Enum):
    """Why a request stopped producing tokens."""

    STOP = "stop"
    """An eos token (unless ``ignore_eos``) or one of ``stop_token_ids`` was sampled; it is the last token."""
    LENGTH = "length"
    """``max_tokens`` were produced, or the model's context is full."""
    PREFILLED = "prefilled"
    """A prefill-only request computed its prompt and first token; its blocks are held until ``release``."""
    ERROR = "error"
    """The model step could not compute this request (``RequestOutput.error`` says why); the others of
    its batch went on, and its blocks were freed and forgotten."""


@dataclass(frozen=True)
class PrefillResult:
    """What the prefill side ships after a prefill-only request: its KV blocks and first token.

    The KV of ``token_ids`` lies in ``block_ids`` of the engine's pool tensor, in order (the last
    block may be partly filled). The blocks stay valid and unchanged until ``Engine.release`` or
    ``Engine.abort`` for this request.
    """

    request_id: RequestId
    token_ids: Sequence[int]
    """The prompt (a tuple, or the ``PackedPrompt`` it came as)."""
    block_ids: tuple[int, ...]
    block_hashes: tuple[BlockHash, ...]
    """Chained hashes of the prompt's full blocks."""
    first_token: int
    num_cached_blocks: int
    """Leading blocks that were served from this worker's prefix cache."""
    finish_after_first_token: FinishReason | None
    """Set when the first token already ends the request (eos/stop token, or ``max_tokens == 1``)."""


@dataclass(frozen=True)
class KvReservation:
    """Blocks a decode-side request got for a prompt whose KV is written from outside.

    The sender writes the prompt's KV into ``block_ids[num_cached_blocks:]``; the first
    ``num_cached_blocks`` blocks already hold that prefix here and must not be written.
    """

    request_id: RequestId
    block_ids: tuple[int, ...]
    num_cached_blocks: int
    num_prompt_tokens: int
    block_size: int

    @property
    def blocks_to_fill(self) -> tuple[int, ...]:
        return self.block_ids[self.num_cached_blocks:]

    @property
    def num_cached_tokens(self) -> int:
        return self.num_cached_blocks * self.block_size


class RequestOutput(NamedTuple):
    """One request's progress in one ``Engine.step``.

    ``new_token_ids`` are the tokens sampled in this step (at most one today; a stop token is
    included as the last one). ``finished`` is True exactly once per request, together with
    ``finish_reason``; after it the engine never mentions the request again. For a prefill-only
    request that output carries ``prefill`` and ``finish_reason == PREFILLED``; a request the model
    step could not compute ends with ``finish_reason == ERROR``, no token and ``error``.

    A named tuple (``_replace`` derives one): the engine makes one per request and step, and a
    frozen dataclass took five times as long to make.
    """

    request_id: RequestId
    new_token_ids: tuple[int, ...]
    finished: bool
    finish_reason: FinishReason | None
    num_prompt_tokens: int
    num_output_tokens: int
    num_cached_tokens: int
    """Prompt tokens whose KV came from the prefix cache (or from a transfer) at first scheduling."""
    prefill: PrefillResult | None = None
    error: str | None = None
    """With ``finish_reason == ERROR``: why the request could not be computed (no internals)."""


OutputSink = Callable[[RequestOutput], bool]
"""Where a stream's unfinished outputs may go as the engine delivers them, on the event loop, instead of
through the stream's consumer: a streaming call's writer that sends them on at once, so the consumer is
not woken for every token. It returns False when it cannot take one now; the stream then yields that
output as usual. An engine calls it only while the consumer waits with nothing queued, so the order holds;
an engine may also never call it (every output then comes through the stream)."""


@dataclass(frozen=True)
class EngineStats:
    """A snapshot of the engine's queues and pool (for load reports and tests)."""

    num_waiting: int
    num_running: int
    num_held: int
    num_awaiting_kv: int
    num_blocks: int
    num_free_blocks: int
    num_cached_blocks: int
    num_preemptions: int
    prefix_cache_queries: int = 0
    """Prompt tokens looked up in the prefix cache at requests' first admission, since the start."""
    prefix_cache_hits: int = 0
    """Of those, tokens found cached."""
