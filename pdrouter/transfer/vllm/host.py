"""The worker process's end of its vLLM engine's connector: the side channel's server and per-request links.

A pd-router worker that runs a vLLM engine for a prefill or decode role starts a ``ConnectorHost``
before the engine, gives vLLM ``host.kv_transfer_config()`` and waits for the connector's ranks
(``wait_ready``: the engine's KV pool as the connector sees it). Then, per request:

* decode: ``link = host.receive(key)`` before submitting the request with its ``ReceiveOrder``;
  ``await link.placement()`` says where the KV goes (a ``Placement``: the targets to hand to a
  prefill worker) or that the prompt is computed here (``LocalPrefill``); ``await link.landed()``
  says the KV landed (or raises the attempt's error); ``link.retry()`` invites it again (for the
  next prefill worker), ``link.give_up(reason)`` makes the engine compute the prompt itself;
* prefill: ``link = host.send(key)`` before submitting the request with its ``SendOrder``;
  ``await link.sent()`` says the decode side confirmed every block (or raises).

Links are context managers; a link's waits raise ``ChannelError`` if the engine goes away.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from types import TracebackType
from typing import Any, Self

from pdrouter.core.aio import BackgroundTasks
from pdrouter.core.errors import DeadlineExceededError, PdRouterError
from pdrouter.transfer.config import TransferConfig
from pdrouter.transfer.target import TransferTarget
from pdrouter.transfer.vllm.channel import (
    ChannelError,
    GiveUp,
    Hello,
    Local,
    Message,
    Outcome,
    Ready,
    Received,
    Reserved,
    Retry,
    Sent,
    Welcome,
    read_message,
    write_message,
)
from pdrouter.transfer.vllm.orders import target_from_dict

log = logging.getLogger(__name__)

CONNECTOR_CLASS = "PdRouterConnector"
CONNECTOR_MODULE = "pdrouter.transfer.vllm.connector"
KV_ROLES = ("kv_producer", "kv_consumer", "kv_both")


@dataclass(frozen=True)
class EnginePool:
    """One vLLM engine's KV pool as its connector's ranks reported it."""

    world_size: int
    receivers: tuple[str, ...]
    """Each rank's KV receiver (empty strings on a prefill-only engine)."""
    num_blocks: int
    block_size: int
    block_bytes: int
    """Bytes of one block across every layer, per rank."""
    compat_hash: str


@dataclass(frozen=True)
class Placement:
    """Decode: the engine reserved the prompt's blocks and invited its KV into them."""

    targets: tuple[TransferTarget, ...]
    """One per rank: what the prefill worker's ranks send to."""
    cached_tokens: int
    """Prompt tokens this engine holds already (not sent)."""
    attempt: int


@dataclass(frozen=True)
class LocalPrefill:
    """Decode: the engine computes the prompt itself (little of it is not cached here)."""

    cached_tokens: int


@dataclass(frozen=True)
class Landed:
    """Decode: an earlier attempt's KV landed after all (it was given up on too early); nothing more to send."""

    attempt: int


@dataclass(frozen=True)
class TransferResult:
    nbytes: int
    """Bytes moved, every rank together."""
    seconds: float
    """The slowest rank's time (receiver: from the invitation; sender: from its first frame queued)."""
    tail_s: float = 0.0
    """Sender: the slowest rank's time from the end of its forward pass to the confirmation."""


def _combine(outcomes: list[Outcome]) -> TransferResult:
    for outcome in outcomes:
        error = outcome.error()
        if error is not None:
            raise error
    return TransferResult(sum(o.nbytes for o in outcomes), max((o.seconds for o in outcomes), default=0.0),
                          max((o.tail_s for o in outcomes), default=0.0))


class _Link:
    def __init__(self, host: ConnectorHost, key: str) -> None:
        self.host = host
        self.key = key
        self._changed = asyncio.Event()

    def notify(self) -> None:
        self._changed.set()

    async def _until(self, ready: Callable[[], Any], timeout: float | None, what: str) -> Any:
        loop = asyncio.get_running_loop()
        deadline = None if timeout is None else loop.time() + timeout
        while True:
            self._changed.clear()
            result = ready()
            if result is not None:
                return result
            if self.host.lost is not None:
                raise self.host.lost
            left = None if deadline is None else deadline - loop.time()
            if left is not None and left <= 0:
                raise DeadlineExceededError(f"request {self.key}: no {what} from the vLLM engine within {timeout}s")
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._changed.wait(), left)

    def close(self) -> None:
        self.host._forget(self)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()


class ReceiveLink(_Link):
    """A decode request's view of its receive (see the module docstring)."""

    def __init__(self, host: ConnectorHost, key: str) -> None:
        super().__init__(host, key)
        self.attempt = 0
        self._reserved: dict[int, dict[int, Reserved]] = {}
        self._received: dict[int, dict[int, Outcome]] = {}
        self._local: Local | None = None

    def on(self, message: Reserved | Received | Local) -> None:
        if isinstance(message, Local):
            self._local = message
        elif isinstance(message, Reserved):
            self._reserved.setdefault(message.attempt, {})[message.rank] = message
        else:
            self._received.setdefault(message.attempt, {})[message.rank] = message.outcome
        self.notify()

    async def placement(self, timeout: float | None = None) -> Placement | LocalPrefill | Landed:
        """Where the KV goes for the current attempt, or that the prompt is computed here, or that an
        earlier attempt's KV landed after all; raises the current attempt's error if it failed."""
        return await self._until(self._placement, timeout, "placement")

    async def landed(self, timeout: float | None = None) -> TransferResult:
        """Every rank's KV of the current attempt landed; raises the attempt's error if it failed."""
        return await self._until(self._landed, timeout, "KV")

    def retry(self) -> None:
        """Invite the KV again (a new attempt, fresh targets): the last attempt failed or never started."""
        self.attempt += 1
        self.host._broadcast(Retry(self.key))

    def give_up(self, reason: str) -> None:
        """No prefill worker will send: the engine computes the prompt itself."""
        self.host._broadcast(GiveUp(self.key, reason))

    def _placement(self) -> Placement | LocalPrefill | Landed | None:
        if self._local is not None:
            return LocalPrefill(self._local.cached_tokens)
        for attempt in range(self.attempt):
            outcomes = self._received.get(attempt, {})
            if len(outcomes) == self.host.world_size and all(o.ok for o in outcomes.values()):
                return Landed(attempt)
        failed = self._failure()
        if failed is not None:
            raise failed
        ranks = self._reserved.get(self.attempt, {})
        if len(ranks) < self.host.world_size:
            return None
        ordered = [ranks[r] for r in range(self.host.world_size)]
        return Placement(tuple(target_from_dict(r.target) for r in ordered), ordered[0].cached_tokens, self.attempt)

    def _landed(self) -> TransferResult | None:
        failed = self._failure()
        if failed is not None:
            raise failed
        outcomes = self._received.get(self.attempt, {})
        if len(outcomes) < self.host.world_size:
            return None
        return _combine(list(outcomes.values()))

    def _failure(self) -> PdRouterError | None:
        for outcome in self._received.get(self.attempt, {}).values():
            if not outcome.ok:
                return outcome.error()
        return None


class SendLink(_Link):
    """A prefill request's view of its send."""

    def __init__(self, host: ConnectorHost, key: str) -> None:
        super().__init__(host, key)
        self._sent: dict[int, Outcome] = {}

    def on(self, message: Sent) -> None:
        self._sent[message.rank] = message.outcome
        self.notify()

    async def sent(self, timeout: float | None = None) -> TransferResult:
        """Every rank's blocks confirmed by the decode side; raises the first failure."""
        return await self._until(self._done, timeout, "send confirmation")

    def _done(self) -> TransferResult | None:
        for outcome in self._sent.values():
            if not outcome.ok:
                raise outcome.error() or ChannelError("send failed")
        if len(self._sent) < self.host.world_size:
            return None
        return _combine(list(self._sent.values()))


class ConnectorHost:
    """Serves one vLLM engine's connector (all its ranks) on a private Unix socket."""

    def __init__(self, transfer: TransferConfig, kv_role: str, *, kv_host: str = "127.0.0.1",
                 kv_advertise_host: str | None = None, kv_port: int = 0) -> None:
        if kv_role not in KV_ROLES:
            raise ValueError(f"kv_role must be one of {KV_ROLES}, got {kv_role!r}")
        self.transfer = transfer
        self.kv_role = kv_role
        self.kv_host = kv_host
        self.kv_advertise_host = kv_advertise_host or ("127.0.0.1" if kv_host in ("0.0.0.0", "::", "") else kv_host)
        self.kv_port = kv_port
        self._dir = tempfile.mkdtemp(prefix="pdrouter-kv-")  # mode 0700: only this user may dial
        self.socket_path = os.path.join(self._dir, "connector.sock")
        self._server: asyncio.Server | None = None
        self._writers: dict[int, asyncio.StreamWriter] = {}
        self._ready: dict[int, Ready] = {}
        self._world_size = 0
        self._ready_event = asyncio.Event()
        self._links: dict[str, ReceiveLink | SendLink] = {}
        self._tasks = BackgroundTasks(log, "connector side channel")
        self.lost: ChannelError | None = None
        self.pool: EnginePool | None = None
        """The engine's pool, once ``wait_ready`` returned."""
        self._closing = False
        """Set once the engine is being stopped (``stopping``, ``close``)."""

    @property
    def world_size(self) -> int:
        return self._world_size

    async def start(self) -> None:
        self._server = await asyncio.start_unix_server(self._serve, path=self.socket_path)

    def kv_transfer_config(self, **extra: Any) -> dict[str, Any]:
        """vLLM's ``kv_transfer_config`` for this engine (``KVTransferConfig(**...)``, or JSON for the CLI)."""
        return {"kv_connector": CONNECTOR_CLASS, "kv_connector_module_path": CONNECTOR_MODULE,
                "kv_role": self.kv_role, "kv_load_failure_policy": "recompute",
                "kv_connector_extra_config": {"channel": self.socket_path, **extra}}

    async def wait_ready(self, timeout: float | None = None) -> EnginePool:
        """The engine's pool, once every rank of its connector said it is ready."""
        try:
            await asyncio.wait_for(self._ready_event.wait(), timeout)
        except TimeoutError:
            raise DeadlineExceededError(f"the vLLM engine's KV connector did not dial {self.socket_path} "
                                        f"within {timeout}s") from None
        ranks = [self._ready[r] for r in range(self._world_size)]
        self.pool = EnginePool(self._world_size, tuple(r.receiver for r in ranks), ranks[0].num_blocks,
                               ranks[0].block_size, ranks[0].block_bytes, ranks[0].compat_hash)
        return self.pool

    def receive(self, key: str) -> ReceiveLink:
        return self._register(ReceiveLink(self, key))

    def send(self, key: str) -> SendLink:
        return self._register(SendLink(self, key))

    @property
    def open_links(self) -> int:
        return len(self._links)

    def stopping(self) -> None:
        """The engine is being stopped: its connector's channel closing is no news (not logged)."""
        self._closing = True

    async def close(self) -> None:
        """Stop serving; the engine's connector sees its channel close (stop the engine first)."""
        self._closing = True
        if self._server is not None:
            self._server.close()
        for writer in list(self._writers.values()):
            writer.close()
        await self._tasks.wait(timeout=5.0)
        await self._tasks.cancel_all()
        shutil.rmtree(self._dir, ignore_errors=True)

    # -- internals ------------------------------------------------------------------------------------
    def _register(self, link: Any) -> Any:
        if link.key in self._links:
            raise ValueError(f"request {link.key} already has a link")
        self._links[link.key] = link
        return link

    def _forget(self, link: _Link) -> None:
        if self._links.get(link.key) is link:
            del self._links[link.key]

    def _broadcast(self, message: Message) -> None:
        for writer in self._writers.values():
            self._tasks.spawn(write_message(writer, message))

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        if task is not None:
            self._tasks.spawn(task)
        rank = -1
        try:
            hello = await read_message(reader)
            if not isinstance(hello, Hello):
                raise ChannelError(f"expected a hello, got {hello.type}")
            rank = hello.rank
            tls = self.transfer.tls
            await write_message(writer, Welcome(
                self.transfer.auth_token, self.transfer.epoch, self.transfer.backend.value, self.kv_host,
                self.kv_advertise_host, self.kv_port, tls.ca if tls else None, tls.cert if tls else None,
                tls.key if tls else None, self.transfer.tcp_congestion))
            ready = await read_message(reader)
            if not isinstance(ready, Ready):
                raise ChannelError(f"expected ready, got {ready.type}")
            self._writers[rank] = writer
            self._ready[rank] = ready
            self._world_size = hello.world_size
            if len(self._ready) == hello.world_size:
                self.lost = None
                self._ready_event.set()
            while True:
                self._dispatch(await read_message(reader))
        except ChannelError as exc:
            if rank >= 0:
                if not self._closing:
                    log.warning("vLLM connector rank %d: %s", rank, exc.message)
                self.lost = ChannelError(f"the vLLM engine's connector (rank {rank}) went away: {exc.message}")
                self._writers.pop(rank, None)
                self._ready.pop(rank, None)
                self._ready_event.clear()
                for link in list(self._links.values()):
                    link.notify()
        finally:
            writer.close()

    def _dispatch(self, message: Message) -> None:
        key = getattr(message, "key", None)
        link = self._links.get(key) if isinstance(key, str) else None
        if isinstance(message, Reserved | Received | Local):
            if isinstance(link, ReceiveLink):
                link.on(message)
        elif isinstance(message, Sent) and isinstance(link, SendLink):
            link.on(message)
