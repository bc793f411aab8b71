"""A vLLM prefill worker's ``Prefill``: vLLM computes the prompt, its KV connector pushes the blocks.

The request goes to vLLM for one token with a ``SendOrder`` naming the decode worker's target
(``pdrouter.transfer.vllm.orders``): in the forward pass that completes the prompt, the
connector's worker side queues each layer's blocks as soon as the layer wrote them; vLLM holds the
blocks until the decode side confirmed every one, the send failed, or ``hold_s`` passed. The call
answers once the decode side confirmed (``SendLink.sent``), with what it cost, or raises the
transfer's error. The token vLLM samples here goes back as the first token, for the record: the
decode engine samples its own from the prompt's last position (see ``decode_connector``).

A cancelled call aborts the request in vLLM: before its prompt completed, vLLM frees the blocks at
once; after, the transfer runs on until the decode side (which cancelled) aborted it, or its hold
ran out.
"""

from __future__ import annotations

import time
from collections.abc import AsyncGenerator, Mapping, Sequence
from contextlib import aclosing
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

from pdrouter.core.errors import ConfigError, PdRouterError, UnavailableError
from pdrouter.core.ids import RequestId
from pdrouter.core.sampling import SamplingParams
from pdrouter.engine.outputs import RequestOutput
from pdrouter.transfer.target import TransferTarget
from pdrouter.transfer.vllm.host import ConnectorHost
from pdrouter.transfer.vllm.orders import SendOrder
from pdrouter.worker.transfer_tally import TransferTally

ONE_TOKEN = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
"""The prefill leg computes the prompt and one token (vLLM's least); the decode engine samples its own."""
CONFIRM_SLACK_S = 5.0
"""How much longer than the hold the call waits for the connector's word (it always comes by then)."""


@runtime_checkable
class KvParamsEngine(Protocol):
    """An engine that takes per-request KV connector parameters (``VllmEngine``)."""

    def generate(self, request_id: RequestId, prompt: Sequence[int], sampling: SamplingParams,
                 extra_args: Mapping[str, Any] | None = None, *,
                 cache_salt: bytes = b"", priority: int = 0) -> AsyncGenerator[RequestOutput, None]: ...


def connector_engine(engine: object) -> KvParamsEngine:
    """``engine`` as the connector roles use it; ConfigError for an engine without KV parameters."""
    if not isinstance(engine, KvParamsEngine):
        raise ConfigError(f"{type(engine).__name__} takes no KV connector parameters")
    return engine


@dataclass(frozen=True)
class PrefillDone:
    first_token: int
    cached_tokens: int
    """Prompt tokens vLLM took from this worker's prefix cache."""
    compute_s: float
    """From the request to vLLM's output (the forward pass, during which the layers went out)."""
    transfer_s: float
    """From vLLM's output to the decode side's confirmation (the transfer's exposed tail)."""
    bytes_sent: int


class ConnectorPrefill:
    """Prefill-only requests through vLLM and its connector (see the module docstring)."""

    def __init__(self, engine: KvParamsEngine, host: ConnectorHost, hold_s: float,
                 tally: TransferTally | None = None) -> None:
        self.engine = engine
        self.host = host
        self.hold_s = hold_s
        self.tally = tally if tally is not None else TransferTally()

    async def run(self, request_id: str, prompt: Sequence[int], target: TransferTarget,
                  cache_salt: bytes = b"", priority: int = 0) -> PrefillDone:
        """Compute ``prompt`` (under its tenant's ``cache_salt``: vLLM's prefix cache keeps salts apart,
        at its ``priority`` where vLLM schedules by priority) with the KV pushed to ``target``; the
        first token once the decode side confirmed."""
        key = target.transfer_id
        order = SendOrder(key, (target,), self.hold_s)
        first: int | None = None
        cached = 0
        with self.host.send(key) as link:
            start = time.perf_counter()
            generated = self.engine.generate(RequestId(request_id), prompt, ONE_TOKEN,
                                             extra_args={"kv_transfer_params": order.params()},
                                             cache_salt=cache_salt, priority=priority)
            async with aclosing(generated) as outputs:
                async for out in outputs:
                    if first is None and out.new_token_ids:
                        first, cached = out.new_token_ids[0], out.num_cached_tokens
            computed = time.perf_counter()
            if first is None:
                raise UnavailableError(f"vLLM computed no token for request {request_id}")
            try:
                sent = await link.sent(self.hold_s + CONFIRM_SLACK_S)
            except PdRouterError:
                self.tally.failed()
                raise
        self.tally.sent(sent.nbytes, sent.seconds)
        return PrefillDone(first, cached, computed - start, time.perf_counter() - computed, sent.nbytes)
