"""The router ↔ decode worker contract for one disaggregated request, and the rule of when to disaggregate.

The router and the decode worker are separate processes that import neither each other; this module
is the vocabulary both speak (``pdrouter.wire`` converts it to and from protobuf, and carries it):

* ``ServeOrder``: what the router hands its decode worker (``DecodeWorker.Serve``), with the ranked
  ``PrefillRoute`` s the decode worker may call;
* ``PrefillOutcome``: what one prefill worker answered the decode worker (``PrefillWorker.Prefill``);
* ``PrefillReport``: what the decode worker tells the router of the prompt's computation, on the
  stream's first chunk, naming every ``PrefillFailure`` on the way.

Conditional disaggregation: a transfer pays off only for enough uncached tokens, and
``computes_locally`` is the one rule that says when. The router applies it knowing nothing cached on
the decode worker (a short prompt costs no prefix lookup and names no route); the decode worker
applies it again once it knows how much of the prompt its own prefix cache holds, with either
engine: pd-router's (``pdrouter.worker.roles.decode_serve``) and vLLM's, inside its KV connector
(``pdrouter.transfer.vllm.scheduler_side``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from pdrouter.core.sampling import SamplingParams


def computes_locally(prompt_tokens: int, cached_tokens: int, local_prefill_tokens: int) -> bool:
    """Whether the decode worker computes the prompt itself: at most ``local_prefill_tokens`` of its
    ``prompt_tokens`` are not among the ``cached_tokens`` it holds."""
    return prompt_tokens - cached_tokens <= local_prefill_tokens


def may_prefill_remotely(prompt_tokens: int, local_prefill_tokens: int) -> bool:
    """The router's side of ``computes_locally``: it knows nothing cached on the decode worker, so a
    prompt it would compute locally even then needs no prefill route (and no prefix lookup)."""
    return not computes_locally(prompt_tokens, 0, local_prefill_tokens)


# The records below are built once or twice per request on the router's and the decode worker's
# paths: plain slotted dataclasses, since a frozen one sets each field through object.__setattr__,
# which costs measurably more per request (docs/benchmarks.md). Treat them as values.
@dataclass(slots=True)
class PrefillRoute:
    """How the decode worker reaches one prefill worker, and what the router expects it to hold."""

    worker_id: str
    address: str
    lane_address: str = ""
    """The prefill worker's lane (used by the decode worker when set)."""
    cached_tokens: int = 0


@dataclass(slots=True)
class ServeOrder:
    """One disaggregated request, as the router hands it to its decode worker."""

    request_id: str
    prompt_token_ids: Sequence[int]
    sampling: SamplingParams
    model_compat_hash: str
    backend: str
    local_prefill_tokens: int
    routes: Sequence[PrefillRoute] = ()
    """Prefill workers to try, best first (none: the decode worker computes the prompt)."""
    whole: bool = False
    """The caller does not stream: after the first token (and the report), the rest comes in one
    chunk at the end."""
    cache_salt: bytes = b""
    """The prompt's cache salt (``pdrouter.core.hashing.cache_salt_key``; empty: none)."""
    priority: int = 0
    """The engines' scheduling priority, lower first (``ServeRequest.priority``)."""
    prompt_token_bytes: bytes = b""
    """``prompt_token_ids`` packed (``pdrouter.core.tokens.pack_token_ids``) when the sender has them
    already; empty: packed when the order is sent."""


@dataclass(slots=True)
class PrefillOutcome:
    """What a prefill worker answered: the prompt's first token, and what computing and sending its KV cost."""

    first_token: int
    cached_tokens: int
    """Prompt tokens served from the prefill worker's prefix cache."""
    compute_ms: float
    transfer_ms: float
    bytes_sent: int


@dataclass(slots=True)
class PrefillFailure:
    """One prefill attempt that failed: on which worker, with which status."""

    worker_id: str
    code: str
    """gRPC status code name, e.g. ``UNAVAILABLE``."""
    message: str


@dataclass(slots=True)
class PrefillReport:
    """How ``Serve`` got the prompt's KV: who computed it, what was cached, what the transfer cost."""

    worker_id: str
    """The prefill worker that computed the prompt ("" when ``local`` or when every attempt failed)."""
    local: bool
    prompt_tokens: int
    cached_tokens: int
    decode_cached_tokens: int
    compute_ms: float
    transfer_ms: float
    bytes_sent: int
    failures: tuple[PrefillFailure, ...] = ()

    @property
    def all_failed(self) -> bool:
        """Every prefill worker named failed (the call then ends with the last failure)."""
        return not self.worker_id and not self.local
