"""Protobuf ⇄ dataclass conversion for the messages in ``common.proto``.

The only place that knows both sides; servicers and clients of every package call these.
"""

from __future__ import annotations

from collections.abc import Sequence

from pdrouter.core.errors import InvalidRequestError
from pdrouter.core.ids import Epoch, WorkerId
from pdrouter.core.sampling import SamplingParams
from pdrouter.core.tokens import PackedPrompt
from pdrouter.core.workers import WorkerLoad, WorkerRecord, WorkerRole
from pdrouter.wire.v1 import common_pb2 as pb
from pdrouter.wire.v1 import worker_pb2

_ROLE_TO_PB = {WorkerRole.PREFILL: pb.WORKER_ROLE_PREFILL, WorkerRole.DECODE: pb.WORKER_ROLE_DECODE,
               WorkerRole.COLOCATED: pb.WORKER_ROLE_COLOCATED}
_ROLE_FROM_PB = {v: k for k, v in _ROLE_TO_PB.items()}


def sampling_to_pb(params: SamplingParams) -> pb.SamplingParams:
    msg = pb.SamplingParams(max_tokens=params.max_tokens, temperature=params.temperature,
                            top_p=params.top_p, top_k=params.top_k,
                            stop_token_ids=list(params.stop_token_ids), ignore_eos=params.ignore_eos)
    if params.seed is not None:
        msg.seed = params.seed
    return msg


def sampling_from_pb(msg: pb.SamplingParams) -> SamplingParams:
    """Validated SamplingParams (InvalidRequestError names the bad field); top_p 0 means unset."""
    if msg.max_tokens == 0:
        raise InvalidRequestError("sampling.max_tokens must be set to a positive integer")
    return SamplingParams(
        max_tokens=int(msg.max_tokens), temperature=float(msg.temperature),
        top_p=float(msg.top_p) if msg.top_p != 0.0 else 1.0, top_k=int(msg.top_k),
        seed=int(msg.seed) if msg.HasField("seed") else None,
        stop_token_ids=tuple(msg.stop_token_ids), ignore_eos=bool(msg.ignore_eos))


def prompt_from_pb(msg: worker_pb2.ServeRequest | worker_pb2.PrefillRequest | worker_pb2.WorkerGenerateRequest,
                   ) -> Sequence[int]:
    """A request's prompt, sent packed (``prompt_token_bytes``, as this release's senders do) or as the
    repeated ``prompt_token_ids`` of earlier ones; InvalidRequestError when it came both ways."""
    packed = msg.prompt_token_bytes
    if not packed:
        return list(msg.prompt_token_ids)
    if msg.prompt_token_ids:
        raise InvalidRequestError("the prompt came both as prompt_token_ids and as prompt_token_bytes: send one")
    return unpack_token_ids(packed)


GIL_HELD_IDS = 500
"""The most ids one numpy reduction takes in ``unpack_token_ids``: numpy keeps the interpreter lock
for a loop of at most 500 elements (``NPY_BEGIN_THREADS_THRESHOLDED``) and releases it for a longer
one (figures in ``docs/benchmarks.md``)."""


def unpack_token_ids(data: bytes) -> PackedPrompt:
    """The ids ``pack_token_ids`` packed, kept packed (``PackedPrompt``: unpacked only if read one by
    one), with the largest id (for the engine's vocabulary check); InvalidRequestError when ``data``
    is not whole uint32s."""
    if len(data) % 4:
        raise InvalidRequestError(f"packed token ids are 4 bytes each: got {len(data)} bytes")
    import numpy as np  # here: only workers unpack prompts, and a router need not load numpy

    ids = np.frombuffer(data, dtype="<u4")
    # In pieces of GIL_HELD_IDS: numpy lets go of the interpreter lock for a longer reduction, and a
    # worker's event loop then waits for its engine's step thread to hand the lock back.
    largest = max([int(ids[i:i + GIL_HELD_IDS].max()) for i in range(0, len(ids), GIL_HELD_IDS)], default=-1)
    return PackedPrompt(bytes(data), largest)


def load_to_pb(load: WorkerLoad) -> pb.WorkerLoad:
    return pb.WorkerLoad(running=load.running, waiting=load.waiting,
                         queued_prefill_tokens=load.queued_prefill_tokens, free_blocks=load.free_blocks,
                         total_blocks=load.total_blocks, allocated_blocks=load.allocated_blocks,
                         engine_failed=load.engine_failed,
                         prefix_cache_queries=load.prefix_cache_queries, prefix_cache_hits=load.prefix_cache_hits,
                         queued_prefill_tokens_by_priority=dict(load.queued_prefill_by_priority))


def load_from_pb(msg: pb.WorkerLoad) -> WorkerLoad:
    return WorkerLoad(running=msg.running, waiting=msg.waiting,
                      queued_prefill_tokens=msg.queued_prefill_tokens, free_blocks=msg.free_blocks,
                      total_blocks=msg.total_blocks, allocated_blocks=msg.allocated_blocks,
                      engine_failed=msg.engine_failed,
                      prefix_cache_queries=msg.prefix_cache_queries, prefix_cache_hits=msg.prefix_cache_hits,
                      queued_prefill_by_priority=tuple(sorted(msg.queued_prefill_tokens_by_priority.items())))


def record_to_pb(record: WorkerRecord) -> pb.WorkerInfo:
    return pb.WorkerInfo(worker_id=record.worker_id, role=_ROLE_TO_PB[record.role], address=record.address,
                         epoch=record.epoch, model=pb.ModelGeometry(name=record.model),
                         model_compat_hash=record.model_compat_hash,
                         kv_layout=pb.KvLayout(compat_hash=record.kv_compat_hash,
                                               block_size=record.block_size,
                                               num_blocks=record.capacity_blocks),
                         capacity_blocks=record.capacity_blocks, capacity_tokens=record.capacity_tokens,
                         kv_address=record.kv_address, kv_backends=list(record.kv_backends),
                         lane_address=record.lane_address, device=record.device, engine=record.engine,
                         engine_version=record.engine_version)


def record_from_pb(msg: pb.WorkerInfo) -> WorkerRecord:
    if msg.role not in _ROLE_FROM_PB:
        raise InvalidRequestError(f"worker {msg.worker_id!r} reports no role")
    return WorkerRecord(worker_id=WorkerId(msg.worker_id), role=_ROLE_FROM_PB[msg.role], address=msg.address,
                        epoch=Epoch(msg.epoch), model=msg.model.name,
                        model_compat_hash=msg.model_compat_hash, kv_compat_hash=msg.kv_layout.compat_hash,
                        block_size=msg.kv_layout.block_size, capacity_blocks=msg.capacity_blocks,
                        kv_address=msg.kv_address, kv_backends=tuple(msg.kv_backends),
                        lane_address=msg.lane_address, device=msg.device, engine=msg.engine,
                        engine_version=msg.engine_version)
