"""Protobuf ⇄ dataclass conversion: a worker record survives the trip with every field."""

from __future__ import annotations

import dataclasses

from pdrouter.core.ids import Epoch, WorkerId
from pdrouter.core.workers import WorkerRecord, WorkerRole
from pdrouter.wire.convert import record_from_pb, record_to_pb


def test_a_worker_record_round_trips_through_protobuf() -> None:
    record = WorkerRecord(worker_id=WorkerId("decode-3"), role=WorkerRole.DECODE, address="10.0.0.7:7002",
                          epoch=Epoch(42), model="llama-3-8b", model_compat_hash="m1", kv_compat_hash="k1",
                          block_size=16, capacity_blocks=28179, kv_address="10.0.0.7:7102", kv_backends=("tcp",),
                          lane_address="10.0.0.7:7202", device="sim:h100-80g", engine="sim",
                          engine_version="0.1.0")
    assert all(getattr(record, f.name) != f.default for f in dataclasses.fields(record)), "set every field"
    assert record_from_pb(record_to_pb(record)) == record
    assert WorkerRecord.from_json(record.to_json()) == record
