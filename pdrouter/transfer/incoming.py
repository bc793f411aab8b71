"""The receiver's side of one transfer: an expectation for named blocks, and the handle to wait on it."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

import numpy as np

from pdrouter.core.errors import (
    CancelledError,
    DeadlineExceededError,
    IncompatibleError,
    InvalidRequestError,
    PdRouterError,
    StaleEpochError,
)
from pdrouter.transfer.errors import ChecksumError, ProtocolError
from pdrouter.transfer.frames import Begin
from pdrouter.transfer.lifecycle import Lifecycle, TransferState
from pdrouter.transfer.target import TransferTarget

PeerNotifier = Callable[[PdRouterError], object]


class IncomingTransfer:
    """One expected transfer: which destination blocks and layers may be written, and what has landed.

    Decode-worker API: ``wait_layer`` / ``wait_all`` (and their ``_async`` twins) return once the
    layer (all layers) arrived and verified, or raise the transfer's error; ``abort`` gives up.
    Once a wait raises or ``abort`` returns, the transfer is FAILED, its expectation is dropped
    from the receiver, and the destination blocks will not be written again: the caller may free
    them. A ``timeout`` on a wait is a deadline for the transfer itself: when it passes the
    transfer is aborted with ``DeadlineExceededError``.

    Transport API (this package's internals): ``bind``, ``write_guard``, ``positions_of``,
    ``mark_landed``, ``end_of_stream``, ``fail``.
    """

    def __init__(self, target: TransferTarget, *, deadline: float | None, abort_grace_s: float,
                 on_finished: Callable[[IncomingTransfer], None]) -> None:
        self.target = target
        self.transfer_id = target.transfer_id
        self.deadline = deadline
        """``time.monotonic()`` after which the transfer fails, or None."""
        self._life = Lifecycle()
        self._grace = abort_grace_s
        self._on_finished = on_finished
        self._notify_peer: PeerNotifier | None = None
        self._interrupt: Callable[[], None] | None = None
        self._writers = 0
        blocks = np.asarray(target.blocks_to_send, dtype=np.int64)
        self._order = np.argsort(blocks, kind="stable")
        self._sorted = blocks[self._order]
        self._covered = np.zeros((len(target.layers), len(blocks)), dtype=bool)
        self._missing = np.full(len(target.layers), len(blocks), dtype=np.int64)
        self._positions_cache: dict[bytes, np.ndarray] = {}
        self.bytes_landed = 0
        if len(blocks) == 0:
            self._life.advance(TransferState.DONE)

    # -- decode-worker API ------------------------------------------------------------------------
    @property
    def state(self) -> TransferState:
        return self._life.state

    @property
    def error(self) -> PdRouterError | None:
        return self._life.error

    def layer_done(self, layer: int) -> bool:
        with self._life.cond:
            return self.state is TransferState.DONE or self._missing[self._layer_index(layer)] == 0

    def wait_layer(self, layer: int, timeout: float | None = None) -> None:
        index = self._layer_index(layer)
        self._finish_wait(self._life.wait_for(lambda: self._layer_ready(index), timeout), timeout)

    def wait_all(self, timeout: float | None = None) -> None:
        self._finish_wait(self._life.wait_for(lambda: self.state.terminal, timeout), timeout)

    async def wait_layer_async(self, layer: int, timeout: float | None = None) -> None:
        index = self._layer_index(layer)
        self._finish_wait(await self._life.wait_for_async(lambda: self._layer_ready(index), timeout), timeout)

    async def wait_all_async(self, timeout: float | None = None) -> None:
        self._finish_wait(await self._life.wait_for_async(lambda: self.state.terminal, timeout), timeout)

    def abort(self, reason: str = "aborted by the receiver") -> None:
        """Fail the transfer (telling the sender) and wait until no write into the blocks is in progress."""
        self.fail(CancelledError(f"transfer {self.transfer_id}: {reason}"))

    # -- transport API ----------------------------------------------------------------------------
    def bind(self, begin: Begin, sender_epoch: int, sender_compat: str, local_compat: str,
             notify_peer: PeerNotifier, interrupt: Callable[[], None]) -> None:
        """Accept the sender announced by ``begin``, or raise (failing the transfer where that is right)."""
        t = self.target
        with self._life.cond:
            state = self.state
        if state is TransferState.FAILED:
            raise self.error or ProtocolError(f"transfer {self.transfer_id} already failed")
        if state is not TransferState.WAITING:
            raise ProtocolError(f"transfer {self.transfer_id} is already {state.value}")
        problem: PdRouterError | None = None
        if begin.receiver_epoch != t.epoch:
            problem = StaleEpochError(f"transfer {self.transfer_id}: target issued by receiver epoch "
                                      f"{begin.receiver_epoch}, this receiver is epoch {t.epoch}")
        elif t.sender_epoch and sender_epoch != t.sender_epoch:
            problem = StaleEpochError(f"transfer {self.transfer_id}: expected sender epoch {t.sender_epoch}, "
                                      f"got {sender_epoch} (the sender restarted)")
        elif sender_compat != local_compat or begin.compat_hash != local_compat:
            problem = IncompatibleError(f"transfer {self.transfer_id}: sender KV layout {sender_compat} does "
                                        f"not match receiver {local_compat}")
        elif (begin.dst_block_ids, begin.skip_blocks, begin.layer_start, begin.layer_end) != (
                t.dst_block_ids, t.skip_blocks, t.layer_start, t.layer_end):
            problem = ProtocolError(f"transfer {self.transfer_id}: the sender's target differs from the "
                                    f"receiver's expectation")
        with self._life.cond:
            self._notify_peer = notify_peer
            self._interrupt = interrupt
        if problem is not None:
            self.fail(problem, tell_peer=False)  # the caller answers the sender with the raised error
            raise problem
        if not self._life.advance(TransferState.TRANSFERRING):
            raise self.error or ProtocolError(f"transfer {self.transfer_id} ended meanwhile")

    @contextmanager
    def write_guard(self) -> Iterator[bool]:
        """Yields whether bytes may land in the blocks now; ``fail`` waits for such writes to end."""
        with self._life.cond:
            allowed = self.state is TransferState.TRANSFERRING
            if allowed:
                self._writers += 1
        try:
            yield allowed
        finally:
            if allowed:
                with self._life.cond:
                    self._writers -= 1
                    self._life.cond.notify_all()

    def positions_of(self, layer_start: int, layer_end: int, runs: np.ndarray) -> np.ndarray:
        """Indices (into ``blocks_to_send``) of a frame's destination blocks; ProtocolError for any
        block or layer the receiver did not invite, or already received."""
        t = self.target
        if not (t.layer_start <= layer_start < layer_end <= t.layer_end):
            raise ProtocolError(f"transfer {self.transfer_id}: layers [{layer_start}, {layer_end}) outside "
                                f"the expected [{t.layer_start}, {t.layer_end})")
        key = runs.tobytes()
        positions = self._positions_cache.get(key)
        if positions is None:
            positions = self._resolve(runs)
            self._positions_cache = {key: positions}  # frames of consecutive layers repeat their runs
        rows = slice(layer_start - t.layer_start, layer_end - t.layer_start)
        with self._life.cond:
            if self._covered[rows, positions].any():
                raise ProtocolError(f"transfer {self.transfer_id}: a block arrived twice")
        return positions

    def _resolve(self, runs: np.ndarray) -> np.ndarray:
        counts = runs[:, 1]
        if len(runs) == 0 or counts.min() <= 0:
            raise ProtocolError(f"transfer {self.transfer_id}: a frame with an empty run")
        ids = np.repeat(runs[:, 0] - np.cumsum(counts) + counts, counts) + np.arange(int(counts.sum()))
        slots = np.minimum(np.searchsorted(self._sorted, ids), max(len(self._sorted) - 1, 0))
        if len(self._sorted) == 0 or not np.array_equal(self._sorted[slots], ids):
            raise ProtocolError(f"transfer {self.transfer_id}: frame names blocks the receiver did not "
                                f"invite")
        positions = self._order[slots]
        seen = np.zeros(len(self._order), dtype=bool)
        seen[positions] = True
        if int(seen.sum()) != len(positions):
            raise ProtocolError(f"transfer {self.transfer_id}: a frame names a block twice")
        return positions

    def mark_landed(self, layer_start: int, layer_end: int, positions: np.ndarray, nbytes: int, *,
                    on_done: Callable[[], None] | None = None) -> None:
        """Record verified blocks; the transfer is DONE when every block of every layer landed.
        ``on_done`` runs as it becomes DONE, before its waiters are woken (it tells the sender)."""
        rows = slice(layer_start - self.target.layer_start, layer_end - self.target.layer_start)
        with self._life.cond:
            if self.state is not TransferState.TRANSFERRING:
                return
            self._covered[rows, positions] = True
            self._missing[rows] -= len(positions)
            self.bytes_landed += nbytes
            complete = not self._missing.any()
        if not complete:
            self._life.notify()
            return

        def settled() -> None:  # the receiver's books first, then the sender hears it, then waiters wake
            self._on_finished(self)
            if on_done is not None:
                on_done()

        self._life.advance(TransferState.DONE, before_wake=settled)

    def end_of_stream(self) -> None:
        """The sender says it sent everything: fail if anything is missing."""
        with self._life.cond:
            missing = int(self._missing.sum())
        if missing and not self.state.terminal:
            self.fail(ProtocolError(f"transfer {self.transfer_id}: the sender finished with {missing} "
                                    f"block-layers missing"))

    def checksum_failed(self, seq: int) -> None:
        self.fail(ChecksumError(f"transfer {self.transfer_id}: frame {seq} payload failed its integrity check "
                                f"(MAC or checksum mismatch): the bytes were corrupted or tampered with in transit"))

    def fail(self, error: PdRouterError, *, tell_peer: bool = True) -> bool:
        """Fail the transfer (first failure wins); returns once no write into the blocks is in progress."""
        if not self._life.advance(TransferState.FAILED, error):
            return False
        with self._life.cond:
            drained = self._life.cond.wait_for(lambda: self._writers == 0, self._grace)
            interrupt, notify = self._interrupt, self._notify_peer
        if not drained and interrupt is not None:
            interrupt()  # a frame stalled midway: cut the connection to stop it
        with self._life.cond:
            self._life.cond.wait_for(lambda: self._writers == 0)
        self._on_finished(self)
        if tell_peer and notify is not None:
            notify(error)
        return True

    def expire(self) -> None:
        self.fail(DeadlineExceededError(f"transfer {self.transfer_id}: deadline passed in state "
                                        f"{self.state.value}"))

    # -- helpers ----------------------------------------------------------------------------------
    def _layer_index(self, layer: int) -> int:
        if layer not in self.target.layers:
            raise InvalidRequestError(f"layer {layer} is not part of transfer {self.transfer_id} "
                                      f"({self.target.layer_start}..{self.target.layer_end - 1})")
        return layer - self.target.layer_start

    def _layer_ready(self, index: int) -> bool:
        return self.state.terminal or bool(self._missing[index] == 0)

    def _finish_wait(self, satisfied: bool, timeout: float | None) -> None:
        if not satisfied:
            self.fail(DeadlineExceededError(f"transfer {self.transfer_id}: not complete within {timeout}s "
                                            f"(state {self.state.value})"))
        if self.state is TransferState.FAILED:
            raise self.error or ProtocolError(f"transfer {self.transfer_id} failed")
