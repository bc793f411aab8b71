"""An in-process fake of the transport: same handles, same checks, no sockets.

``LocalFabric`` stands in for the network inside one process: receivers register under an
address, senders reach them by it, and a frame is a tensor-to-tensor copy done synchronously
inside ``send_layers``. Expectations, block validation, the state machine, aborts and deadlines
are the real ones (``ExpectationBook``, ``IncomingTransfer``, ``OutgoingTransfer``), so worker
tests written against it hold for ``KvReceiver`` / ``KvSender`` as well.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Sequence

import torch

from pdrouter.core.errors import IncompatibleError, PdRouterError, StaleEpochError
from pdrouter.core.kv_layout import KvLayout
from pdrouter.transfer import frames
from pdrouter.transfer.errors import PeerLostError, code_for_error, error_for_code
from pdrouter.transfer.expectations import ExpectationBook
from pdrouter.transfer.incoming import IncomingTransfer
from pdrouter.transfer.outgoing import BeginItem, DataItem, EndItem, OutgoingTransfer, OutItem
from pdrouter.transfer.pool_view import PoolView
from pdrouter.transfer.target import TransferTarget

_FRAME_BYTES = 16 << 20


class LocalFabric:
    """A registry of in-process receivers, addressed like real ones (``local-N:port``)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._receivers: dict[str, LocalReceiver] = {}
        self._ports = itertools.count(1)

    def receiver(self, pool: torch.Tensor, layout: KvLayout, epoch: int,
                 abort_grace_s: float = 2.0) -> LocalReceiver:
        with self._lock:
            address = f"local:{next(self._ports)}"
            receiver = LocalReceiver(self, PoolView(pool, layout), epoch, address, abort_grace_s)
            self._receivers[address] = receiver
        return receiver

    def sender(self, pool: torch.Tensor, layout: KvLayout, epoch: int) -> LocalSender:
        return LocalSender(self, PoolView(pool, layout), epoch)

    def find(self, address: str) -> LocalReceiver:
        with self._lock:
            receiver = self._receivers.get(address)
        if receiver is None:
            raise PeerLostError(f"no receiver at {address}")
        return receiver

    def remove(self, address: str) -> None:
        with self._lock:
            self._receivers.pop(address, None)


class LocalReceiver:
    """``TransferReceiver`` without a network."""

    def __init__(self, fabric: LocalFabric, view: PoolView, epoch: int, address: str,
                 abort_grace_s: float) -> None:
        self._fabric = fabric
        self.view = view
        self.address = address
        self._epoch = epoch
        self.compat_hash = view.layout.compat_hash()
        self.book = ExpectationBook(view.layout, address=address, epoch=epoch, backend="tcp",
                                    abort_grace_s=abort_grace_s)

    @property
    def epoch(self) -> int:
        return self._epoch

    def expect(self, transfer_id: str, dst_block_ids: Sequence[int], *, skip_blocks: int = 0,
               layers: range | None = None, sender_epoch: int = 0,
               timeout_s: float | None = None) -> IncomingTransfer:
        return self.book.expect(transfer_id, dst_block_ids, skip_blocks=skip_blocks, layers=layers,
                                sender_epoch=sender_epoch, timeout_s=timeout_s)

    def close(self) -> None:
        self._fabric.remove(self.address)
        self.book.close("the receiver is shutting down")


class LocalSender:
    """``TransferSender`` without a network: frames are copied within ``send_layers``."""

    def __init__(self, fabric: LocalFabric, view: PoolView, epoch: int) -> None:
        self._fabric = fabric
        self._view = view
        self._epoch = epoch
        self._compat = view.layout.compat_hash()

    @property
    def epoch(self) -> int:
        return self._epoch

    def connect(self, peer: str) -> None:
        self._fabric.find(peer)

    def open_transfer(self, target: TransferTarget) -> OutgoingTransfer:
        receiver = self._fabric.find(target.peer)
        if receiver.epoch != target.epoch:
            raise StaleEpochError(f"transfer {target.transfer_id}: receiver {target.peer} is epoch "
                                  f"{receiver.epoch}, the target was issued by epoch {target.epoch}")
        link = _LocalLink(receiver, self._view, self._epoch, self._compat)
        if not self._compat == target.compat_hash == receiver.compat_hash:
            error = IncompatibleError(f"transfer {target.transfer_id}: KV layouts differ (sender "
                                      f"{self._compat}, receiver {receiver.compat_hash})")
            link.refuse(target.transfer_id, error)
            raise error
        transfer = OutgoingTransfer(target, self._view, link, max_frame_bytes=_FRAME_BYTES, max_runs=1024,
                                    on_finished=lambda _: None)
        if not transfer.state.terminal:
            link.submit(transfer, [transfer.begin_item()])
        return transfer

    def close(self) -> None:
        return None


class _LocalLink:
    """The ``FrameSink`` of one local sender/receiver pair: runs each item at once."""

    def __init__(self, receiver: LocalReceiver, sender_view: PoolView, sender_epoch: int,
                 sender_compat: str) -> None:
        self._receiver = receiver
        self._sender_view = sender_view
        self._sender_epoch = sender_epoch
        self._sender_compat = sender_compat

    def submit(self, transfer: OutgoingTransfer, items: Sequence[OutItem], *, write: bool = False) -> None:
        incoming = self._receiver.book.lookup(transfer.transfer_id)
        try:
            for item in items:
                if transfer.state.terminal:
                    return
                if incoming is None:
                    raise self._receiver.book.why_gone(transfer.transfer_id)
                self._run(transfer, incoming, item)
        except PdRouterError as exc:
            if incoming is not None:
                incoming.fail(exc, tell_peer=False)
            transfer.fail(exc, tell_peer=False)

    def cancel(self, transfer: OutgoingTransfer, error: PdRouterError | None) -> None:
        if error is not None:
            self.refuse(transfer.transfer_id, error)

    def write_now(self, transfer: OutgoingTransfer) -> None:
        return None  # items run as they are submitted

    def refuse(self, transfer_id: str, error: PdRouterError) -> None:
        incoming = self._receiver.book.lookup(transfer_id)
        if incoming is not None and incoming.target.sender_epoch in (0, self._sender_epoch):
            incoming.fail(error_for_code(code_for_error(error), f"sender: {error.message}"), tell_peer=False)

    def _run(self, transfer: OutgoingTransfer, incoming: IncomingTransfer, item: OutItem) -> None:
        if isinstance(item, BeginItem):
            t = transfer.target
            begin = frames.Begin(t.transfer_id, t.epoch, self._sender_compat, t.dst_block_ids, t.skip_blocks,
                               t.layer_start, t.layer_end)
            incoming.bind(begin, self._sender_epoch, self._sender_compat, self._receiver.compat_hash,
                          lambda error: transfer.fail(error, tell_peer=False), lambda: None)
        elif isinstance(item, DataItem):
            src, dst = item.frame.src, item.frame.dst
            positions = incoming.positions_of(dst.layer_start, dst.layer_end, dst.runs)
            with incoming.write_guard() as allowed:
                if allowed:
                    for s, d in zip(self._sender_view.tensors(src), self._receiver.view.tensors(dst),
                                    strict=True):
                        d.copy_(s)
            if allowed:
                incoming.mark_landed(dst.layer_start, dst.layer_end, positions, item.frame.nbytes)
                if incoming.state.terminal and incoming.error is None:
                    transfer.complete()
        elif isinstance(item, EndItem):
            incoming.end_of_stream()

