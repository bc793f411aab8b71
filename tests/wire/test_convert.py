"""Protobuf ⇄ dataclass conversion: a worker record survives the trip with every field; a prompt is read
packed or repeated."""

from __future__ import annotations

import dataclasses

import pytest

from pdrouter.core.errors import InvalidRequestError
from pdrouter.core.ids import Epoch, WorkerId
from pdrouter.core.tokens import PackedPrompt, pack_token_ids
from pdrouter.core.workers import WorkerRecord, WorkerRole
from pdrouter.engine.validation import token_ids
from pdrouter.wire.convert import GIL_HELD_IDS, prompt_from_pb, record_from_pb, record_to_pb, unpack_token_ids
from pdrouter.wire.v1 import worker_pb2


def test_a_worker_record_round_trips_through_protobuf() -> None:
    record = WorkerRecord(worker_id=WorkerId("decode-3"), role=WorkerRole.DECODE, address="10.0.0.7:7002",
                          epoch=Epoch(42), model="llama-3-8b", model_compat_hash="m1", kv_compat_hash="k1",
                          block_size=16, capacity_blocks=28179, kv_address="10.0.0.7:7102", kv_backends=("tcp",),
                          lane_address="10.0.0.7:7202", device="sim:h100-80g", engine="sim",
                          engine_version="0.1.0")
    assert all(getattr(record, f.name) != f.default for f in dataclasses.fields(record)), "set every field"
    assert record_from_pb(record_to_pb(record)) == record
    assert WorkerRecord.from_json(record.to_json()) == record


PROMPT = [0, 1, 255, 256, 65_535, 128_000, 2**32 - 1]


@pytest.mark.parametrize("message", [worker_pb2.ServeRequest, worker_pb2.PrefillRequest,
                                     worker_pb2.WorkerGenerateRequest])
def test_a_prompt_is_read_packed_or_repeated_alike(message: type) -> None:
    packed = message(prompt_token_bytes=pack_token_ids(PROMPT))
    assert len(packed.prompt_token_bytes) == 4 * len(PROMPT) and not packed.prompt_token_ids
    assert list(prompt_from_pb(message.FromString(packed.SerializeToString()))) == PROMPT
    assert list(prompt_from_pb(message(prompt_token_ids=PROMPT))) == PROMPT  # an earlier release's sender
    assert list(prompt_from_pb(message())) == []


def test_a_packed_prompt_keeps_its_bytes_and_largest_id_and_passes_the_engine_check_as_it_is() -> None:
    read = prompt_from_pb(worker_pb2.ServeRequest(prompt_token_bytes=pack_token_ids(PROMPT)))
    assert isinstance(read, PackedPrompt) and all(type(i) is int for i in read)
    assert read.packed == pack_token_ids(PROMPT) and read.largest == 2**32 - 1
    assert pack_token_ids(read) is read.packed  # sent on (to a prefill worker) without packing again
    within = PackedPrompt(pack_token_ids(PROMPT[:-1]), 128_000)
    assert token_ids(within, 128_001) is within
    # The largest id decides at once; the error still names the first id outside the vocabulary.
    with pytest.raises(InvalidRequestError, match=r"prompt\[4\] = 65535 is outside the vocabulary \[0, 1000\)"):
        token_ids(read, 1000)
    empty = prompt_from_pb(worker_pb2.PrefillRequest(prompt_token_bytes=b""))
    assert list(empty) == []


def test_the_largest_id_is_found_wherever_it_lies_in_a_long_prompt() -> None:
    # The ids are reduced in pieces of GIL_HELD_IDS (numpy keeps the interpreter lock for those):
    # the largest is found in the first, a middle or the last piece, and at the pieces' edges.
    n = GIL_HELD_IDS
    for length in (1, n - 1, n, n + 1, 2 * n, 3 * n + 7):
        for at in sorted({0, n - 1, n, length // 2, length - 1} & set(range(length))):
            ids = [7] * length
            ids[at] = 128_000
            read = unpack_token_ids(pack_token_ids(ids))
            assert read.largest == 128_000 and read == tuple(ids), (length, at)
    assert unpack_token_ids(b"").largest == -1


def test_a_prompt_sent_both_ways_or_in_torn_ids_is_refused() -> None:
    with pytest.raises(InvalidRequestError, match="both as prompt_token_ids and as prompt_token_bytes"):
        prompt_from_pb(worker_pb2.ServeRequest(prompt_token_ids=[1], prompt_token_bytes=pack_token_ids([1])))
    with pytest.raises(InvalidRequestError, match="4 bytes each: got 7 bytes"):
        prompt_from_pb(worker_pb2.PrefillRequest(prompt_token_bytes=pack_token_ids([1]) + b"\x00\x00\x00"))
    with pytest.raises(InvalidRequestError, match=r"integers in \[0, 2\^32\)"):
        pack_token_ids([2**32])
