"""One sender-side connection to a receiver: a fair send queue, bounded bytes in flight, and a reader.

Transfers to the same receiver share the connection. The writer thread takes one message at a
time (a BEGIN or END goes with the DATA beside it), round-robin across transfers (a one-block
request does not wait behind a 512 MiB one), and keeps at most ``max_inflight_bytes`` of payload
unacknowledged. A caller about to wait in ``finish`` writes its own transfer instead when nothing
else is queued or unacknowledged (``write_now``). The reader thread turns ACK,
DONE and ERROR messages into credit and transfer outcomes. Any connection failure fails every
transfer on it with ``PeerLostError`` (or the error that broke it) and closes the socket.
"""

from __future__ import annotations

import threading
from collections import OrderedDict, deque
from collections.abc import Callable, Sequence

from pdrouter.core.errors import InvalidRequestError, PdRouterError
from pdrouter.transfer import frames
from pdrouter.transfer.config import TransferConfig
from pdrouter.transfer.data_plane import DataPlane
from pdrouter.transfer.errors import PeerLostError, code_for_error, error_for_code
from pdrouter.transfer.frame_plan import FrameSpan, PlannedFrame
from pdrouter.transfer.framed_socket import FramedSocket
from pdrouter.transfer.handshake import PeerInfo
from pdrouter.transfer.integrity import ONE_SHOT_BYTES
from pdrouter.transfer.outgoing import BeginItem, DataItem, EndItem, OutgoingTransfer, OutItem


class SenderConnection:
    """A live, authenticated connection to one receiver, shared by the transfers going there."""

    def __init__(self, fs: FramedSocket, peer: PeerInfo, plane: DataPlane, config: TransferConfig,
                 compat_hash: str, on_dead: Callable[[SenderConnection], None]) -> None:
        self.fs = fs
        self.peer = peer
        self._plane = plane
        self._config = config
        self._compat = compat_hash
        self._on_dead = on_dead
        self._cv = threading.Condition()
        self._queues: OrderedDict[str, deque[OutItem]] = OrderedDict()
        """Each transfer's messages ready to go, in the order transfers take turns."""
        self._begins: dict[str, BeginItem] = {}
        """The BEGIN of each transfer opened but neither fed nor announced: it joins the transfer's
        queue with its first DATA (or at ``announce``), so a transfer opened early (a prefill worker
        opens its transfer before the prompt computes) sends nothing, and keeps no other transfer
        from being written by its caller, until then."""
        self._urgent: deque[bytes] = deque()
        self._transfers: dict[str, OutgoingTransfer] = {}
        self._inflight = 0
        self._credit_waiter = False
        """Whether the writer waits for credit (an ACK wakes it only then)."""
        self._writing = False
        """Whether a thread (the writer, or a caller in ``write_now``) is writing on the socket."""
        self._dead: PdRouterError | None = None
        self._writer = threading.Thread(target=self._write_loop, name=f"kvt-send-{fs.peer}", daemon=True)
        self._reader = threading.Thread(target=self._read_loop, name=f"kvt-acks-{fs.peer}", daemon=True)
        self._writer.start()
        self._reader.start()

    @property
    def alive(self) -> bool:
        return self._dead is None

    @property
    def inflight_bytes(self) -> int:
        return self._inflight

    def counts(self) -> tuple[int, int]:
        """(transfers, queued messages) on this connection."""
        with self._cv:
            return len(self._transfers), sum(len(q) for q in self._queues.values())

    def register(self, transfer: OutgoingTransfer) -> None:
        """Take ``transfer`` on, its BEGIN held back (``_begins``): it leaves with the first DATA, in
        one write, and the writer thread woken for it alone would only contend with the caller for
        the interpreter lock."""
        with self._cv:
            if self._dead is not None:
                raise PeerLostError(f"connection to {self.peer.address} is gone: {self._dead}")
            if transfer.transfer_id in self._transfers:
                raise InvalidRequestError(f"transfer {transfer.transfer_id} is already being sent")
            self._transfers[transfer.transfer_id] = transfer
            self._begins[transfer.transfer_id] = transfer.begin_item()

    def submit(self, transfer: OutgoingTransfer, items: Sequence[OutItem], *, write: bool = False) -> None:
        """Queue ``items`` (behind the transfer's BEGIN, the first time). With ``write`` the calling
        thread writes them itself when the connection is idle (``write_now``); whatever is left then
        goes to the writer thread. No items: the BEGIN alone (``OutgoingTransfer.announce``)."""
        tid = transfer.transfer_id
        with self._cv:
            if self._dead is not None or tid not in self._transfers:
                return  # the transfer already failed (the caller learns it from the handle)
            begin = self._begins.pop(tid, None)
            if not items and begin is None:
                return  # announced already, or fed: nothing new to send
            queue = self._queues.setdefault(tid, deque())
            if begin is not None:
                queue.append(begin)
            queue.extend(items)
            if not write:
                self._cv.notify_all()
        if write:
            self.write_now(transfer)
            with self._cv:
                if transfer.transfer_id in self._queues:
                    self._cv.notify_all()

    def write_now(self, transfer: OutgoingTransfer) -> None:
        """Write ``transfer``'s queued messages from the calling thread, when the connection has
        nothing else to do: no other transfer queued, nothing being written, and the bytes
        unacknowledged plus these within half a socket buffer (so no write waits for the receiver).
        A thread about to wait for the transfer's confirmation then needs no hand-off to the writer
        thread. Otherwise the writer thread sends them."""
        budget = self._config.socket_buffer_bytes // 2
        if not self._config.max_inflight_bytes:
            return  # nothing is counted in flight: whether the receiver keeps up is not known
        while True:
            with self._cv:
                queue = self._queues.get(transfer.transfer_id)
                if (self._dead is not None or self._writing or self._urgent or not queue or len(self._queues) > 1
                        or self._inflight + sum(item.frame.nbytes for item in queue if isinstance(item, DataItem))
                        > budget):
                    return
                items = self._pop(transfer.transfer_id, queue)
                self._writing = True
            try:
                if not transfer.state.terminal:
                    self._write_items(items)
            except PdRouterError as exc:
                self._die(exc)
                return
            finally:
                with self._cv:
                    self._writing = False
                    if self._queues or self._urgent:
                        self._cv.notify_all()

    def cancel(self, transfer: OutgoingTransfer, error: PdRouterError | None) -> None:
        with self._cv:
            self._queues.pop(transfer.transfer_id, None)
            self._begins.pop(transfer.transfer_id, None)
            self._transfers.pop(transfer.transfer_id, None)
            if error is not None and self._dead is None:
                self._urgent.append(_error(transfer.transfer_id, error))
            self._cv.notify_all()

    def forget(self, transfer: OutgoingTransfer) -> None:
        """The transfer ended: drop it and whatever it still had queued (at most its END)."""
        with self._cv:
            self._transfers.pop(transfer.transfer_id, None)
            self._queues.pop(transfer.transfer_id, None)
            self._begins.pop(transfer.transfer_id, None)

    def send_refusal(self, transfer_id: str, error: PdRouterError) -> None:
        """Tell the receiver a transfer will not happen (before any BEGIN for it)."""
        with self._cv:
            if self._dead is None:
                self._urgent.append(_error(transfer_id, error))
                self._cv.notify_all()

    def close(self, reason: str = "the sender closed the connection") -> None:
        self._die(PeerLostError(reason))
        for thread in (self._writer, self._reader):
            if thread is not threading.current_thread():
                thread.join(timeout=self._config.progress_timeout_s + 1)

    # -- threads ----------------------------------------------------------------------------------
    def _next(self) -> bytes | list[OutItem] | None:
        """The next message to write, round-robin across transfers, or the next few of one transfer
        that go out together (a BEGIN with the DATA behind it, a DATA with the END behind it); None
        once the connection died."""
        with self._cv:
            while True:
                if self._dead is not None:
                    return None
                if self._writing:  # a caller writes its own transfer (write_now)
                    self._cv.wait()
                    continue
                if self._urgent:
                    self._writing = True
                    return self._urgent.popleft()
                if self._queues:
                    tid, queue = next(iter(self._queues.items()))
                    self._writing = True
                    return self._pop(tid, queue)
                self._cv.wait()

    def _pop(self, tid: str, queue: deque[OutItem]) -> list[OutItem]:
        """The next messages of one transfer to go out together (under the lock)."""
        items = _group(queue, self._config.max_frame_bytes)
        if queue:
            self._queues.move_to_end(tid)
        else:
            del self._queues[tid]
        return items

    def _write_loop(self) -> None:
        try:
            while (item := self._next()) is not None:
                try:
                    if isinstance(item, bytes):
                        self.fs.send(item)
                    elif not item[0].transfer.state.terminal:
                        self._write_items(item)
                finally:
                    with self._cv:
                        self._writing = False
        except PdRouterError as exc:
            self._die(exc)

    def _write_items(self, items: list[OutItem]) -> None:
        """One transfer's messages, in order: its DATA (at most one) carries the others with it."""
        before: list[bytes] = []
        after: list[bytes] = []
        data: DataItem | None = None
        for item in items:
            if isinstance(item, DataItem):
                data = item
            elif isinstance(item, BeginItem):
                (after if data else before).append(frames.encode_control(_begin(item.transfer, self._compat)))
            else:
                (after if data else before).append(frames.encode_control(
                    frames.End(item.transfer.transfer_id, item.frames, item.nbytes)))
        if data is not None:
            self._send_data(data, before, after)
            return
        self.fs.send_many(before)
        transfer = items[0].transfer
        if isinstance(items[0], BeginItem) and transfer.payload_bytes > ONE_SHOT_BYTES:
            # An announced transfer (its BEGIN alone): its first frame follows, with a payload
            # large enough for a running MAC context, whose making (about 25 µs on a cold cache)
            # is done now rather than between that frame's first bytes and its second piece.
            with self.fs.exclusive():
                self.fs.prepare_send_payload_mac()

    def _send_data(self, item: DataItem, before: list[bytes], after: list[bytes]) -> None:
        nbytes = item.frame.nbytes
        limit = self._config.max_inflight_bytes or float("inf")
        with self._cv:
            self._credit_waiter = True
            try:
                fits = self._cv.wait_for(lambda: self._dead is not None or self._inflight == 0
                                         or self._inflight + nbytes <= limit, self._config.progress_timeout_s)
            finally:
                self._credit_waiter = False
            if not fits:
                raise PeerLostError(f"receiver at {self.peer.address} acknowledged nothing for "
                                    f"{self._config.progress_timeout_s}s")
            if self._dead is not None or item.transfer.state.terminal:
                return
            if self._config.max_inflight_bytes:
                self._inflight += nbytes
        self._plane.send_frame(item.transfer.transfer_id, item.seq, item.frame, before=before, after=after)

    def _read_loop(self) -> None:
        try:
            while True:
                header = self.fs.recv_header()
                if header.kind is frames.Kind.ACK:
                    with self._cv:
                        self._inflight -= frames.decode_ack(header)
                        if self._credit_waiter:  # else the writer has nothing to wake for
                            self._cv.notify_all()
                    continue
                if header.kind is frames.Kind.DONE:
                    if (transfer := self._transfer(frames.decode_done(header))) is not None:
                        transfer.complete()
                    continue
                msg = frames.decode_control(header)
                if isinstance(msg, frames.ErrorMsg) and msg.transfer_id:
                    if (transfer := self._transfer(msg.transfer_id)) is not None:
                        transfer.fail(error_for_code(msg.code, f"receiver at {self.peer.address}: {msg.message}"),
                                      tell_peer=False)
                elif isinstance(msg, frames.ErrorMsg):
                    raise error_for_code(msg.code, f"receiver at {self.peer.address} dropped the "
                                                   f"connection: {msg.message}")
                else:
                    raise PeerLostError(f"receiver at {self.peer.address} sent an unexpected {header.kind.name}")
        except PdRouterError as exc:
            self._die(exc)

    def _transfer(self, transfer_id: str) -> OutgoingTransfer | None:
        with self._cv:
            return self._transfers.get(transfer_id)

    def _die(self, exc: PdRouterError) -> None:
        exc = exc.with_traceback(None)  # keep no frames (and what they hold) alive through the error
        with self._cv:
            if self._dead is not None:
                return
            self._dead = exc
            victims = list(self._transfers.values())
            self._transfers.clear()
            self._queues.clear()
            self._begins.clear()
            self._urgent.clear()
            self._cv.notify_all()
        self._plane.close()
        self.fs.close()
        for transfer in victims:
            err = exc if not isinstance(exc, PeerLostError) else PeerLostError(
                f"transfer {transfer.transfer_id}: {exc.message}")
            transfer.fail(err, tell_peer=False)
        self._on_dead(self)


def _group(queue: deque[OutItem], max_frame_bytes: int) -> list[OutItem]:
    """The messages at the head of one transfer's ``queue`` that go out in one go, taken off it: a
    BEGIN with the DATA right behind it, a DATA (merged with the next layers, ``_coalesce``) with the
    END right behind it. The receiver reads them in one wake-up instead of one each."""
    items = [queue.popleft()]
    if isinstance(items[0], BeginItem) and queue and isinstance(queue[0], DataItem):
        items.append(queue.popleft())
    if isinstance(items[-1], DataItem):
        if queue:
            items[-1] = _coalesce(items[-1], queue, max_frame_bytes)
        if queue and isinstance(queue[0], EndItem):
            items.append(queue.popleft())
    return items


def _coalesce(item: DataItem, queue: deque[OutItem], max_bytes: int) -> DataItem:
    """``item`` merged with the frames queued right behind it that carry the next layers of the same
    blocks, up to ``max_bytes``: a writer that fell behind the layers being computed catches up in
    fewer, larger frames (per-frame work on both sides costs far more than a few KiB of bytes)."""
    frame = item.frame
    while queue:
        nxt = queue[0]
        if not isinstance(nxt, DataItem) or frame.nbytes + nxt.frame.nbytes > max_bytes \
                or not (_follows(frame.src, nxt.frame.src) and _follows(frame.dst, nxt.frame.dst)):
            break
        queue.popleft()
        frame = PlannedFrame(frame.src._replace(layer_end=nxt.frame.src.layer_end),
                             frame.dst._replace(layer_end=nxt.frame.dst.layer_end), frame.nbytes + nxt.frame.nbytes)
    return item if frame is item.frame else DataItem(item.transfer, item.seq, frame)


def _follows(span: FrameSpan, nxt: FrameSpan) -> bool:
    return span.layer_end == nxt.layer_start and span.runs == nxt.runs


def _begin(transfer: OutgoingTransfer, compat_hash: str) -> frames.Begin:
    t = transfer.target
    return frames.Begin(t.transfer_id, t.epoch, compat_hash, t.dst_block_ids, t.skip_blocks,
                      t.layer_start, t.layer_end)


def _error(transfer_id: str, error: PdRouterError) -> bytes:
    return frames.encode_control(frames.ErrorMsg(transfer_id, int(code_for_error(error)), error.message))
