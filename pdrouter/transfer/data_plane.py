"""How a frame's payload moves once its header is on the socket: the ``DataPlane`` seam.

Control messages always travel on the TCP connection. The payload either follows its header on
the same socket (``SocketPlane``, here) or goes through a torch.distributed pair group
(``pdrouter.transfer.dist_plane``). Either way it is read straight from the sender's pool and lands
straight in the receiver's destination blocks.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from typing import Protocol

import xxhash

from pdrouter.transfer import wire
from pdrouter.transfer.frame_plan import FrameSpan, PlannedFrame
from pdrouter.transfer.framed_socket import FramedSocket
from pdrouter.transfer.pool_bytes import PoolBytes

WriteGuard = Callable[[], AbstractContextManager[bool]]
"""Entered around each frame's writes into destination blocks; yields False once the transfer has
failed (the bytes must then be dropped), and lets an abort wait for a frame that is landing."""

SEND_CHUNK_BYTES = 256 << 10
"""The sender writes pieces this big and hashes each right after the kernel copied it, while it is
still in the CPU cache: the checksum then costs a fraction of a second pass over memory."""
RECV_BATCH_BYTES = 1 << 20
"""The receiver reads up to this much per system call (one scatter-read straight into the blocks,
waiting for all of it), then hashes it while it is still in cache."""
_MAX_BUFFERS = 512


class DataPlane(Protocol):
    """Moves payloads between the two pools of one connection (one writer thread, one reader thread)."""

    out_of_band: bool
    """Whether payloads bypass the socket (DATA headers must say so)."""
    can_interrupt: bool
    """Whether closing the socket stops a payload midway (else it runs to its end or to a timeout)."""

    def send_frame(self, transfer_id: str, seq: int, frame: PlannedFrame) -> None:
        """Write the DATA header on the socket and move the payload read from ``frame.src``."""
        ...

    def recv_frame(self, header: wire.Header, span: FrameSpan, land: bool, guard: WriteGuard) -> bool | None:
        """Take one payload; write it into ``span`` of the local pool if ``land`` and the guard allows,
        else drop it. Returns whether its checksum matched, or None when nothing was checked."""
        ...

    def close(self) -> None:
        ...


class SocketPlane:
    """Payload inline on the TCP connection, then an 8-byte xxh3-64 trailer."""

    out_of_band = False
    can_interrupt = True

    def __init__(self, fs: FramedSocket, view: PoolBytes, checksums: bool) -> None:
        self._fs = fs
        self._view = view
        self._hash = checksums

    def send_frame(self, transfer_id: str, seq: int, frame: PlannedFrame) -> None:
        flags = wire.Flag.CHECKSUM_TRAILER if self._hash else wire.Flag.NO_CHECKSUM
        header = wire.encode_data(transfer_id, seq, frame.dst, flags=flags, payload_len=frame.nbytes,
                                  payload_checksum=0)
        chunks = self._view.chunks(frame.src, SEND_CHUNK_BYTES)
        with self._fs.exclusive():
            self._fs.write_all(header)
            if not self._hash:
                for chunk in chunks:
                    self._fs.write_all(chunk)
                return
            hasher = xxhash.xxh3_64()
            for chunk in chunks:
                self._fs.write_all(chunk)
                hasher.update(chunk)  # the kernel's copy just pulled the chunk into cache
            self._fs.write_all(wire.TRAILER.pack(hasher.intdigest()))

    def recv_frame(self, header: wire.Header, span: FrameSpan, land: bool, guard: WriteGuard) -> bool | None:
        trailer = wire.TRAILER.size if header.flags & wire.Flag.CHECKSUM_TRAILER else 0
        with guard() as allowed:
            if not (land and allowed):
                self._fs.discard(header.payload_len + trailer)
                return None
            hasher = xxhash.xxh3_64()
            for batch in _batches(self._view.chunks(span, RECV_BATCH_BYTES), RECV_BATCH_BYTES, _MAX_BUFFERS):
                self._fs.read_exact_into(batch)
                if trailer:
                    for buf in batch:
                        hasher.update(buf)  # just landed, still in cache
        if not trailer:
            return None
        raw = bytearray(trailer)
        self._fs.read_exact_into([memoryview(raw)])
        return hasher.intdigest() == wire.TRAILER.unpack(raw)[0]

    def close(self) -> None:
        self._fs.close()


def _batches(buffers: list[memoryview], max_bytes: int, max_count: int) -> Iterator[list[memoryview]]:
    """Consecutive groups of ``buffers`` holding at most ``max_bytes`` and ``max_count`` each."""
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
