"""The receiver's side of one transfer: an expectation for named blocks, and the handle to wait on it."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from pdrouter.core.errors import (
    CancelledError,
    DeadlineExceededError,
    IncompatibleError,
    InvalidRequestError,
    PdRouterError,
    StaleEpochError,
)
from pdrouter.transfer import frames
from pdrouter.transfer.errors import ChecksumError, ProtocolError
from pdrouter.transfer.frame_plan import Run
from pdrouter.transfer.frames import Begin
from pdrouter.transfer.lifecycle import Lifecycle, TransferState
from pdrouter.transfer.target import TransferTarget

PeerNotifier = Callable[[PdRouterError], object]
Positions = np.ndarray | list[int]
"""Indices into a transfer's ``blocks_to_send`` (either indexes the coverage array alike)."""
_SMALL_FRAME_BLOCKS = 64
_INDEXED_BLOCKS = 4096
"""Transfers of at most this many blocks keep a dict of their positions (built with the expectation)."""


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
        blocks = target.blocks_to_send
        # Coverage as one bitmask (bit i: position i) and one count of missing blocks per layer:
        # plain ints, so that a frame of a few blocks is checked and recorded without numpy
        # (each numpy call costs microseconds here, on the receiver's critical path).
        self._covered = [0] * len(target.layers)
        self._missing = [len(blocks)] * len(target.layers)
        self._sorted_order: tuple[np.ndarray, np.ndarray] | None = None
        """The block ids sorted, and their positions (made when a frame of many blocks needs them)."""
        self._positions_cache: dict[tuple[Run, ...], tuple[Positions, int]] = {}
        self._index = ({int(block): i for i, block in enumerate(blocks)}
                       if len(blocks) <= _INDEXED_BLOCKS else None)
        """Block id → position, for resolving small frames without numpy (small transfers only)."""
        self.done_message = frames.encode_control(frames.Done(self.transfer_id))
        """The DONE that tells the sender, made ahead of the transfer (a connection seals it)."""
        self.bytes_landed = 0
        if not blocks:
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

    def write_guard(self) -> _WriteGuard:
        """A context that yields whether bytes may land in the blocks now; ``fail`` waits for such
        writes to end."""
        return _WriteGuard(self)

    def _begin_write(self) -> bool:
        with self._life.cond:
            allowed = self.state is TransferState.TRANSFERRING
            if allowed:
                self._writers += 1
        return allowed

    def _end_write(self) -> None:
        with self._life.cond:
            self._writers -= 1
            self._life.cond.notify_all()

    def positions_of(self, layer_start: int, layer_end: int, runs: tuple[Run, ...]) -> Positions:
        """Indices (into ``blocks_to_send``) of a frame's destination blocks (``runs``: (first block,
        count) pairs); ProtocolError for any block or layer the receiver did not invite, or already
        received."""
        t = self.target
        if not (t.layer_start <= layer_start < layer_end <= t.layer_end):
            raise ProtocolError(f"transfer {self.transfer_id}: layers [{layer_start}, {layer_end}) outside "
                                f"the expected [{t.layer_start}, {t.layer_end})")
        resolved = self._positions_cache.get(runs)
        if resolved is None:
            positions = self._resolve(runs)
            resolved = (positions, _mask(positions))
            self._positions_cache = {runs: resolved}  # frames of consecutive layers repeat their runs
        positions, mask = resolved
        with self._life.cond:
            rows = self._covered[layer_start - t.layer_start:layer_end - t.layer_start]
            if any([row & mask for row in rows]):
                raise ProtocolError(f"transfer {self.transfer_id}: a block arrived twice")
        return positions

    def _resolve(self, runs: tuple[Run, ...]) -> Positions:
        if not runs or min(count for _, count in runs) <= 0:
            raise ProtocolError(f"transfer {self.transfer_id}: a frame with an empty run")
        if self._index is not None and sum(count for _, count in runs) <= _SMALL_FRAME_BLOCKS:
            # A frame of a few blocks (the usual case) in plain Python.
            index = self._index
            try:
                positions: Positions = [index[block] for start, count in runs
                                        for block in range(start, start + count)]
            except KeyError:
                raise ProtocolError(f"transfer {self.transfer_id}: frame names blocks the receiver did not "
                                    f"invite") from None
            if len(set(positions)) != len(positions):
                raise ProtocolError(f"transfer {self.transfer_id}: a frame names a block twice")
            return positions
        if self._sorted_order is None:
            blocks = np.asarray(self.target.blocks_to_send, dtype=np.int64)
            order = np.argsort(blocks, kind="stable")
            self._sorted_order = (blocks[order], order)
        ordered, order = self._sorted_order
        array = np.asarray(runs, dtype=np.int64).reshape(-1, 2)
        counts = array[:, 1]
        ids = np.repeat(array[:, 0] - np.cumsum(counts) + counts, counts) + np.arange(int(counts.sum()))
        slots = np.minimum(np.searchsorted(ordered, ids), max(len(ordered) - 1, 0))
        if len(ordered) == 0 or not np.array_equal(ordered[slots], ids):
            raise ProtocolError(f"transfer {self.transfer_id}: frame names blocks the receiver did not "
                                f"invite")
        found = order[slots]
        if len(np.unique(found)) != len(found):
            raise ProtocolError(f"transfer {self.transfer_id}: a frame names a block twice")
        return found

    def mark_landed(self, layer_start: int, layer_end: int, positions: Positions, nbytes: int, *,
                    on_done: Callable[[], None] | None = None) -> None:
        """Record verified blocks; the transfer is DONE when every block of every layer landed.
        ``on_done`` runs as it becomes DONE, before its waiters are woken (it tells the sender)."""
        cached = next(iter(self._positions_cache.values()), None)
        mask = cached[1] if cached is not None and cached[0] is positions else _mask(positions)
        count = len(positions)
        first = self.target.layer_start
        covered, missing = self._covered, self._missing
        with self._life.cond:
            if self.state is not TransferState.TRANSFERRING:
                return
            for row in range(layer_start - first, layer_end - first):
                covered[row] |= mask
                missing[row] -= count
            self.bytes_landed += nbytes
            complete = not any(missing)
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
            missing = sum(self._missing)
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
        return self.state.terminal or self._missing[index] == 0

    def _finish_wait(self, satisfied: bool, timeout: float | None) -> None:
        if not satisfied:
            self.fail(DeadlineExceededError(f"transfer {self.transfer_id}: not complete within {timeout}s "
                                            f"(state {self.state.value})"))
        if self.state is TransferState.FAILED:
            raise self.error or ProtocolError(f"transfer {self.transfer_id} failed")


class _WriteGuard:
    """``IncomingTransfer.write_guard``'s context (a class: a generator-based one costs several
    times more, once per frame on the receiver's critical path)."""

    __slots__ = ("_allowed", "_transfer")

    def __init__(self, transfer: IncomingTransfer) -> None:
        self._transfer = transfer
        self._allowed = False

    def __enter__(self) -> bool:
        self._allowed = self._transfer._begin_write()
        return self._allowed

    def __exit__(self, *exc: object) -> None:
        if self._allowed:
            self._transfer._end_write()


def _mask(positions: Positions) -> int:
    """The bitmask with bit ``p`` set for each position ``p``."""
    if isinstance(positions, list):
        mask = 0
        for position in positions:
            mask |= 1 << position
        return mask
    if len(positions) == 0:
        return 0
    seen = np.zeros(int(positions.max()) + 1, dtype=bool)
    seen[positions] = True
    return int.from_bytes(np.packbits(seen, bitorder="little").tobytes(), "little")
