"""KV transfer: ships a request's paged KV blocks from a prefill worker into a decode worker's blocks.

Decode worker::

    receiver = KvReceiver(pool, layout, TransferConfig(auth_token=token, epoch=epoch))
    handle = receiver.expect(request_id, dst_block_ids, skip_blocks=cached, timeout_s=30)
    # send handle.target (a frozen TransferTarget) to the prefill worker, then
    await handle.wait_all_async()            # or wait_layer(i); raises on failure: free the blocks

Prefill worker::

    sender = KvSender(pool, layout, TransferConfig(auth_token=token, epoch=epoch))
    transfer = sender.open_transfer(target)
    for layer in range(num_layers):
        transfer.send_layers(src_block_ids, layer)   # after the layer is computed; returns at once
    await transfer.finish_async()            # raises on failure

``TransferConfig.backend`` picks how payload bytes move: ``tcp`` (default), ``gloo`` or ``nccl``.
``LocalFabric`` is the in-process fake with the same contract (``pdrouter.transfer.contract``). The
guarantees, the wire protocol and the module map are in ``README.md`` next to this file.
"""

from typing import TYPE_CHECKING

from pdrouter.transfer.config import Backend, TransferConfig, new_epoch
from pdrouter.transfer.contract import IncomingHandle, OutgoingHandle, TransferReceiver, TransferSender
from pdrouter.transfer.errors import (
    AuthError,
    ChecksumError,
    ErrorCode,
    PeerLostError,
    ProtocolError,
    UnknownTransferError,
)
from pdrouter.transfer.incoming import IncomingTransfer
from pdrouter.transfer.lifecycle import TransferState
from pdrouter.transfer.outgoing import OutgoingTransfer
from pdrouter.transfer.receiver import KvReceiver, ReceiverStats
from pdrouter.transfer.sender import KvSender, SenderStats
from pdrouter.transfer.target import TransferTarget

if TYPE_CHECKING:
    from pdrouter.transfer.local import LocalFabric, LocalReceiver, LocalSender

_TORCH_ONLY = ("LocalFabric", "LocalReceiver", "LocalSender")


def __getattr__(name: str) -> object:
    """The in-process fake copies tensors: it is imported on first use, so the TCP path never loads torch."""
    if name in _TORCH_ONLY:
        from pdrouter.transfer import local

        return getattr(local, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "AuthError",
    "Backend",
    "ChecksumError",
    "ErrorCode",
    "IncomingHandle",
    "IncomingTransfer",
    "KvReceiver",
    "KvSender",
    "LocalFabric",
    "LocalReceiver",
    "LocalSender",
    "OutgoingHandle",
    "OutgoingTransfer",
    "PeerLostError",
    "ProtocolError",
    "ReceiverStats",
    "SenderStats",
    "TransferConfig",
    "TransferReceiver",
    "TransferSender",
    "TransferState",
    "TransferTarget",
    "UnknownTransferError",
    "new_epoch",
]
