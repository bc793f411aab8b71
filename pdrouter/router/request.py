"""The router's request vocabulary: what front doors hand the dispatcher and get back.

Front doors (gRPC and OpenAI HTTP) validate and tokenize, build a ``RouterRequest``, iterate the
``Dispatcher``'s ``TokenDelta`` stream and shape it for their protocol. They never see workers.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import Any, Protocol

from pdrouter.core.ids import RequestId
from pdrouter.core.sampling import SamplingParams
from pdrouter.core.tenants import Tenant
from pdrouter.core.tokens import FinishReason, PackedPrompt, TokenDelta, TokenSink, Usage, pack_token_ids

__all__ = ["Dispatcher", "FinishReason", "ModelInfo", "RouterRequest", "TokenDelta", "Usage", "prompt_ids"]


@dataclass(frozen=True)
class RouterRequest:
    """A validated, tokenized request."""

    request_id: RequestId
    """The router's own id (``pdrouter.core.ids.new_request_id``): the key of the request on every
    worker. Never the client's."""
    model: str
    prompt_token_ids: Sequence[int]
    """The prompt's ids: a tuple, or for a byte-level tokenizer's text a ``PackedPrompt`` (packed, not
    unpacked unless read)."""
    sampling: SamplingParams
    deadline: float | None = None
    """``time.monotonic()`` by which the request must finish (None: no deadline)."""
    priority: int = 0
    """Admission order among waiting requests: higher first, FIFO within a priority."""
    whole: bool = False
    """The caller takes the output in one piece and nothing needs to see it token by token (a
    non-streamed response without stop strings): the worker may then send the tokens in one chunk
    at the end (a decode worker's ``Serve``: after the first one, with its prefill report). The
    output is the same either way; the time to the first token is then not known."""
    label: str | None = None
    """What the client calls the request (HTTP ``X-Request-Id``, gRPC ``request_id``): echoed back to
    it and logged beside ``request_id``, never used as a key."""
    tenant: Tenant | None = None
    """Whose request it is (its API key's tenant); None on a router without a tenants file."""
    cache_salt: bytes = b""
    """The salt its prompt's blocks are hashed under (``pdrouter.core.hashing.cache_salt_key``: its
    tenant's part and its own ``cache_salt``); empty: none."""
    trace: Any = None
    """The request's span (``pdrouter.core.tracing``), when the router traces; None otherwise."""
    sink: TokenSink | None = None
    """A streamed request's shortcut from the worker call to the front door's writer, for the chunks after
    the first (``TokenSink``); the dispatcher hands it to the worker call. None: none (every delta goes
    through the dispatcher's stream). A front door sets it only where nothing between the two looks at
    each delta (no tenant's count of the tokens)."""

    @cached_property
    def prompt_token_bytes(self) -> bytes:
        """The prompt packed as the worker protocol and the block hashes take it, once per request."""
        return pack_token_ids(self.prompt_token_ids)


def prompt_ids(ids: Sequence[int]) -> Sequence[int]:
    """``ids`` as a ``RouterRequest`` keeps them: a packed prompt as it is, anything else as a tuple."""
    return ids if type(ids) is PackedPrompt else tuple(ids)


@dataclass(frozen=True)
class ModelInfo:
    """A model the router serves."""

    name: str
    max_context: int
    vocab_size: int
    block_size: int
    created: int = 0


class Dispatcher(Protocol):
    """What the front doors call: ``pdrouter.router.dispatch.PoolDispatcher`` places requests on
    workers; ``pdrouter.router.tenancy.TenantGate`` puts a tenant's limits in front of it.

    ``generate`` raises ``pdrouter.core.errors`` types (InvalidRequestError, CapacityError,
    UnavailableError, …) before or during the stream; closing the iterator early (client gone)
    cancels the request on every worker and frees its KV.
    """

    def models(self) -> list[ModelInfo]: ...

    def generate(self, request: RouterRequest) -> AsyncIterator[TokenDelta]: ...
