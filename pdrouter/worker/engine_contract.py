"""The engine a worker's roles program against: one contract, whichever engine runs behind it.

Two implementations:

* ``pdrouter.worker.driver.EngineDriver``: the project's batching engine (``pdrouter.engine``: the
  torch model, or a simulated GPU), a synchronous ``BatchEngine`` stepped on a thread of its own;
* ``pdrouter.engine.vllm.VllmEngine``: vLLM, through its async engine client (``--backend vllm``).

:class:`ServingEngine` is what a colocated worker needs: generate, abort, load, health, close, and
what the process registers (geometry, KV pool, what runs it). :class:`DisaggregatedEngine` adds what
prefill and decode workers need to move KV between engines (prefill and hold, reserve blocks for KV
written from outside, decode from a first token, release). Only the project's engine implements it
today; a vLLM prefill/decode split goes through a KV connector inside vLLM and will implement it on
top of ``VllmEngine``'s per-request parameters (see ``pdrouter/engine/vllm/README.md``).

``EngineIdentity`` (``pdrouter.core.workers``) names what runs the model in the worker's record.

A request's ``cache_salt`` (bytes, ``pdrouter.core.hashing.cache_salt_key``; empty: none) keeps its
prefix blocks apart from those of every other salt: an engine reuses cached blocks only between
requests of one salt. ``trace_headers`` (W3C ``traceparent`` / ``tracestate``) are for an engine that
traces requests itself (vLLM); others ignore them.

Every method is called on the worker's event loop. Errors are ``pdrouter.core.errors`` types: bad
input raises ``InvalidRequestError`` (and its kin) before anything is started, an engine that
stopped raises ``UnavailableError``. Leaving an output stream before its finished output (closing
it, or cancelling the task iterating it) aborts the request in the engine and frees its KV.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, Callable, Mapping, Sequence
from typing import Protocol, runtime_checkable

from pdrouter.core.ids import RequestId
from pdrouter.core.kv_layout import KvLayout
from pdrouter.core.model_spec import ModelSpec
from pdrouter.core.sampling import SamplingParams
from pdrouter.core.workers import EngineIdentity, WorkerLoad
from pdrouter.engine.outputs import KvReservation, OutputSink, PrefillResult, RequestOutput


@runtime_checkable
class ServingEngine(Protocol):
    """A started engine serving whole requests (prefill and decode here): the colocated path."""

    @property
    def spec(self) -> ModelSpec:
        """The model's geometry; ``max_context`` is the longest sequence the engine accepts."""
        ...

    @property
    def kv_layout(self) -> KvLayout:
        """The KV pool the engine really allocated: its block size and number of blocks (what the
        worker registers and admission books against)."""
        ...

    @property
    def identity(self) -> EngineIdentity: ...

    def generate(self, request_id: RequestId, prompt: Sequence[int], sampling: SamplingParams, *,
                 cache_salt: bytes = b"", trace_headers: Mapping[str, str] | None = None, priority: int = 0,
                 whole: bool = False, sink: OutputSink | None = None) -> AsyncGenerator[RequestOutput, None]:
        """Prefill and decode; one output per step with new tokens, the last one ``finished``.

        ``whole``: the caller does not stream. The engine may then pass the first output with
        tokens at once and hold the rest, merged, for the finish (as ``whole_outputs`` merges them;
        the caller merges what it gets in any case), so the caller wakes twice, not at every step.

        ``sink`` (a streaming caller; ignored with ``whole``): the engine may hand it unfinished outputs
        as they come instead of yielding them (``OutputSink``); the finished one is always yielded.

        Validation errors raise here, before the stream starts; the engine's own refusals of a
        request raise from the stream, as ``pdrouter.core.errors`` types."""
        ...

    def abort(self, request_id: RequestId) -> bool:
        """End a request now, freeing its KV and ending its stream; False when the id is unknown."""
        ...

    def load(self) -> WorkerLoad:
        """Running and waiting requests and the pool's blocks right now (what heartbeats carry)."""
        ...

    @property
    def failure(self) -> str | None:
        """None while the engine serves; once it stopped for good, why (for logs and operators)."""
        ...

    def on_failure(self, callback: Callable[[str], None]) -> None:
        """Call ``callback(failure)`` once, on the event loop, when the engine stops for good (at once
        if it has): before any waiting request hears of it."""
        ...

    async def close(self) -> None:
        """Stop the engine and release what it holds (after the servers drained)."""
        ...


@runtime_checkable
class DisaggregatedEngine(ServingEngine, Protocol):
    """An engine whose KV can move to or from another worker's (prefill and decode workers)."""

    async def prefill(self, request_id: RequestId, prompt: Sequence[int], sampling: SamplingParams, *,
                      cache_salt: bytes = b"", priority: int = 0) -> PrefillResult:
        """Compute the prompt and its first token; its blocks stay held until ``release`` / ``abort``."""
        ...

    def reserve_remote(self, request_id: RequestId, prompt: Sequence[int], sampling: SamplingParams, *,
                       cache_salt: bytes = b"") -> KvReservation:
        """Blocks for a prompt whose KV another worker writes (``CapacityError`` when short now)."""
        ...

    async def check_received_kv(self, request_id: RequestId, kv_bytes: int) -> None:
        """Check a reservation's received KV (``kv_bytes`` of it) before it is used: a value that is
        not finite raises ``TransferError``, and the caller aborts the request."""
        ...

    def decode_remote(self, request_id: RequestId, first_token: int, *, whole: bool = False,
                      sink: OutputSink | None = None) -> AsyncGenerator[RequestOutput, None]:
        """After the KV landed: decode from ``first_token``; outputs from the second token on
        (``whole`` and ``sink``: as ``generate``'s)."""
        ...

    def release(self, request_id: RequestId) -> None:
        """Free a prefilled request's blocks once its KV was shipped."""
        ...
