"""How a frame's payload moves once its header is on the socket: the ``DataPlane`` seam.

Control messages always travel on the TCP connection. The payload either follows its header on
the same socket (``SocketPlane``, here) or goes through a torch.distributed pair group
(``pdrouter.transfer.dist_plane``). Either way it is read straight from the sender's pool and lands
straight in the receiver's destination blocks.
"""

from __future__ import annotations

import hmac
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager
from typing import Protocol

from pdrouter.transfer import frames
from pdrouter.transfer.errors import ProtocolError
from pdrouter.transfer.frame_plan import FrameSpan, PlannedFrame
from pdrouter.transfer.framed_socket import Buffer, FramedSocket
from pdrouter.transfer.integrity import MacFeed, MacHelper, PayloadMac
from pdrouter.transfer.pool_bytes import PoolBytes

WriteGuard = Callable[[], AbstractContextManager[bool]]
"""Entered around each frame's writes into destination blocks; yields False once the transfer has
failed (the bytes must then be dropped), and lets an abort wait for a frame that is landing."""

SEND_CHUNK_BYTES = 256 << 10
"""The sender writes pieces this big (a larger range cut, smaller ones gathered into one write);
each is hashed right after the kernel copied it, while it is still in the CPU cache."""
RECV_BATCH_BYTES = 1 << 20
"""The receiver reads up to this much per system call (one scatter-read straight into the blocks,
waiting for all of it), then hashes it while it is still in cache."""
RECV_TAIL_BYTES = 256 << 10
"""A payload's last ``RECV_BATCH_BYTES`` are read in batches this small: the hash of the last batch
is the one part of the receiver's work that no arriving byte hides, and it delays the answer."""
MAC_BATCH_BYTES = 1 << 20
"""Pieces go to the MAC helper thread in batches of this much (fewer hand-overs)."""
MAC_OFFLOAD_MIN_BYTES = 4 << 20
"""Smaller payloads are hashed in the socket's own thread: a hand-over would cost more than it hides."""
_MAX_BUFFERS = 512


class DataPlane(Protocol):
    """Moves payloads between the two pools of one connection (one writer thread, one reader thread)."""

    out_of_band: bool
    """Whether payloads bypass the socket (DATA headers must say so)."""
    can_interrupt: bool
    """Whether closing the socket stops a payload midway (else it runs to its end or to a timeout)."""

    def send_frame(self, transfer_id: str, seq: int, frame: PlannedFrame, *, before: Sequence[bytes] = (),
                   after: Sequence[bytes] = ()) -> None:
        """Write the DATA header on the socket and move the payload read from ``frame.src``; the
        control messages ``before`` go ahead of the header and ``after`` behind the payload, with no
        other message between them."""
        ...

    def recv_frame(self, header: frames.Header, span: FrameSpan, land: bool, guard: WriteGuard) -> bool | None:
        """Take one payload; write it into ``span`` of the local pool if ``land`` and the guard allows,
        else drop it. Returns whether its MAC (checksum) matched, or None when nothing was checked."""
        ...

    def close(self) -> None:
        ...


class SocketPlane:
    """Payload inline on the TCP connection, then its 16-byte MAC (``pdrouter.transfer.integrity``).

    With ``offload`` the MAC of a large payload is computed on a helper thread, a batch behind the
    socket: the sender writes piece i+1 while piece i is hashed, the receiver reads batch i+1 into
    the blocks while batch i is. Without ``macs`` (allowed only under TLS) payloads carry no MAC.
    """

    out_of_band = False
    can_interrupt = True

    def __init__(self, fs: FramedSocket, view: PoolBytes, *, macs: bool = True, offload: bool = True) -> None:
        self._fs = fs
        self._view = view
        self._macs = macs
        self._helper = MacHelper(f"kvt-mac-{fs.peer}") if offload else None

    def send_frame(self, transfer_id: str, seq: int, frame: PlannedFrame, *, before: Sequence[bytes] = (),
                   after: Sequence[bytes] = ()) -> None:
        flags = frames.Flag.MAC_TRAILER if self._macs else frames.Flag.NO_CHECKSUM
        header = frames.encode_data(transfer_id, seq, frame.dst, flags=flags, payload_len=frame.nbytes,
                                  payload_checksum=0)
        # A block's layers are many small ranges (32 KiB each for Llama-3-8B): they go out
        # gathered, one system call per SEND_CHUNK_BYTES rather than one per range.
        batches = _batches(self._view.chunks(frame.src, SEND_CHUNK_BYTES), SEND_CHUNK_BYTES, _MAX_BUFFERS)
        if frame.nbytes <= SEND_CHUNK_BYTES:
            self._send_small(header, list(batches), before, after)
            return
        with self._fs.exclusive():
            # The messages ahead (a BEGIN) and the header leave with the first piece of the payload,
            # those behind (an END) with the MAC: no system call (and no wake-up of the receiver)
            # for a message alone.
            lead = self._seal_all(before)
            header_parts, sealed = self._fs.seal(header)
            lead += header_parts
            if not self._macs:
                for batch in batches:
                    self._fs.write_parts([*lead, *batch] if lead else batch)
                    lead = []
                if after:
                    self._fs.write_parts(self._seal_all(after))
                return
            feed = self._feed(self._fs.send_payload_mac(sealed), frame.nbytes)
            try:
                for batch in batches:
                    self._fs.write_parts([*lead, *batch] if lead else batch)
                    lead = []
                    feed.add_all(batch)  # the kernel's copy just pulled the pieces into cache
                tag = feed.finish()
            except BaseException:
                feed.settle()
                raise
            self._fs.write_parts([tag, *self._seal_all(after)])

    def _send_small(self, header: bytes, batches: list[list[memoryview]], before: Sequence[bytes],
                    after: Sequence[bytes]) -> None:
        """A payload of at most one write: hashed first, then the header, the payload and its MAC leave
        in one system call (several for more pieces than one call takes), with ``before`` and ``after``."""
        pieces = [piece for batch in batches for piece in batch]
        with self._fs.exclusive():
            parts = self._seal_all(before)
            header_parts, sealed = self._fs.seal(header)
            parts += header_parts
            if self._macs:
                feed = self._feed(self._fs.send_payload_mac(sealed), sum(len(p) for p in pieces))
                try:
                    feed.add_all(pieces)
                    parts += [*pieces, feed.finish()]
                except BaseException:
                    feed.settle()
                    raise
            else:
                parts += pieces
            self._fs.write_parts(parts + self._seal_all(after))

    def _seal_all(self, messages: Sequence[bytes]) -> list[Buffer]:
        """The parts of ``messages`` sealed in order (inside ``exclusive``)."""
        parts: list[Buffer] = []
        for message in messages:
            parts += self._fs.seal(message)[0]
        return parts

    def recv_frame(self, header: frames.Header, span: FrameSpan, land: bool, guard: WriteGuard) -> bool | None:
        trailer = frames.TAG_BYTES if header.flags & frames.MAC_TRAILER else 0
        if self._macs and not trailer:
            raise ProtocolError(f"a DATA frame from {self._fs.peer} without a payload MAC: this receiver "
                                f"requires them")
        with guard() as allowed:
            if not (land and allowed):
                self._fs.discard(header.payload_len + trailer)  # nothing uses the bytes: no need to hash them
                return None
            feed = self._feed(self._fs.recv_payload_mac(header), header.payload_len) if trailer else None
            raw = bytearray(trailer)
            try:
                batches = list(_tail_batches(self._view.chunks(span, RECV_TAIL_BYTES), header.payload_len))
                last = len(batches) - 1
                for i, batch in enumerate(batches):
                    # the MAC trailer comes in the same read as the last batch
                    self._fs.read_exact_into([*batch, memoryview(raw)] if i == last and trailer else batch)
                    if feed is not None:
                        feed.add_all(batch)  # just landed, still in cache
                expected = feed.finish() if feed is not None else b""
            except BaseException:
                if feed is not None:
                    feed.settle()  # no piece of the blocks is read once this returns
                raise
        if not trailer:
            return None
        return hmac.compare_digest(expected, bytes(raw))

    def close(self) -> None:
        self._fs.close()
        if self._helper is not None:
            self._helper.close()

    def _feed(self, mac: PayloadMac, nbytes: int) -> MacFeed:
        helper = self._helper if nbytes >= MAC_OFFLOAD_MIN_BYTES else None
        return MacFeed(mac, helper, MAC_BATCH_BYTES)


def _tail_batches(pieces: list[memoryview], nbytes: int) -> Iterator[list[memoryview]]:
    """``pieces`` (at most ``RECV_TAIL_BYTES`` each, ``nbytes`` in all) grouped for reading: batches of
    ``RECV_BATCH_BYTES``, then ``RECV_TAIL_BYTES`` for the last ``RECV_BATCH_BYTES``."""
    size = _uniform(pieces)
    if size:  # pieces of one size (a tensor pool's frame): the same batches, counted, not summed
        big = max(1, min(_MAX_BUFFERS, RECV_BATCH_BYTES // size))
        small = max(1, min(_MAX_BUFFERS, RECV_TAIL_BYTES // size))
        i, left = 0, nbytes
        while i < len(pieces):
            per = big if left > RECV_BATCH_BYTES else small
            yield pieces[i:i + per]
            i += per
            left -= per * size
        return
    batch: list[memoryview] = []
    size = 0
    left = nbytes
    for piece in pieces:
        limit = RECV_BATCH_BYTES if left > RECV_BATCH_BYTES else RECV_TAIL_BYTES
        if batch and (size + len(piece) > limit or len(batch) == _MAX_BUFFERS):
            yield batch
            left -= size
            batch, size = [], 0
        batch.append(piece)
        size += len(piece)
    if batch:
        yield batch


def _batches(buffers: list[memoryview], max_bytes: int, max_count: int) -> Iterator[list[memoryview]]:
    """Consecutive groups of ``buffers`` holding at most ``max_bytes`` and ``max_count`` each."""
    size = _uniform(buffers)
    if size:
        per = max(1, min(max_count, max_bytes // size))
        for i in range(0, len(buffers), per):
            yield buffers[i:i + per]
        return
    batch: list[memoryview] = []
    size = 0
    for buf in buffers:
        if batch and (size + len(buf) > max_bytes or len(batch) == max_count):
            yield batch
            batch, size = [], 0
        batch.append(buf)
        size += len(buf)
    if batch:
        yield batch


def _uniform(buffers: list[memoryview]) -> int:
    """The length every buffer has (0 if they differ, or there are none)."""
    sizes = set(map(len, buffers))
    return sizes.pop() if len(sizes) == 1 else 0
