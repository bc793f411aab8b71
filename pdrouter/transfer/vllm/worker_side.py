"""The connector's worker side: in each vLLM worker process, the transfer endpoints over vLLM's KV cache.

``register`` (once vLLM allocated the KV cache) dials the worker process's side channel, takes
the transfer's identity from it (token, epoch, backend, TLS, port: nothing secret passes through
vLLM's configuration) and opens a ``KvReceiver`` (decode engines) and a ``KvSender`` (prefill
engines) over the cache (``PagedPool``). Then, each step, from vLLM's engine thread:

* ``bind``: the step's plan (before the forward pass): receives and cancels go to the I/O loop
  (``Receives``), sends are opened (``Sends``);
* ``save_layer``: an attention layer wrote its KV: queue it for the step's sends;
* ``step_done``: after the pass: the sends' completions go to the I/O loop;
* ``results``: the requests whose transfers are over, for vLLM's scheduler.

Requests are named by the order's key on the channel and on the wire; vLLM's request ids only
name them to vLLM.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch

from pdrouter.core.aio import BackgroundTasks
from pdrouter.core.errors import ConfigError, PdRouterError
from pdrouter.core.tls import TlsFiles
from pdrouter.transfer.config import Backend, TransferConfig
from pdrouter.transfer.receiver import KvReceiver
from pdrouter.transfer.sender import KvSender
from pdrouter.transfer.vllm.channel import (
    ChannelError,
    GiveUp,
    Hello,
    Message,
    Ready,
    Retry,
    Welcome,
    encode,
    read_message,
    write_message,
)
from pdrouter.transfer.vllm.io_thread import IoThread
from pdrouter.transfer.vllm.paged_pool import PagedKvLayout, PagedPool
from pdrouter.transfer.vllm.receiving import Receives
from pdrouter.transfer.vllm.reports import Reports, StepReport
from pdrouter.transfer.vllm.sending import Sends
from pdrouter.transfer.vllm.step_plan import StepPlan

log = logging.getLogger("vllm.pdrouter.connector")

IDLE_WAIT_S = 0.005
"""How long a step that ran no forward pass waits for a transfer in flight to end (see ``results``)."""
RECEIVING_ROLES = ("kv_consumer", "kv_both")
SENDING_ROLES = ("kv_producer", "kv_both")


@dataclass(frozen=True)
class WorkerSideConfig:
    channel: str
    """The Unix socket the worker process serves."""
    kv_role: str
    rank: int
    world_size: int
    connect_timeout_s: float = 60.0
    decision_s: float = 10.0
    """How long a failed receive waits for the worker process to retry or give up (then: give up)."""


class WorkerSide:
    """One rank's half of the connector (see the module docstring)."""

    def __init__(self, config: WorkerSideConfig) -> None:
        self.config = config
        self._reports = Reports()
        self._io: IoThread | None = None
        self._writer: asyncio.StreamWriter | None = None
        self._layer_index: dict[str, int] = {}
        self._receiver: KvReceiver | None = None
        self._sender: KvSender | None = None
        self._receives: Receives | None = None
        self._sends: Sends | None = None
        self._reader: asyncio.Task[None] | None = None
        self._tasks = BackgroundTasks(log, "a side-channel request failed")
        self._forwarded = False
        self._closing = False

    # -- set-up ---------------------------------------------------------------------------------------
    def register(self, layer_names: Sequence[str], layers: Sequence[torch.Tensor], layout: PagedKvLayout) -> None:
        """Open the transfer endpoints over vLLM's KV views (``layers``, in layer order)."""
        pool = PagedPool(layers, layout)
        self._layer_index = {name: index for index, name in enumerate(layer_names)}
        self._io = IoThread(f"pdrouter-kv-rank{self.config.rank}")
        try:
            self._io.submit(self._connect(pool, layout)).result(self.config.connect_timeout_s)
        except Exception as exc:
            self.shutdown()
            reason = exc.message if isinstance(exc, PdRouterError) else f"{type(exc).__name__}: {exc}"
            raise ConfigError(f"the pd-router KV connector could not reach its worker process at "
                              f"{self.config.channel}: {reason} (start vLLM from a pd-router worker)") from None

    async def _connect(self, pool: PagedPool, layout: PagedKvLayout) -> None:
        cfg = self.config
        reader, writer = await asyncio.open_unix_connection(cfg.channel)
        await write_message(writer, Hello(cfg.rank, cfg.world_size, cfg.kv_role, os.getpid()))
        welcome = await read_message(reader)
        if not isinstance(welcome, Welcome):
            raise ChannelError(f"expected a welcome, got {welcome.type}")
        tls = TlsFiles.from_flags(welcome.tls_ca, welcome.tls_cert, welcome.tls_key)
        transfer = TransferConfig(auth_token=welcome.auth_token, epoch=welcome.epoch, backend=Backend(welcome.backend),
                                  tls=tls, tcp_congestion=welcome.tcp_congestion)
        assert self._io is not None
        post = self._post
        if cfg.kv_role in RECEIVING_ROLES:
            port = welcome.kv_port + cfg.rank if welcome.kv_port else 0
            self._receiver = KvReceiver(pool, layout, transfer, host=welcome.kv_host, port=port,
                                        advertise_host=welcome.kv_advertise_host)
            self._receives = Receives(self._receiver, pool, cfg.rank, layout.block_size, post, self._reports,
                                      cfg.decision_s)
        if cfg.kv_role in SENDING_ROLES:
            self._sender = KvSender(pool, layout, transfer)
            self._sends = Sends(self._sender, cfg.rank, post, self._reports, cuda=pool.is_cuda)
        self._writer = writer
        await write_message(writer, Ready(cfg.rank, self._receiver.address if self._receiver else "",
                                          layout.num_blocks, layout.block_size, layout.block_bytes,
                                          layout.compat_hash()))
        self._reader = asyncio.get_running_loop().create_task(self._read(reader))

    # -- engine thread --------------------------------------------------------------------------------
    def bind(self, plan: StepPlan) -> None:
        if plan.empty:
            return
        io = self._io
        assert io is not None
        for receive in plan.receives:
            if self._receives is None:
                log.warning("request %s: this engine receives no KV (kv_role %s); computing the prompt here",
                            receive.key, self.config.kv_role)
                self._reports.received(receive.req_id, failed=True)
            else:
                io.call(self._receives.plan, receive)
        for local in plan.locals:
            if self._receives is not None:
                io.call(self._receives.local, local)
        for cancel in plan.cancels:
            if self._receives is not None:
                io.spawn(self._receives.cancel(cancel))
        for send in plan.sends:
            if self._sends is None:
                log.warning("request %s: this engine sends no KV (kv_role %s)", send.key, self.config.kv_role)
                self._reports.sending(send.req_id)
                self._reports.sent(send.req_id)
            else:
                self._sends.plan(send)

    def save_layer(self, layer_name: str) -> None:
        self._forwarded = True
        if self._sends is not None:
            index = self._layer_index.get(layer_name)
            if index is not None:
                self._sends.layer(index)

    def step_done(self) -> None:
        if self._sends is not None:
            self._sends.step_done()

    def results(self, finished_req_ids: Iterable[str]) -> StepReport:
        """What is over; a step that ran no forward pass while transfers are in flight first waits for one
        to end, up to ``IDLE_WAIT_S``.

        vLLM steps without pause while a request waits for its KV or holds blocks for a send, and its
        engine and worker processes then spin: measured on two cores, that starved the transfer's own
        threads (a 4.7 MB transfer took ~0.6 s). The wait ends the moment a transfer does.
        """
        forwarded, self._forwarded = self._forwarded, False
        receiving = self._receives is not None and len(self._receives) > 0
        if not forwarded and (receiving or self._reports.pending_sends):
            self._reports.wait(IDLE_WAIT_S)
        return self._reports.take(finished_req_ids)

    def shutdown(self) -> None:
        self._closing = True
        for endpoint in (self._receiver, self._sender):
            if endpoint is not None:
                with contextlib.suppress(Exception):
                    endpoint.close()
        if self._sends is not None:
            self._sends.close()
        if self._io is not None:
            if self._writer is not None:
                self._io.call(self._writer.close)
            self._io.stop()

    # -- the side channel (I/O loop) ------------------------------------------------------------------
    def _post(self, message: Message) -> None:
        io = self._io
        if io is not None:
            io.call(self._write, message)

    def _write(self, message: Message) -> None:
        writer = self._writer
        if writer is not None and not writer.is_closing():
            writer.write(encode(message))

    async def _read(self, reader: asyncio.StreamReader) -> None:
        try:
            while True:
                message = await read_message(reader)
                if self._receives is None:
                    continue
                if isinstance(message, Retry):
                    self._tasks.spawn(self._receives.retry(message.key))
                elif isinstance(message, GiveUp):
                    self._tasks.spawn(self._receives.give_up(message.key, message.reason))
        except ChannelError as exc:
            if self._closing:
                return  # this side closed it
            log.warning("the pd-router worker process's side channel closed (%s): receives in flight are "
                        "computed here", exc.message)
            self._writer = None
            if self._receives is not None:
                await self._receives.give_up_all("the worker process went away")
