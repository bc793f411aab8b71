"""Workers trust no caller: leases are capped, and KV goes only to decode workers of the pool.

Real worker processes (simulated GPUs, no sleeping), real Redis, real sockets. A listening socket
of the test's own, passed as a KV target's address, shows that a refused target makes the prefill
worker open no connection at all: ``accept`` with a timeout finds none.
"""

from __future__ import annotations

import argparse
import dataclasses
import socket
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
import redis.asyncio as aioredis

from pdrouter.cli.local_cluster import ManagedProcess
from pdrouter.cli.main import build_parser
from pdrouter.cli.worker_cmd import build_config
from pdrouter.core.errors import ConfigError, FailedPreconditionError, UnavailableError
from pdrouter.core.ids import Epoch, WorkerId
from pdrouter.core.sampling import SamplingParams
from pdrouter.core.workers import WorkerRecord, WorkerRole
from pdrouter.state.registry import WorkerRegistry
from pdrouter.transfer.target import TransferTarget
from pdrouter.wire.convert import sampling_to_pb
from pdrouter.wire.lane import DecodeLane, LaneChannel, PrefillLane
from pdrouter.wire.v1 import common_pb2, worker_pb2, worker_pb2_grpc
from pdrouter.worker.roles.decode_targets import RegisteredDecodeWorkers

from .conftest import SpawnWorker, load_of

GREEDY = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
PROMPT = [257, *b"who may I send my KV to?"]
MAX_LEASE_MS = 120_000
"""The decode worker's default ``--max-lease-ms``."""


@pytest.fixture
def backend() -> str:
    return "sim"


@pytest.fixture
def listener() -> Iterator[socket.socket]:
    """A socket listening on a free loopback port, standing for an address a caller chose."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen(8)
        yield sock


def no_connection_within(sock: socket.socket, seconds: float = 0.5) -> bool:
    """True when nobody connects to ``sock`` within ``seconds``."""
    sock.settimeout(seconds)
    try:
        conn, _ = sock.accept()
    except TimeoutError:
        return True
    conn.close()
    return False


def address_of(sock: socket.socket) -> str:
    host, port = sock.getsockname()
    return f"{host}:{port}"


async def info_of(proc: ManagedProcess) -> common_pb2.WorkerInfo:
    assert proc.address
    async with grpc.aio.insecure_channel(proc.address) as channel:
        return await worker_pb2_grpc.WorkerInfoServiceStub(channel).GetInfo(worker_pb2.GetInfoRequest())


async def status_of(call: object) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.RpcError) as err:  # grpc.aio.AioRpcError, or LaneError over a lane
        await call  # type: ignore[misc]
    return err.value.code(), err.value.details() or ""


def allocate_request(rid: str, compat: str, lease_ms: int = 0) -> worker_pb2.AllocateRequest:
    return worker_pb2.AllocateRequest(request_id=rid, prompt_token_ids=PROMPT, max_tokens=GREEDY.max_tokens,
                                      model_compat_hash=compat, sampling=sampling_to_pb(GREEDY), lease_ms=lease_ms)


def retarget(target: common_pb2.TransferTarget, *, worker_id: str | None = None, address: str | None = None,
             epoch: int | None = None) -> common_pb2.TransferTarget:
    """A copy of ``target`` naming another decode worker, KV address or epoch."""
    copy = common_pb2.TransferTarget()
    copy.CopyFrom(target)
    if worker_id is not None:
        copy.worker_id = worker_id
    if address is not None:
        copy.address = address
    if epoch is not None:
        copy.epoch = epoch
    return copy


def prefill_request(rid: str, compat: str, target: common_pb2.TransferTarget) -> worker_pb2.PrefillRequest:
    return worker_pb2.PrefillRequest(request_id=rid, prompt_token_ids=PROMPT, sampling=sampling_to_pb(GREEDY),
                                     target=target, model_compat_hash=compat)


# -- leases ---------------------------------------------------------------------------------
async def test_a_lease_above_the_cap_is_refused_over_grpc_and_the_lane(spawn_worker: SpawnWorker) -> None:
    decode = spawn_worker("decode")
    info = await info_of(decode)
    assert decode.address
    channel, lane = grpc.aio.insecure_channel(decode.address), LaneChannel(info.lane_address)
    stubs = {"grpc": worker_pb2_grpc.DecodeWorkerStub(channel), "lane": DecodeLane(lane)}
    worker_info = worker_pb2_grpc.WorkerInfoServiceStub(channel)
    free, _ = await load_of(worker_info)
    try:
        for via, stub in stubs.items():
            # The probe's lease: 4e9 ms, some 46 days.
            code, details = await status_of(stub.Allocate(allocate_request(f"pin-{via}", info.model_compat_hash,
                                                                           lease_ms=4_000_000_000)))
            assert code == grpc.StatusCode.INVALID_ARGUMENT
            assert f"cap of {MAX_LEASE_MS} ms" in details and "--max-lease-ms" in details
            code, _ = await status_of(stub.Allocate(allocate_request(f"just-over-{via}", info.model_compat_hash,
                                                                     lease_ms=MAX_LEASE_MS + 1)))
            assert code == grpc.StatusCode.INVALID_ARGUMENT
            assert (await load_of(worker_info))[0] == free  # nothing was pinned
            # At the cap is allowed (and released again).
            ok = await stub.Allocate(allocate_request(f"at-cap-{via}", info.model_compat_hash, lease_ms=MAX_LEASE_MS))
            assert ok.num_blocks > 0
            released = await stub.Release(worker_pb2.ReleaseRequest(request_id=f"at-cap-{via}"))
            assert released.released
        assert (await load_of(worker_info))[0] == free
    finally:
        await channel.close()
        await lane.close()


def parse(*argv: str) -> argparse.Namespace:
    return build_parser().parse_args(list(argv))


def test_the_worker_settings_are_checked(tiny_model: Path) -> None:
    model = tiny_model
    config = build_config(parse("decode", "--model", str(model)))
    assert (config.lease_ms, config.max_lease_ms) == (30_000, MAX_LEASE_MS)
    assert build_config(parse("decode", "--model", str(model), "--max-lease-ms", "5000",
                              "--lease-ms", "5000")).max_lease_ms == 5000
    with pytest.raises(ConfigError, match=r"lease \(30000 ms\) must not exceed --max-lease-ms \(5000\)"):
        build_config(parse("decode", "--model", str(model), "--max-lease-ms", "5000"))
    listed = build_config(parse("prefill", "--model", str(model), "--decode-kv-addresses", "10.0.0.1:7000, h:1"))
    assert listed.decode_kv_addresses == ("10.0.0.1:7000", "h:1")
    with pytest.raises(ConfigError, match="for prefill workers without --redis"):
        build_config(parse("prefill", "--model", str(model), "--redis", "redis://127.0.0.1:1/0",
                           "--decode-kv-addresses", "10.0.0.1:7000"))
    with pytest.raises(ConfigError, match="host:port entries"):
        build_config(parse("prefill", "--model", str(model), "--decode-kv-addresses", "nowhere"))


# -- KV targets -----------------------------------------------------------------------------
async def test_a_prefill_target_outside_the_pool_is_refused_without_a_connection(
        spawn_worker: SpawnWorker, redis_url: str, listener: socket.socket) -> None:
    decode = spawn_worker("decode", redis_url=redis_url)
    prefill = spawn_worker("prefill", redis_url=redis_url)
    d_info, p_info = await info_of(decode), await info_of(prefill)
    compat = d_info.model_compat_hash
    assert decode.address and prefill.address
    d_channel, p_channel = grpc.aio.insecure_channel(decode.address), grpc.aio.insecure_channel(prefill.address)
    p_lane = LaneChannel(p_info.lane_address)
    decode_stub = worker_pb2_grpc.DecodeWorkerStub(d_channel)
    prefills = {"grpc": worker_pb2_grpc.PrefillWorkerStub(p_channel), "lane": PrefillLane(p_lane)}
    client = aioredis.Redis.from_url(redis_url)
    registry = WorkerRegistry(client, "tiny")
    try:
        # A decode worker's own target passes: the check does not refuse everything.
        alloc = await decode_stub.Allocate(allocate_request("good", compat))
        first = await prefills["grpc"].Prefill(prefill_request("good", compat, alloc.target))
        tokens = [first.first_token_id]
        async for chunk in decode_stub.Generate(worker_pb2.DecodeRequest(request_id="good",
                                                                         first_token_id=first.first_token_id)):
            tokens.extend(chunk.token_ids)
        assert len(tokens) == GREEDY.max_tokens
        # A decode worker registered elsewhere than the target names (its record as a stranger's).
        record = (await registry.live_workers(WorkerRole.DECODE))[0].record
        await registry.register(dataclasses.replace(record, worker_id=WorkerId("decode-elsewhere"),
                                                    kv_address="10.9.9.9:1"))
        mine = address_of(listener)
        cases = {
            "intruder": (retarget(alloc.target, worker_id="intruder", address=mine),
                         "'intruder' is not a decode worker registered in pool 'tiny'"),
            "another address": (retarget(alloc.target, address=mine), f"registered KV address {record.kv_address!r}"),
            "registered elsewhere": (retarget(alloc.target, worker_id="decode-elsewhere", address=mine),
                                     "registered KV address '10.9.9.9:1'"),
            "another epoch": (retarget(alloc.target, address=mine, epoch=record.epoch + 1000),
                              f"(epoch {record.epoch}), not"),
        }
        for via, stub in prefills.items():
            for name, (target, message) in cases.items():
                code, details = await status_of(stub.Prefill(prefill_request(f"{name}-{via}", compat, target)))
                expected = grpc.StatusCode.UNAVAILABLE if name == "intruder" else grpc.StatusCode.FAILED_PRECONDITION
                assert code == expected, (via, name, details)
                assert message in details, (via, name, details)
        assert no_connection_within(listener)
        # Still serving, and nothing is held on the prefill worker.
        p_info_stub = worker_pb2_grpc.WorkerInfoServiceStub(p_channel)
        assert (await load_of(p_info_stub))[1] == 0
    finally:
        await client.aclose()
        await d_channel.close()
        await p_channel.close()
        await p_lane.close()


async def test_without_a_registry_only_the_listed_receivers_get_kv(spawn_worker: SpawnWorker,
                                                                  listener: socket.socket) -> None:
    decode = spawn_worker("decode")
    d_info = await info_of(decode)
    unlisted = spawn_worker("prefill")
    listed = spawn_worker("prefill", extra=("--decode-kv-addresses", d_info.kv_address))
    assert decode.address and unlisted.address and listed.address
    channels = [grpc.aio.insecure_channel(a) for a in (decode.address, unlisted.address, listed.address)]
    decode_stub = worker_pb2_grpc.DecodeWorkerStub(channels[0])
    unlisted_stub, listed_stub = (worker_pb2_grpc.PrefillWorkerStub(c) for c in channels[1:])
    compat = d_info.model_compat_hash
    try:
        alloc = await decode_stub.Allocate(allocate_request("static", compat))
        mine = retarget(alloc.target, address=address_of(listener))
        code, details = await status_of(unlisted_stub.Prefill(prefill_request("static", compat, mine)))
        assert code == grpc.StatusCode.FAILED_PRECONDITION and "no --decode-kv-addresses" in details
        code, details = await status_of(listed_stub.Prefill(prefill_request("static", compat, mine)))
        assert code == grpc.StatusCode.FAILED_PRECONDITION and "is not one of" in details
        assert no_connection_within(listener)
        # The listed receiver gets its KV.
        first = await listed_stub.Prefill(prefill_request("static", compat, alloc.target))
        assert first.stats.blocks_sent > 0
        await decode_stub.Release(worker_pb2.ReleaseRequest(request_id="static"))
    finally:
        for channel in channels:
            await channel.close()


async def test_with_redis_unreachable_known_decode_workers_pass_and_others_are_unavailable(redis_url: str) -> None:
    record = WorkerRecord(worker_id=WorkerId("decode-0"), role=WorkerRole.DECODE, address="10.0.0.2:7000",
                          epoch=Epoch(3), model="tiny", model_compat_hash="m", kv_compat_hash="k", block_size=16,
                          capacity_blocks=100, kv_address="10.0.0.2:7100")
    client = aioredis.Redis.from_url(redis_url)
    registry = WorkerRegistry(client, "tiny")
    await registry.register(record)
    check = RegisteredDecodeWorkers(registry, min_refresh_s=0.0)
    target = TransferTarget(transfer_id="t", peer="10.0.0.2:7100", dst_block_ids=(1, 2), compat_hash="k", epoch=3,
                            layer_start=0, layer_end=2)
    assert await check.refusal("decode-0", target) is None
    refused = await check.refusal("decode-0", dataclasses.replace(target, epoch=4))
    assert isinstance(refused, FailedPreconditionError)
    await client.aclose()
    dead = aioredis.Redis(host="127.0.0.1", port=1, socket_connect_timeout=0.5)  # nothing listens on port 1
    check.registry = WorkerRegistry(dead, "tiny")
    assert await check.refusal("decode-0", target) is None  # known: no Redis call
    unknown = await check.refusal("decode-9", target)
    assert isinstance(unknown, UnavailableError) and "cannot check decode worker 'decode-9'" in unknown.message
    await dead.aclose()
