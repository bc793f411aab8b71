"""The sender's side of one transfer: the handle a prefill worker feeds layer by layer."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence
from typing import NamedTuple, Protocol

from pdrouter.core.errors import CancelledError, DeadlineExceededError, InvalidRequestError, PdRouterError
from pdrouter.transfer.frame_plan import PlannedFrame, plan_frames
from pdrouter.transfer.lifecycle import Lifecycle, TransferState
from pdrouter.transfer.pool_bytes import PoolBytes
from pdrouter.transfer.target import BlockSegment, TransferTarget, check_block_ids, pair_segments


# Named tuples, not frozen dataclasses: a few are made per transfer, on its critical path, and a
# frozen dataclass's constructor costs several times a tuple's.
class BeginItem(NamedTuple):
    transfer: OutgoingTransfer


class DataItem(NamedTuple):
    transfer: OutgoingTransfer
    seq: int
    frame: PlannedFrame


class EndItem(NamedTuple):
    transfer: OutgoingTransfer
    frames: int
    nbytes: int


OutItem = BeginItem | DataItem | EndItem


class FrameSink(Protocol):
    """Where a transfer's messages go (a connection's send queue, or the in-process fake)."""

    def submit(self, transfer: OutgoingTransfer, items: Sequence[OutItem], *, write: bool = False) -> None:
        """Queue ``items`` behind the transfer's earlier ones; nothing is copied. With ``write`` the
        calling thread writes them itself where that is quick (``write_now``), else they are left to
        the sink's writer. No ``items``: send what is queued (the BEGIN of ``announce``)."""
        ...

    def cancel(self, transfer: OutgoingTransfer, error: PdRouterError | None) -> None:
        """Drop the transfer's queued items; tell the receiver ``error`` unless it is None."""
        ...

    def write_now(self, transfer: OutgoingTransfer) -> None:
        """Send the transfer's queued items from the calling thread where that is quick, else leave them."""
        ...


class OutgoingTransfer:
    """One transfer being sent: ``send_layers`` as layers are computed, then ``finish``.

    ``send_layers`` only queues frames (it returns at once); the bytes are read from the pool when
    they go out, so the caller must leave the source blocks untouched until ``finish`` returns or
    the transfer fails. ``finish`` waits for the receiver to confirm that every block landed
    and verified, or raises the transfer's error; ``abort`` gives up and tells the receiver.
    """

    def __init__(self, target: TransferTarget, view: PoolBytes, sink: FrameSink, *, max_frame_bytes: int,
                 max_runs: int, on_finished: Callable[[OutgoingTransfer], None]) -> None:
        self.target = target
        self.transfer_id = target.transfer_id
        self._view = view
        self._sink = sink
        self._max_frame = max_frame_bytes
        self._max_runs = max_runs
        self._on_finished = on_finished
        self._life = Lifecycle()
        self._sent = [False] * len(target.layers)
        self._src_ids: tuple[int, ...] | None = None
        self._segments: tuple[BlockSegment, ...] = ()
        self._seq = 0
        self._bytes = 0
        self._ended = False
        if not target.blocks_to_send:
            self._life.advance(TransferState.DONE)

    @property
    def state(self) -> TransferState:
        return self._life.state

    @property
    def error(self) -> PdRouterError | None:
        return self._life.error

    @property
    def bytes_queued(self) -> int:
        return self._bytes

    @property
    def payload_bytes(self) -> int:
        """The bytes every layer of the blocks to send comes to (those queued and those to come)."""
        t = self.target
        return len(t.blocks_to_send) * len(t.layers) * 2 * self._view.half_block_bytes

    def send_layers(self, src_block_ids: Sequence[int], layers: range | int | None = None) -> None:
        """Queue ``layers`` (default: all of the target's) of the prompt's blocks ``src_block_ids``.

        ``src_block_ids[i]`` is the prompt's block ``i`` in this pool, positionally matching
        ``target.dst_block_ids``; the first ``target.skip_blocks`` are not sent. Each layer is sent
        once. Raises the transfer's error if it already failed.
        """
        span = self._layer_range(layers)
        if self.error is not None:
            raise self.error
        if self._ended:
            raise InvalidRequestError(f"transfer {self.transfer_id}: send_layers after finish")
        self._check_sources(src_block_ids)
        first = span.start - self.target.layer_start
        if any(self._sent[first:first + len(span)]):
            raise InvalidRequestError(f"transfer {self.transfer_id}: a layer of {span} was already sent")
        self._sent[first:first + len(span)] = [True] * len(span)
        if self.state is TransferState.DONE:
            return  # nothing to send: the receiver held every block already
        frames = plan_frames(self._segments, span, self._view.half_block_bytes, self._max_frame, self._max_runs)
        items: list[OutItem] = []
        for frame in frames:
            items.append(DataItem(self, self._seq, frame))
            self._seq += 1
            self._bytes += frame.nbytes
        if self.state is TransferState.WAITING:
            self._life.advance(TransferState.TRANSFERRING)
        # The last layers, queued by a thread that is no event loop: it waits for the transfer next
        # (or does little else), so it writes them itself when the connection is idle, rather than
        # wake the writer thread and contend with it for the interpreter lock.
        self._sink.submit(self, items, write=all(self._sent) and not _in_event_loop())

    def announce(self) -> None:
        """Send the transfer's BEGIN now, before any layer is ready.

        Otherwise it leaves with the first layer's frame (one write, and one wake-up of the receiver,
        fewer). A sender that knows its layers are a while off (a prompt still computing) announces
        the transfer first: the receiver checks the target and binds the transfer meanwhile, off the
        path from the KV being ready to its confirmation. Does nothing once a layer was queued or the
        transfer ended."""
        if not self._ended and self.state is TransferState.WAITING:  # the sink sends a BEGIN once, whoever asks
            self._sink.submit(self, [], write=not _in_event_loop())

    def finish(self, timeout: float | None = None) -> None:
        """Declare the transfer complete and wait for the receiver's confirmation."""
        timeout = self._end(timeout, write=True)  # this thread waits next: it may as well write
        if not self._life.wait_for(lambda: self.state.terminal, timeout):
            self._expired(timeout)
        self._raise_if_failed()

    async def finish_async(self, timeout: float | None = None) -> None:
        """``finish`` without blocking the event loop."""
        timeout = self._end(timeout)
        if not await self._life.wait_for_async(lambda: self.state.terminal, timeout):
            self._expired(timeout)
        self._raise_if_failed()

    def abort(self, reason: str = "aborted by the sender") -> None:
        """Stop sending, drop what is queued and tell the receiver."""
        self.fail(CancelledError(f"transfer {self.transfer_id}: {reason}"))

    # -- transport API ----------------------------------------------------------------------------
    def begin_item(self) -> BeginItem:
        return BeginItem(self)

    def complete(self) -> None:
        """The receiver confirmed every block."""
        if self._life.advance(TransferState.DONE):
            self._on_finished(self)

    def fail(self, error: PdRouterError, *, tell_peer: bool = True) -> bool:
        if not self._life.advance(TransferState.FAILED, error):
            return False
        self._sink.cancel(self, error if tell_peer else None)
        self._on_finished(self)
        return True

    # -- helpers ----------------------------------------------------------------------------------
    def _layer_range(self, layers: range | int | None) -> range:
        t = self.target
        span = t.layers if layers is None else range(layers, layers + 1) if isinstance(layers, int) else layers
        if span.step != 1 or not span or span.start < t.layer_start or span.stop > t.layer_end:
            raise InvalidRequestError(f"transfer {self.transfer_id}: layers {span} outside "
                                      f"[{t.layer_start}, {t.layer_end}) or not a plain range")
        return span

    def _check_sources(self, src_block_ids: Sequence[int]) -> None:
        ids = tuple(map(int, src_block_ids))
        if self._src_ids is not None:
            if ids != self._src_ids:
                raise InvalidRequestError(f"transfer {self.transfer_id}: source blocks changed between layers")
            return
        if len(ids) != len(self.target.dst_block_ids):
            raise InvalidRequestError(f"transfer {self.transfer_id}: {len(ids)} source blocks for "
                                      f"{len(self.target.dst_block_ids)} destination blocks")
        check_block_ids(ids, what="src_block_ids", num_blocks=self._view.num_blocks)
        skip = self.target.skip_blocks
        self._segments = pair_segments(ids[skip:], self.target.dst_block_ids[skip:])
        self._src_ids = ids

    def _end(self, timeout: float | None, *, write: bool = False) -> float | None:
        if not self._ended and not self.state.terminal:
            missing = [self.target.layer_start + i for i, sent in enumerate(self._sent) if not sent]
            if missing:
                self.fail(InvalidRequestError(f"transfer {self.transfer_id}: finish before layers "
                                              f"{missing[:8]} were sent"))
            else:
                self._sink.submit(self, [EndItem(self, self._seq, self._bytes)], write=write)
        self._ended = True
        if self.target.deadline_unix_ms:
            left = self.target.deadline_unix_ms / 1000 - time.time()
            timeout = left if timeout is None else min(timeout, left)
        return None if timeout is None else max(0.0, timeout)

    def _expired(self, timeout: float | None) -> None:
        self.fail(DeadlineExceededError(f"transfer {self.transfer_id}: not confirmed within {timeout}s "
                                        f"(state {self.state.value})"))

    def _raise_if_failed(self) -> None:
        if self.error is not None:
            raise self.error


def _in_event_loop() -> bool:
    """Whether the calling thread runs an asyncio event loop (which must not block on a socket)."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return False
    return True
