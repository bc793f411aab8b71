"""vLLM behind the worker's engine contract: its async engine client in the worker's process, fed token ids.

``VllmEngine.start`` builds vLLM's ``AsyncLLM`` (the client vLLM's own OpenAI server uses; its
engine core runs in a process of its own, as vLLM runs it by default) from a
:class:`~pdrouter.engine.vllm.config.VllmEngineConfig`, and reads back what vLLM really allocated:
the KV blocks, their size, the context length. Requests go in as ``TokensPrompt``s (the router has
tokenized them) with ``RequestOutputKind.DELTA`` and no detokenizing, so each step's new token ids
come straight back; the router detokenizes and matches stop strings, as for every backend. (vLLM 0.32 takes token ids
as a rendered ``tokens_input``; its raw ``TokensPrompt`` path is deprecated there.)

Why in process, and not vLLM's HTTP server beside the worker: the worker would then relay every
token from vLLM's SSE stream, paying vLLM's per-token JSON and HTTP framing and the worker's parsing
on top of the async client both paths share. ``benchmarks/vllm_overhead.py`` measures the cost
of the router path against vLLM's own server; the figures are in docs/vllm.md.

Health: vLLM's client marks itself ``errored`` when its engine core process dies (a monitor thread
waits on the process) or its output loop fails. A watch task polls that every 0.1 s and, the first
time it is set, runs the ``on_failure`` callbacks and fails every open stream with UnavailableError;
from then on nothing is accepted. vLLM is not restarted in place: the worker process restarts
(a new incarnation, a fresh engine), which is what its NOT_SERVING health asks for.

Seams for a KV connector (prefill/decode with vLLM, see README.md here): the configuration's
``kv_transfer_config`` configures vLLM with a connector (loaded by module path), and
:meth:`VllmEngine.generate` takes ``extra_args`` (vLLM's per-request ``SamplingParams.extra_args``,
where a request's ``kv_transfer_params`` travel) and ``on_final``, which sees vLLM's own final output
(its ``kv_transfer_params`` included).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import shutil
import tempfile
from collections.abc import AsyncGenerator, Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from pdrouter.core.capacity import kv_bytes_per_token
from pdrouter.core.errors import (
    CancelledError,
    ConfigError,
    InvalidRequestError,
    PdRouterError,
    UnavailableError,
)
from pdrouter.core.gpu import GiB
from pdrouter.core.hashing import BlockHasher
from pdrouter.core.ids import RequestId
from pdrouter.core.kv_layout import KvLayout
from pdrouter.core.model_spec import ModelSpec, normalize_dtype
from pdrouter.core.sampling import SamplingParams
from pdrouter.core.workers import EngineIdentity, WorkerLoad
from pdrouter.engine.events import BlockEventSink
from pdrouter.engine.health import EngineFailure
from pdrouter.engine.model_folder import read_model_folder
from pdrouter.engine.outputs import FinishReason, OutputSink, RequestOutput
from pdrouter.engine.validation import validate_request
from pdrouter.engine.vllm.config import VllmEngineConfig
from pdrouter.engine.vllm.events import KvEventTranslator
from pdrouter.engine.vllm.imports import import_vllm
from pdrouter.engine.vllm.stats import SchedulerFigures
from pdrouter.engine.vllm.subscriber import KvEventSubscriber

log = logging.getLogger(__name__)

ENGINE_STOPPED = "this worker's vLLM engine stopped and serves no more requests"
WATCH_INTERVAL_S = 0.1
_FINISH = {"stop": FinishReason.STOP, "length": FinishReason.LENGTH}


class VllmEngine:
    """vLLM's ``AsyncLLM`` serving token-id requests (see the module docstring). Use ``await VllmEngine.start(...)``."""

    def __init__(self, config: VllmEngineConfig, llm: Any, spec: ModelSpec, layout: KvLayout, identity: EngineIdentity,
                 eos_token_ids: Sequence[int], figures: SchedulerFigures, subscriber: KvEventSubscriber | None,
                 run_dir: Path) -> None:
        self.config = config
        self.llm = llm
        self._spec = spec
        self._layout = layout
        self._identity = identity
        self._eos = tuple(eos_token_ids)
        self.figures = figures
        self.subscriber = subscriber
        self._run_dir = run_dir
        self._live: dict[RequestId, asyncio.Event] = {}
        self._failure = EngineFailure()
        self._closed = False
        self._sampling_module = import_vllm("vllm.sampling_params")
        self._tokens_input = import_vllm("vllm.inputs").tokens_input
        scheduler = getattr(getattr(llm, "vllm_config", None), "scheduler_config", None)
        self._by_priority = getattr(scheduler, "policy", "fcfs") == "priority"
        """vLLM orders its waiting requests by priority (``--scheduling-policy priority``); otherwise a
        request's priority is not passed on (first come, first served, vLLM's default)."""
        self._watch = asyncio.get_running_loop().create_task(self._watch_engine(), name="vllm-engine-watch")

    # -- start ----------------------------------------------------------------------------------
    @classmethod
    async def start(cls, config: VllmEngineConfig, event_sink: BlockEventSink | None = None) -> VllmEngine:
        """Start vLLM (blocking work runs on a thread) and return the serving engine.

        ``event_sink`` receives the KV blocks vLLM caches and evicts, in the project's block hashes
        (vLLM's KV events, ``events.py``). ConfigError (one line) when vLLM cannot be imported, an
        engine argument is unknown or vLLM does not start (its own log says why in full).
        """
        async_llm = import_vllm("vllm.v1.engine.async_llm")
        arg_utils = import_vllm("vllm.engine.arg_utils")
        vllm = import_vllm("vllm")
        known = {f.name for f in dataclasses.fields(arg_utils.AsyncEngineArgs)}
        unknown = sorted(k for k in config.passed if k not in known)
        if unknown:
            raise ConfigError(f"--vllm-arg {unknown[0]}: not an engine argument of vLLM {vllm.__version__} "
                              f"(see `python -m vllm.entrypoints.openai.api_server --help`)")
        folder = read_model_folder(config.model_dir)
        run_dir = Path(tempfile.mkdtemp(prefix="pdrouter-vllm-"))
        kwargs = config.engine_kwargs()
        events_endpoint = f"ipc://{run_dir}/kv-events"
        replay_endpoint = f"ipc://{run_dir}/kv-replay"
        if event_sink is not None:
            kv_events = import_vllm("vllm.config.kv_events")
            kwargs["kv_events_config"] = kv_events.KVEventsConfig(
                enable_kv_cache_events=True, publisher="zmq", endpoint=events_endpoint,
                replay_endpoint=replay_endpoint)
        if config.kv_transfer_config is not None:
            kv_transfer = import_vllm("vllm.config.kv_transfer")
            kwargs["kv_transfer_config"] = kv_transfer.KVTransferConfig(**dict(config.kv_transfer_config))
        figures = SchedulerFigures()
        try:
            args = arg_utils.AsyncEngineArgs(**kwargs)
            llm = await asyncio.to_thread(async_llm.AsyncLLM.from_engine_args, args,
                                          stat_loggers=[figures.logger_factory()])
        except Exception as exc:
            shutil.rmtree(run_dir, ignore_errors=True)
            message = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise ConfigError(f"vLLM did not start: {message} (vLLM's log above has the details)") from None
        try:
            spec, layout = _what_vllm_allocated(llm, folder.spec, config)
            device = config.device if not config.on_cpu else "cpu"
            if device == "cuda":
                device = "cuda:0"
            identity = EngineIdentity("vllm", str(vllm.__version__), device)
            _log_pool(layout, spec, config)
            subscriber = None
            if event_sink is not None:
                hasher = BlockHasher(layout.block_size, config.hash_seed)
                subscriber = KvEventSubscriber(events_endpoint, replay_endpoint,
                                               KvEventTranslator(event_sink, hasher))
                subscriber.start()
            return cls(config, llm, spec, layout, identity, folder.eos_token_ids, figures, subscriber, run_dir)
        except BaseException:
            llm.shutdown()
            shutil.rmtree(run_dir, ignore_errors=True)
            raise

    # -- what the worker registers ----------------------------------------------------------------
    @property
    def spec(self) -> ModelSpec:
        return self._spec

    @property
    def kv_layout(self) -> KvLayout:
        return self._layout

    @property
    def identity(self) -> EngineIdentity:
        return self._identity

    # -- requests -----------------------------------------------------------------------------------
    def generate(self, request_id: RequestId, prompt: Sequence[int], sampling: SamplingParams,
                 extra_args: Mapping[str, Any] | None = None,
                 on_final: Callable[[Any], None] | None = None, *, cache_salt: bytes = b"",
                 trace_headers: Mapping[str, str] | None = None, priority: int = 0, whole: bool = False,
                 sink: OutputSink | None = None) -> AsyncGenerator[RequestOutput, None]:
        """Prefill and decode in vLLM; an output per step with new tokens, the last one finished
        (``whole`` changes nothing: vLLM's outputs come as they come, and the caller merges them;
        ``sink`` is not used: every output comes through the stream, which the contract allows).

        Checked here first, as the project's engine checks (``InvalidRequestError`` and kin, nothing
        reaches vLLM): a non-empty prompt of ids in the vocabulary, prompt + ``max_tokens`` within
        vLLM's context, the whole request within the pool. ``extra_args``: vLLM's per-request
        ``SamplingParams.extra_args`` (a KV connector's ``kv_transfer_params`` go there); ``on_final``
        is called with vLLM's own finished ``RequestOutput`` before the finished output is yielded.
        ``cache_salt``: vLLM's own ``cache_salt`` (its hex), so vLLM's prefix cache keeps the salt's
        blocks apart; ``trace_headers``: W3C trace context vLLM's own spans join (when vLLM traces,
        ``--otlp-traces-endpoint``); ``priority``: vLLM's own (lower first), passed on when vLLM
        schedules by priority."""
        self._check()
        ids = validate_request(prompt, sampling, self._spec, num_blocks=self._layout.num_blocks,
                               block_size=self._layout.block_size)
        if request_id in self._live:
            raise InvalidRequestError(f"request id {request_id!r} is already in use")
        params = self._vllm_sampling(sampling, extra_args)
        aborted = asyncio.Event()
        self._live[request_id] = aborted
        return self._stream(request_id, list(ids), params, aborted, on_final, cache_salt, trace_headers,
                            priority if self._by_priority else 0)

    def _vllm_sampling(self, sampling: SamplingParams, extra_args: Mapping[str, Any] | None) -> Any:
        sp = self._sampling_module
        stop_ids = list(sampling.stop_token_ids)
        if not sampling.ignore_eos:  # every eos id of the folder, as the project's engine stops
            stop_ids.extend(t for t in self._eos if t not in stop_ids)
        try:
            return sp.SamplingParams(
                n=1, max_tokens=sampling.max_tokens, temperature=sampling.temperature, top_p=sampling.top_p,
                top_k=sampling.top_k, seed=sampling.seed, stop_token_ids=stop_ids, ignore_eos=sampling.ignore_eos,
                output_kind=sp.RequestOutputKind.DELTA, detokenize=False,
                extra_args=dict(extra_args) if extra_args else None)
        except ValueError as exc:  # vLLM's own check of a value ours let through
            raise InvalidRequestError(f"vLLM refused the sampling parameters: {exc}") from None

    async def _stream(self, request_id: RequestId, prompt: list[int], params: Any, aborted: asyncio.Event,
                      on_final: Callable[[Any], None] | None, cache_salt: bytes = b"",
                      trace_headers: Mapping[str, str] | None = None, priority: int = 0
                      ) -> AsyncGenerator[RequestOutput, None]:
        # A rendered token input (vLLM's TokensPrompt, already tokenized): no tokenizer, no preprocessing task.
        tokens = self._tokens_input(prompt, cache_salt=cache_salt.hex()) if cache_salt else self._tokens_input(prompt)
        outputs = self.llm.generate(tokens, params, request_id, trace_headers=trace_headers or None,
                                    priority=priority)
        produced = 0
        try:
            while True:
                try:
                    out = await outputs.__anext__()
                except StopAsyncIteration:
                    raise UnavailableError(f"vLLM ended request {request_id} without finishing it") from None
                except PdRouterError:
                    raise
                except Exception as exc:
                    raise self._error_of(exc) from None
                if aborted.is_set():
                    raise CancelledError("the request was aborted")
                completion = out.outputs[0]
                new = tuple(completion.token_ids)
                produced += len(new)
                reason = None
                if out.finished:
                    reason = _FINISH.get(str(completion.finish_reason))
                    if reason is None:
                        raise self._refusal(completion)
                    if on_final is not None:
                        on_final(out)
                yield RequestOutput(request_id, new, out.finished, reason, len(prompt), produced,
                                    int(out.num_cached_tokens or 0))
                if out.finished:
                    return
        finally:
            self._live.pop(request_id, None)
            await outputs.aclose()  # not finished: vLLM aborts the request (frees its blocks)
            if not self._live:
                self.figures.idle()

    def _refusal(self, completion: Any) -> PdRouterError:
        """A request vLLM finished otherwise than by a stop or the length: aborted or failed inside vLLM."""
        reason = str(completion.finish_reason)
        if reason == "abort":
            return self._error_of_abort()
        # As the project's engine reports a request its step could not compute: it fails alone.
        return PdRouterError(f"vLLM could not compute this request (finish reason {reason!r}, its log says why); "
                             f"it serves on")

    def _error_of_abort(self) -> PdRouterError:
        if self._failure.reason is not None or self.llm.errored:
            return UnavailableError(ENGINE_STOPPED)
        return CancelledError("vLLM aborted the request")

    def _error_of(self, exc: BaseException) -> PdRouterError:
        """vLLM's exception as the project's error (what the client reads)."""
        exceptions = import_vllm("vllm.exceptions")
        engine_exceptions = import_vllm("vllm.v1.engine.exceptions")
        if isinstance(exc, engine_exceptions.EngineDeadError) or self.llm.errored:
            self._fail("vLLM's engine core died")
            return UnavailableError(ENGINE_STOPPED)
        if isinstance(exc, exceptions.VLLMClientError):
            return InvalidRequestError(f"vLLM refused the request: {exc}")
        if isinstance(exc, exceptions.GracefulHTTPError):
            return UnavailableError(f"vLLM is busy: {exc.message}")
        if isinstance(exc, ValueError):  # vLLM's input checks raise plain ValueErrors too
            return InvalidRequestError(f"vLLM refused the request: {exc}")
        log.error("vLLM failed a request: %s: %s", type(exc).__name__, exc)
        return PdRouterError(f"vLLM could not compute this request ({type(exc).__name__}); it serves on")

    def abort(self, request_id: RequestId) -> bool:
        """End the request's stream (CancelledError there) and abort it in vLLM, which frees its blocks."""
        aborted = self._live.get(request_id)
        if aborted is None:
            return False
        aborted.set()
        task = asyncio.get_running_loop().create_task(self.llm.abort(request_id), name=f"vllm-abort-{request_id}")
        task.add_done_callback(_log_failed_abort)
        return True

    # -- load and health --------------------------------------------------------------------------
    def load(self) -> WorkerLoad:
        f = self.figures
        total = self._layout.num_blocks
        held = min(total, round(f.kv_usage * total))
        return WorkerLoad(running=f.running, waiting=f.waiting,
                          queued_prefill_tokens=int(self.llm.get_num_queued_tokens()),
                          free_blocks=total - held, total_blocks=total, allocated_blocks=held,
                          prefix_cache_queries=f.prefix_cache_queries, prefix_cache_hits=f.prefix_cache_hits,
                          engine_failed=self._failure.reason is not None)

    @property
    def failure(self) -> str | None:
        return self._failure.reason

    def on_failure(self, callback: Callable[[str], None]) -> None:
        self._failure.subscribe(callback)

    def _check(self) -> None:
        if self._failure.reason is not None or self._closed:
            raise UnavailableError(ENGINE_STOPPED)
        if self.llm.errored:
            self._fail("vLLM's engine core died")
            raise UnavailableError(ENGINE_STOPPED)

    def _fail(self, reason: str) -> None:
        if self._closed or not self._failure.fail(reason):
            return
        log.error("vLLM engine stopped: %s", reason)
        for aborted in self._live.values():
            aborted.set()

    async def _watch_engine(self) -> None:
        while not self._closed:
            if self.llm.errored:
                self._fail("vLLM's engine core died")
                return
            await asyncio.sleep(WATCH_INTERVAL_S)

    async def close(self) -> None:
        self._closed = True
        self._watch.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._watch
        if self.subscriber is not None:
            await asyncio.to_thread(self.subscriber.stop)
        await asyncio.to_thread(self.llm.shutdown)
        shutil.rmtree(self._run_dir, ignore_errors=True)


def _log_failed_abort(task: asyncio.Task[None]) -> None:
    if not task.cancelled() and task.exception() is not None:
        log.warning("aborting a request in vLLM failed: %r", task.exception())


def _what_vllm_allocated(llm: Any, folder_spec: ModelSpec, config: VllmEngineConfig) -> tuple[ModelSpec, KvLayout]:
    """The model as vLLM runs it (dtype, context length) and the KV pool it allocated.

    vLLM keeps one block of its pool aside (the null block, never given to a request), so the pool
    requests can use, the one registered, is one block smaller than ``num_gpu_blocks``."""
    vc = llm.vllm_config
    dtype = normalize_dtype(str(vc.model_config.dtype).removeprefix("torch."))
    spec = dataclasses.replace(folder_spec, dtype=dtype, max_context=int(vc.model_config.max_model_len))
    cache = vc.cache_config
    kv_dtype = dtype if cache.cache_dtype in (None, "auto") else normalize_dtype(str(cache.cache_dtype))
    usable = int(cache.num_gpu_blocks) - 1
    if usable <= 0:
        raise ConfigError(f"vLLM allocated {cache.num_gpu_blocks} KV blocks: no room for a request")
    layout = KvLayout.for_model(spec, usable, int(cache.block_size), dtype=kv_dtype, tp=config.tensor_parallel_size)
    return spec, layout


def _log_pool(layout: KvLayout, spec: ModelSpec, config: VllmEngineConfig) -> None:
    """One INFO line: the pool vLLM allocated beside the pool the capacity math predicted."""
    per_token = kv_bytes_per_token(spec, config.tensor_parallel_size, layout.dtype)
    block_bytes = per_token * layout.block_size
    actual = (layout.num_blocks + 1) * block_bytes
    predicted = ""
    if config.predicted_pool_bytes is not None:
        blocks = config.predicted_pool_bytes // block_bytes
        predicted = (f"; the capacity math (pdrouter capacity) predicted {blocks:,} blocks "
                     f"({config.predicted_pool_bytes / GiB:.2f} GiB): {(layout.num_blocks + 1) - blocks:+,} blocks")
    log.info("KV pool: vLLM allocated %s blocks of %d tokens at %s bytes per token = %.2f GiB (%s usable: one is "
             "vLLM's null block)%s", f"{layout.num_blocks + 1:,}", layout.block_size, f"{per_token:,}",
             actual / GiB, f"{layout.num_blocks:,}", predicted)
