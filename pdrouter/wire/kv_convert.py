"""``TransferTarget`` ⇄ protobuf: the KV hand-off crosses the router inside Allocate/Prefill messages."""

from __future__ import annotations

from pdrouter.core.errors import InvalidRequestError
from pdrouter.transfer.target import TransferTarget
from pdrouter.wire.v1 import common_pb2


def target_to_pb(target: TransferTarget, worker_id: str) -> common_pb2.TransferTarget:
    return common_pb2.TransferTarget(
        transfer_id=target.transfer_id, worker_id=worker_id, address=target.peer, epoch=target.epoch,
        dst_block_ids=list(target.dst_block_ids), skip_blocks=target.skip_blocks,
        compat_hash=target.compat_hash, backend=target.backend, layer_start=target.layer_start,
        layer_end=target.layer_end, sender_epoch=target.sender_epoch, deadline_unix_ms=target.deadline_unix_ms)


def target_from_pb(msg: common_pb2.TransferTarget) -> TransferTarget:
    """A validated TransferTarget; InvalidRequestError naming what is missing or malformed."""
    if not msg.address or not msg.transfer_id:
        raise InvalidRequestError("target.address and target.transfer_id are required (from DecodeWorker.Allocate)")
    return TransferTarget(
        transfer_id=msg.transfer_id, peer=msg.address, dst_block_ids=tuple(msg.dst_block_ids),
        compat_hash=msg.compat_hash, epoch=msg.epoch, layer_start=msg.layer_start, layer_end=msg.layer_end,
        skip_blocks=msg.skip_blocks, sender_epoch=msg.sender_epoch, backend=msg.backend or "tcp",
        deadline_unix_ms=msg.deadline_unix_ms)
