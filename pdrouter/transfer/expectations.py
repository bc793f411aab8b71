"""The receiver's book of expectations: open transfers by id, their deadlines, and recent outcomes."""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Sequence

from pdrouter.core.errors import CancelledError, InvalidRequestError, PdRouterError
from pdrouter.core.kv_layout import KvLayout
from pdrouter.transfer.deadlines import DeadlineWatch, Entry
from pdrouter.transfer.errors import UnknownTransferError
from pdrouter.transfer.incoming import IncomingTransfer
from pdrouter.transfer.target import TransferTarget, check_block_ids

REMEMBERED = 4096
"""How many finished transfer ids are remembered, to tell a late sender what happened."""


class ExpectationBook:
    """Creates, finds and forgets ``IncomingTransfer`` expectations; expires them at their deadline.

    Shared by every receiver implementation (the TCP/gloo/NCCL one and the in-process fake), so
    they validate and expire expectations identically.
    """

    def __init__(self, layout: KvLayout, *, address: str, epoch: int, backend: str,
                 abort_grace_s: float) -> None:
        self._layout = layout
        self._compat = layout.compat_hash()
        self._address = address
        self._epoch = epoch
        self._backend = backend
        self._grace = abort_grace_s
        self._lock = threading.Lock()
        self._open: dict[str, IncomingTransfer] = {}
        self._gone: OrderedDict[str, PdRouterError | None] = OrderedDict()
        self._closed = False
        self._deadlines: DeadlineWatch | None = None
        self._timers: dict[str, Entry] = {}
        """The deadline of each open expectation that has one (cancelled when it finishes)."""

    def expect(self, transfer_id: str, dst_block_ids: Sequence[int], *, skip_blocks: int = 0,
               layers: range | None = None, sender_epoch: int = 0,
               timeout_s: float | None = None) -> IncomingTransfer:
        """See ``KvReceiver.expect``."""
        num_layers = self._layout.num_layers
        layers = range(num_layers) if layers is None else layers
        if layers.step != 1 or not layers or layers.start < 0 or layers.stop > num_layers:
            raise InvalidRequestError(f"layers {layers} outside the pool's {num_layers} layers")
        if timeout_s is not None and timeout_s <= 0:
            raise InvalidRequestError(f"timeout_s must be > 0, got {timeout_s}")
        check_block_ids(dst_block_ids, what="dst_block_ids", num_blocks=self._layout.num_blocks)
        target = TransferTarget(
            transfer_id=transfer_id, peer=self._address, dst_block_ids=tuple(dst_block_ids),
            compat_hash=self._compat, epoch=self._epoch, layer_start=layers.start, layer_end=layers.stop,
            skip_blocks=skip_blocks, sender_epoch=sender_epoch, backend=self._backend,
            deadline_unix_ms=0 if timeout_s is None else int((time.time() + timeout_s) * 1000))
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        incoming = IncomingTransfer(target, deadline=deadline, abort_grace_s=self._grace,
                                    on_finished=self._forget)
        with self._lock:
            if self._closed:
                raise CancelledError(f"receiver {self._address} is closed")
            if transfer_id in self._open:
                raise InvalidRequestError(f"transfer {transfer_id} is already expected")
            self._gone.pop(transfer_id, None)
            if incoming.state.terminal:
                return incoming  # nothing to receive
            self._open[transfer_id] = incoming
            if deadline is not None:
                if self._deadlines is None:
                    self._deadlines = DeadlineWatch(f"kvt-deadlines-{self._address}")
                self._timers[transfer_id] = self._deadlines.add(deadline, incoming.expire)
        return incoming

    def lookup(self, transfer_id: str) -> IncomingTransfer | None:
        with self._lock:
            return self._open.get(transfer_id)

    def why_gone(self, transfer_id: str) -> PdRouterError:
        """The error to give a sender whose transfer id is not (or no longer) expected."""
        with self._lock:
            known = transfer_id in self._gone
            error = self._gone.get(transfer_id)
        if error is not None:
            return error
        what = "already completed" if known else "not expected (never invited, or expired long ago)"
        return UnknownTransferError(f"transfer {transfer_id} is {what} at receiver {self._address}")

    def __len__(self) -> int:
        with self._lock:
            return len(self._open)

    def deadlines(self) -> int:
        """Deadlines still pending (one per open expectation that has one)."""
        with self._lock:
            watch = self._deadlines
        return 0 if watch is None else watch.pending()

    def close(self, reason: str) -> None:
        """Fail every open expectation with CancelledError(reason) and stop the deadline thread."""
        with self._lock:
            self._closed = True
            pending = list(self._open.values())
            deadlines, self._deadlines = self._deadlines, None
            self._timers.clear()
        for incoming in pending:
            incoming.fail(CancelledError(f"transfer {incoming.transfer_id}: {reason}"))
        if deadlines is not None:
            deadlines.close()

    def _forget(self, incoming: IncomingTransfer) -> None:
        with self._lock:
            if self._open.get(incoming.transfer_id) is incoming:
                del self._open[incoming.transfer_id]
                timer = self._timers.pop(incoming.transfer_id, None)
                if timer is not None and self._deadlines is not None:
                    self._deadlines.cancel(timer)  # else it would hold the transfer until its deadline
            self._gone[incoming.transfer_id] = incoming.error
            while len(self._gone) > REMEMBERED:
                self._gone.popitem(last=False)
