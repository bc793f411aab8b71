"""The transport contract the workers program against: two endpoints, two handles.

The decode worker holds a ``TransferReceiver`` and, per request, an ``IncomingHandle``; the
prefill worker holds a ``TransferSender`` and, per request, an ``OutgoingHandle``. Two
implementations exist: ``KvReceiver`` / ``KvSender`` (TCP, gloo or NCCL, chosen by
``TransferConfig.backend``) and the in-process ``LocalFabric`` for unit tests.

Promises every implementation keeps:

- The receiver names the destination blocks; the sender never writes anywhere else.
- A handle ends DONE (every expected block of every expected layer landed and verified) or FAILED
  with a ``PdRouterError`` from the tree in ``pdrouter.transfer.errors``. Both ends learn about a failure on
  either end.
- Once a receiver-side wait raises, or ``abort`` returns, nothing writes into the destination
  blocks any more and the expectation is gone: the decode worker may free the blocks.
- The sender reads the source blocks until ``finish`` returns or the transfer fails, and never
  writes to its own pool.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from pdrouter.core.errors import PdRouterError
from pdrouter.transfer.lifecycle import TransferState
from pdrouter.transfer.target import TransferTarget


class IncomingHandle(Protocol):
    """The decode side of one transfer."""

    transfer_id: str
    target: TransferTarget
    """What the sender needs; convert it to protobuf field by field."""
    bytes_landed: int
    """Payload bytes verified and written into the blocks so far."""

    @property
    def state(self) -> TransferState: ...

    @property
    def error(self) -> PdRouterError | None: ...

    def wait_layer(self, layer: int, timeout: float | None = None) -> None:
        """Return once ``layer`` landed for every block; raise the transfer's error if it failed."""
        ...

    def wait_all(self, timeout: float | None = None) -> None:
        """Return once the transfer is DONE; raise its error if it failed (or timed out)."""
        ...

    async def wait_layer_async(self, layer: int, timeout: float | None = None) -> None: ...

    async def wait_all_async(self, timeout: float | None = None) -> None: ...

    def abort(self, reason: str = ...) -> None:
        """Fail the transfer, tell the sender, return once no write into the blocks is in progress."""
        ...


class OutgoingHandle(Protocol):
    """The prefill side of one transfer."""

    transfer_id: str
    target: TransferTarget

    @property
    def state(self) -> TransferState: ...

    @property
    def error(self) -> PdRouterError | None: ...

    def send_layers(self, src_block_ids: Sequence[int], layers: range | int | None = None) -> None:
        """Queue these layers of the prompt's blocks (positionally matching the target's); returns at once."""
        ...

    def finish(self, timeout: float | None = None) -> None:
        """Wait until the receiver confirmed every block, or raise the transfer's error."""
        ...

    async def finish_async(self, timeout: float | None = None) -> None: ...

    def abort(self, reason: str = ...) -> None:
        """Stop sending and tell the receiver."""
        ...


class TransferReceiver(Protocol):
    """A decode worker's endpoint: invites transfers into named blocks."""

    address: str

    @property
    def epoch(self) -> int: ...

    def expect(self, transfer_id: str, dst_block_ids: Sequence[int], *, skip_blocks: int = 0,
               layers: range | None = None, sender_epoch: int = 0,
               timeout_s: float | None = None) -> IncomingHandle: ...

    def close(self) -> None: ...


class TransferSender(Protocol):
    """A prefill worker's endpoint: opens transfers to targets."""

    @property
    def epoch(self) -> int: ...

    def connect(self, peer: str) -> None:
        """Get a connection to ``peer`` ready ahead of the first transfer (optional)."""
        ...

    def open_transfer(self, target: TransferTarget) -> OutgoingHandle: ...

    def close(self) -> None: ...
