"""Payload over torch.distributed point-to-point: gloo on CPU pools, NCCL on CUDA pools.

Each sender/receiver connection gets its own two-rank process group, built from a ``TCPStore``
that the receiver hosts (rank 0: receiver, rank 1: sender). Nothing touches torch.distributed's
process-global default group, so one process can pair with many peers. The DATA header still
goes over the TCP connection; the payload pieces follow on the group in the same order, one
tag per piece.
"""

from __future__ import annotations

import contextlib
import datetime
import uuid
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from pdrouter.transfer import frames
from pdrouter.transfer.config import Backend
from pdrouter.transfer.data_plane import WriteGuard
from pdrouter.transfer.errors import PeerLostError
from pdrouter.transfer.frame_plan import FrameSpan, PlannedFrame
from pdrouter.transfer.framed_socket import FramedSocket
from pdrouter.transfer.pool_view import PoolView

RECEIVER_RANK = 0
SENDER_RANK = 1


class StoreHost:
    """The rendezvous store a receiver hosts for its connections' process groups."""

    def __init__(self, host: str, advertise_host: str, timeout_s: float) -> None:
        self.host = advertise_host
        self._store: dist.TCPStore | None = dist.TCPStore(
            host, 0, is_master=True, wait_for_workers=False, timeout=datetime.timedelta(seconds=timeout_s))
        self.port = int(self._store.port)

    def new_rendezvous(self) -> frames.Ready:
        return frames.Ready(self.host, self.port, f"kv-transfer/{uuid.uuid4().hex}/")

    def close(self) -> None:
        """Stop serving the store (its sockets close with the last reference)."""
        self._store = None


def join_pair_group(backend: Backend, ready: frames.Ready, rank: int, local_host: str,
                    timeout_s: float, device: torch.device) -> Any:
    """Build (and block until the peer joins) the two-rank group described by ``ready``."""
    timeout = datetime.timedelta(seconds=timeout_s)
    try:
        store = dist.TCPStore(ready.store_host, ready.store_port, is_master=False,
                              wait_for_workers=False, timeout=timeout)
        prefixed = dist.PrefixStore(ready.group_prefix, store)
        if backend is Backend.GLOO:
            opts = dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]
            opts._devices = [dist.ProcessGroupGloo.create_device(hostname=local_host)]
            opts._timeout = timeout
            return dist.ProcessGroupGloo(prefixed, rank, 2, opts)
        if device.index is not None:
            torch.cuda.set_device(device)
        nccl_opts = dist.ProcessGroupNCCL.Options()
        nccl_opts._timeout = timeout
        return dist.ProcessGroupNCCL(prefixed, rank, 2, nccl_opts)
    except (RuntimeError, ValueError, OSError) as exc:
        raise PeerLostError(f"could not build the {backend.value} pair group: {exc}") from exc


class DistPlane:
    """Payload pieces over a two-rank process group; the header (with its MAC) goes over the socket first.

    The payload itself is not MAC'd: gloo payloads carry an xxh3-64 in the authenticated header
    (``checksums``), NCCL payloads nothing; the process group's own transport is trusted.
    """

    out_of_band = True
    can_interrupt = False

    def __init__(self, fs: FramedSocket, view: PoolView, group: Any, peer_rank: int,
                 checksums: bool, timeout_s: float) -> None:
        self._fs = fs
        self._view = view
        self._group = group
        self._peer = peer_rank
        self._hash = checksums and not view.is_cuda
        self._timeout = datetime.timedelta(seconds=timeout_s)
        self._scratch: torch.Tensor | None = None

    def send_frame(self, transfer_id: str, seq: int, frame: PlannedFrame, *, before: Sequence[bytes] = (),
                   after: Sequence[bytes] = ()) -> None:
        flags = frames.Flag.OUT_OF_BAND | (frames.Flag.NONE if self._hash else frames.Flag.NO_CHECKSUM)
        digest = self._view.checksum(frame.src) if self._hash else 0
        header = frames.encode_data(transfer_id, seq, frame.dst, flags=flags, payload_len=frame.nbytes,
                                    payload_checksum=digest)  # the header's MAC covers the digest
        self._fs.send_many([*before, header])
        tensors = self._view.tensors(frame.src)
        works = [self._group.send([t], self._peer, tag) for tag, t in enumerate(tensors)]
        self._wait(works, "send")
        if after:
            self._fs.send_many(after)

    def recv_frame(self, header: frames.Header, span: FrameSpan, land: bool, guard: WriteGuard) -> bool | None:
        with guard() as ok:
            landing = land and ok
            targets = self._view.tensors(span) if landing else self._scratch_pieces(span)
            works = [self._group.recv([t], self._peer, tag) for tag, t in enumerate(targets)]
            self._wait(works, "receive")
        if not landing or self._view.is_cuda or header.flags & frames.NO_CHECKSUM:
            return None
        return self._view.checksum(span) == header.payload_checksum

    def close(self) -> None:
        self._fs.close()
        group, self._group = self._group, None
        if group is not None and hasattr(group, "shutdown"):
            with contextlib.suppress(RuntimeError):
                group.shutdown()  # closes the pair's sockets now rather than at garbage collection

    def _wait(self, works: list[Any], what: str) -> None:
        try:
            for work in works:
                work.wait(self._timeout)
            if self._view.is_cuda:
                torch.cuda.synchronize(self._view.pool.device)
        except RuntimeError as exc:
            raise PeerLostError(f"{what} over the process group with {self._fs.peer} failed: {exc}") from exc

    def _scratch_pieces(self, span: FrameSpan) -> list[torch.Tensor]:
        lengths = [n for _, n in self._view.pieces(span)]
        need = max(lengths, default=0)
        if self._scratch is None or self._scratch.numel() < need:
            self._scratch = torch.empty(need, dtype=torch.uint8, device=self._view.pool.device)
        return [self._scratch[:n] for n in lengths]
