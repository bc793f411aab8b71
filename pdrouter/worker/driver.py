"""Drives a synchronous ``BatchEngine`` (torch or simulated) from asyncio: one step thread, per-request streams.

The step thread loops ``wait_for_work → step`` and hands each ``RequestOutput`` to the event
loop with ``call_soon_threadsafe``; coroutines consume them through a per-request ``_Outputs``. Leaving
a stream early (client cancelled, error) aborts the request in the engine, which frees its blocks.

A request the engine could not compute (``FinishReason.ERROR``) fails alone: its stream raises
``PdRouterError`` (INTERNAL) with the engine's reason, and the engine serves on.

Health: a step that raises ends the engine for good (a request that fails alone never raises
here: the engine finishes it with an error, see ``pdrouter.engine.batch_engine``). From then on
``failure`` says why, every request waiting on the engine and every new one fails with
UnavailableError, and the ``on_failure`` callbacks run once, on the event loop, before any
waiter hears of it: the worker process reports itself NOT_SERVING there.

``EngineDriver`` is the project's engine behind the worker's engine contract
(``pdrouter.worker.engine_contract.DisaggregatedEngine``).
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections import deque
from collections.abc import AsyncGenerator, Callable, Mapping, Sequence

from pdrouter.core.errors import CancelledError, PdRouterError, UnavailableError
from pdrouter.core.ids import RequestId
from pdrouter.core.kv_layout import KvLayout
from pdrouter.core.model_spec import ModelSpec
from pdrouter.core.sampling import SamplingParams
from pdrouter.core.workers import EngineIdentity, WorkerLoad
from pdrouter.engine.batch_engine import BatchEngine
from pdrouter.engine.health import EngineFailure
from pdrouter.engine.outputs import KvReservation, OutputSink, PrefillResult, RequestOutput
from pdrouter.worker.whole_outputs import WholeMerge

log = logging.getLogger(__name__)

_ENGINE_FAILED = object()
_ABORTED = object()

INLINE_CHECK_BYTES = 4 << 20
"""Received KV up to this size is checked on the event loop (well under a millisecond at the ~9 GB/s a
contiguous bfloat16 sum runs on one core); larger KV in a thread."""

ENGINE_STOPPED = "this worker's engine stopped after an internal error and serves no more requests"
"""What callers are told once the engine failed (the error itself is in the worker's log)."""


class _Outputs:
    """One request's outputs on their way from the step thread's deliveries to its consumer, on the
    event loop: a deque and at most one waiter (``asyncio.Queue`` keeps bounds, task counts and
    waiter lists that a channel with one consumer has no use for, at every token).

    ``whole`` (a caller that does not stream): the first output with tokens goes at once; the
    tokens of the outputs after it are held and go merged with the finished one (``WholeMerge``,
    the rule of ``whole_outputs``), so the consumer wakes twice, not once a step."""

    __slots__ = ("items", "merge", "sink", "waiter")

    def __init__(self, whole: bool = False, sink: OutputSink | None = None) -> None:
        self.items: deque[RequestOutput | object] = deque()
        self.waiter: asyncio.Future[None] | None = None
        self.merge = WholeMerge(first_alone=True) if whole else None
        self.sink = None if whole else sink

    def put(self, item: RequestOutput | object) -> None:
        merge = self.merge
        if merge is not None and type(item) is RequestOutput and item.error is None:
            merged = merge.add(item)
            if merged is None:
                return
            item = merged
        waiter = self.waiter
        # The sink takes an unfinished output only while the consumer waits with nothing queued: every
        # output before this one has then gone through the consumer (or the sink), so order holds. (A
        # waiter already done was cancelled with its consumer, which is leaving.)
        if (waiter is not None and self.sink is not None and not self.items and type(item) is RequestOutput
                and not item.finished and item.error is None and not waiter.done() and self.sink(item)):
            return
        self.items.append(item)
        if waiter is not None:
            self.waiter = None
            if not waiter.done():
                waiter.set_result(None)

    async def get(self) -> RequestOutput | object:
        items = self.items
        while not items:
            waiter = self.waiter = asyncio.get_running_loop().create_future()
            await waiter
        return items.popleft()


class EngineDriver:
    """The asyncio face of one engine. Create and use it inside the worker's event loop."""

    def __init__(self, engine: BatchEngine, identity: EngineIdentity | None = None) -> None:
        self.engine = engine
        self._identity = identity or EngineIdentity("torch", "", "")
        self._loop = asyncio.get_running_loop()
        self._queues: dict[RequestId, _Outputs] = {}
        self._stop = threading.Event()
        self._error: BaseException | None = None
        self._failure = EngineFailure()
        self._thread = threading.Thread(target=self._run, name="engine-step", daemon=True)
        self._thread.start()

    # -- what the worker registers -------------------------------------------------------------
    @property
    def spec(self) -> ModelSpec:
        return self.engine.spec

    @property
    def kv_layout(self) -> KvLayout:
        return self.engine.kv_layout

    @property
    def identity(self) -> EngineIdentity:
        return self._identity

    # -- step thread ------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                if not self.engine.wait_for_work(timeout=0.05):
                    continue
                outputs = self.engine.step()
                if outputs:
                    self._loop.call_soon_threadsafe(self._deliver, outputs)
        except BaseException as exc:  # the engine is broken: fail every waiter, refuse new work
            log.exception("engine step failed; the engine serves no more requests")
            self._error = exc
            if not self._loop.is_closed():
                self._loop.call_soon_threadsafe(self._failed, f"{type(exc).__name__}: {exc}")

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            queue = self._queues.get(out.request_id)
            if queue is not None:
                queue.put(out)

    def _failed(self, reason: str) -> None:
        """On the loop: tell the subscribers first, then every waiter."""
        self._failure.fail(reason)
        for queue in self._queues.values():
            queue.put(_ENGINE_FAILED)

    def _check(self) -> None:
        if self._error is not None:
            raise UnavailableError(ENGINE_STOPPED)

    # -- health -----------------------------------------------------------------------------
    @property
    def failure(self) -> str | None:
        """None while the engine serves; once its step failed, the error (for logs and operators,
        not for clients)."""
        return self._failure.reason

    def on_failure(self, callback: Callable[[str], None]) -> None:
        """Call ``callback(failure)`` once, on the event loop, when the engine fails (at once if it has)."""
        self._failure.subscribe(callback)

    async def close(self) -> None:
        self._stop.set()
        await asyncio.to_thread(self._thread.join, 10.0)

    # -- requests ---------------------------------------------------------------------------
    def _open(self, request_id: RequestId, whole: bool = False, sink: OutputSink | None = None) -> _Outputs:
        self._check()
        queue = _Outputs(whole, sink)
        self._queues[request_id] = queue
        return queue

    @staticmethod
    def _checked(item: RequestOutput | object) -> RequestOutput:
        """The output ``item`` is; raises what it stands for when it is a failure or an end."""
        if item is _ENGINE_FAILED:
            raise UnavailableError(ENGINE_STOPPED)
        if item is _ABORTED:
            raise CancelledError("the request was released")
        assert isinstance(item, RequestOutput)
        if item.error is not None:
            raise PdRouterError(f"the engine could not compute this request ({item.error}); it serves on")
        return item

    async def _next(self, queue: _Outputs) -> RequestOutput:
        return self._checked(await queue.get())

    async def _stream(self, request_id: RequestId,
                      queue: _Outputs) -> AsyncGenerator[RequestOutput, None]:
        # ``_next`` inlined, with the loop at hand: this runs once per token of every stream, and each
        # coroutine it awaits would be one more frame for every output to pass through.
        finished = False
        items, loop, checked = queue.items, self._loop, self._checked
        try:
            while not finished:
                while not items:
                    waiter = queue.waiter = loop.create_future()
                    await waiter
                out = checked(items.popleft())
                finished = out.finished
                yield out
        finally:
            self._queues.pop(request_id, None)
            if not finished:
                self.engine.abort(request_id)

    def generate(self, request_id: RequestId, prompt: Sequence[int], sampling: SamplingParams, *,
                 cache_salt: bytes = b"", trace_headers: Mapping[str, str] | None = None, priority: int = 0,
                 whole: bool = False, sink: OutputSink | None = None) -> AsyncGenerator[RequestOutput, None]:
        """Prefill and decode here; outputs until the finished one (``whole``: merged after the first
        with tokens, see ``_Outputs``; ``sink``: see ``OutputSink``). Validation errors raise now.
        (``trace_headers`` are for engines that trace themselves; this one does not.)"""
        queue = self._open(request_id, whole, sink)
        try:
            self.engine.add_request(request_id, prompt, sampling, cache_salt=cache_salt, priority=priority)
        except PdRouterError:
            self._queues.pop(request_id, None)
            raise
        return self._stream(request_id, queue)

    async def prefill(self, request_id: RequestId, prompt: Sequence[int], sampling: SamplingParams, *,
                      cache_salt: bytes = b"", priority: int = 0) -> PrefillResult:
        """Run the prompt; the blocks stay held until ``release`` / ``abort``."""
        queue = self._open(request_id)
        try:
            self.engine.add_prefill_request(request_id, prompt, sampling, cache_salt=cache_salt, priority=priority)
        except PdRouterError:
            self._queues.pop(request_id, None)
            raise
        try:
            out = await self._next(queue)
        except BaseException:
            self.engine.abort(request_id)
            raise
        finally:
            self._queues.pop(request_id, None)
        assert out.prefill is not None
        return out.prefill

    def reserve_remote(self, request_id: RequestId, prompt: Sequence[int], sampling: SamplingParams, *,
                       cache_salt: bytes = b"") -> KvReservation:
        self._check()
        return self.engine.reserve_remote(request_id, prompt, sampling, cache_salt=cache_salt)

    async def check_received_kv(self, request_id: RequestId, kv_bytes: int) -> None:
        """The engine's check of a reservation's received KV (TransferError when it holds a value that is
        not finite; abort the request then). ``kv_bytes`` of it: above ``INLINE_CHECK_BYTES`` it runs
        in a thread, so the event loop keeps serving meanwhile."""
        if kv_bytes <= INLINE_CHECK_BYTES:
            self.engine.check_remote_kv(request_id)
        else:
            await asyncio.to_thread(self.engine.check_remote_kv, request_id)

    def decode_remote(self, request_id: RequestId, first_token: int, *, whole: bool = False,
                      sink: OutputSink | None = None) -> AsyncGenerator[RequestOutput, None]:
        """After the KV landed: decode from ``first_token``; yields outputs from the second token on
        (``whole``: as ``generate``'s).

        When ``first_token`` alone finishes the request, the stream yields one finished output
        with no new tokens.
        """
        queue = self._open(request_id, whole, sink)
        try:
            reason = self.engine.commit_remote(request_id, first_token)
        except BaseException:
            self._queues.pop(request_id, None)
            self.engine.abort(request_id)
            raise
        if reason is not None:
            self._queues.pop(request_id, None)
            return _finished_now(request_id, reason)
        return self._stream(request_id, queue)

    def release(self, request_id: RequestId) -> None:
        self.engine.release(request_id)

    def abort(self, request_id: RequestId) -> bool:
        """Abort in the engine (freeing its blocks) and end the request's stream, if one is open."""
        queue = self._queues.get(request_id)
        if queue is not None:
            queue.put(_ABORTED)
        return self.engine.abort(request_id)

    def load(self) -> WorkerLoad:
        s = self.engine.stats()
        sim_stats = getattr(self.engine, "sim_stats", None)  # a simulated GPU reports how well it kept time
        sim = sim_stats() if sim_stats is not None else None
        modeled, late = (sim.busy_s, sim.late_s) if sim is not None else (0.0, 0.0)
        backlog = self.engine.queued_prefill_by_priority()
        return WorkerLoad(running=s.num_running + s.num_held + s.num_awaiting_kv, waiting=s.num_waiting,
                          queued_prefill_tokens=sum(tokens for _, tokens in backlog),
                          queued_prefill_by_priority=backlog,
                          free_blocks=s.num_free_blocks, total_blocks=s.num_blocks,
                          allocated_blocks=s.num_blocks - s.num_free_blocks,
                          sim_modeled_s=modeled, sim_late_s=late, engine_failed=self._error is not None,
                          prefix_cache_queries=s.prefix_cache_queries, prefix_cache_hits=s.prefix_cache_hits)


async def _finished_now(request_id: RequestId, reason: object) -> AsyncGenerator[RequestOutput, None]:
    from pdrouter.engine.outputs import FinishReason

    assert isinstance(reason, FinishReason)
    yield RequestOutput(request_id, (), True, reason, 0, 1, 0)
