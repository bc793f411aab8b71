"""Many simulated workers in one process (``--backend sim --count N``): identities, ports, presence,
serving through a router, one worker stopping alone, SIGTERM deregistering all, and ``pdrouter up``
grouping a large simulated fleet into a few processes."""

from __future__ import annotations

import asyncio
import json
import secrets
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import httpx
import pytest
import redis.asyncio as aioredis

from pdrouter.cli.local_cluster import ManagedProcess, worker_args
from pdrouter.cli.main import build_parser, main
from pdrouter.cli.up_cmd import FLEET_THRESHOLD, per_process, worker_groups
from pdrouter.cli.worker_cmd import fleet_from_args
from pdrouter.core.errors import ConfigError
from pdrouter.core.workers import WorkerRole
from pdrouter.router.admission import AdmissionConfig
from pdrouter.router.config import RouterConfig
from pdrouter.router.dispatch import DispatchConfig
from pdrouter.router.server import RouterProcess
from pdrouter.state.keys import PoolKeys
from pdrouter.state.registry import WorkerRegistry
from pdrouter.wire.grpc_util import check_health
from pdrouter.wire.security import INTERNAL_TOKEN_ENV
from pdrouter.worker.fleet import Fleet, fleet_configs, fleet_redis_connections
from pdrouter.worker.roles import build_role

from .conftest import sim_args

FLEET = 8
PROMPT = "Disaggregated serving across a fleet in one process: " + "lorem ipsum dolor sit amet " * 3


def error_of(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    return err


@pytest.mark.parametrize(("extra", "expected"), [
    (["--count", "0"], "--count must be >= 1, got 0"),
    (["--count", "-3"], "--count must be >= 1, got -3"),
    (["--count", "4", "--first-index", "-1"], "--first-index must be >= 0, got -1"),
    (["--first-index", "2"], "--first-index only applies with --count"),
    (["--count", "8", "--port", "7000", "--lane-port", "7004"], "overlapping port ranges"),
    (["--count", "8", "--port", "65530"], "past 65535"),
])
def test_bad_fleet_flags_are_one_line_errors(tiny_model: Path, extra: list[str], expected: str,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    err = error_of(["decode", "--backend", "sim", "--model", str(tiny_model), *extra], capsys)
    assert err.startswith("pdrouter decode: error: ") and expected in err, err


def test_count_needs_the_simulated_backend(tiny_model: Path, capsys: pytest.CaptureFixture[str]) -> None:
    err = error_of(["prefill", "--model", str(tiny_model), "--count", "2"], capsys)
    assert "--count runs simulated workers only (--backend sim)" in err


def test_fleet_ids_and_base_ports(tiny_model: Path) -> None:
    args = build_parser().parse_args(["decode", "--backend", "sim", "--model", str(tiny_model), "--count", "3",
                                      "--first-index", "5", "--worker-id", "dec", "--port", "7100",
                                      "--lane-port", "0", "--kv-port", "7200"])
    configs = fleet_from_args(args)
    assert [c.worker_id for c in configs] == ["dec-5", "dec-6", "dec-7"]
    assert [(c.port, c.lane_port, c.kv_port) for c in configs] == [(7100, 0, 7200), (7101, 0, 7201),
                                                                  (7102, 0, 7202)]
    assert len({id(c.engine) for c in configs}) == 1  # one frozen engine configuration for all
    grpc_only = fleet_configs(replace(configs[0], port=0, lane_port=None, kv_port=0), 2, id_prefix="p")
    assert [(c.worker_id, c.port, c.lane_port, c.kv_port) for c in grpc_only] == [("p-0", 0, None, 0),
                                                                                  ("p-1", 0, None, 0)]
    with pytest.raises(ConfigError, match="distinct worker ids"):
        Fleet([configs[0], configs[0]], build_role)
    assert fleet_redis_connections(1) == 16 and fleet_redis_connections(20) == 40
    assert fleet_redis_connections(256) == 64


def test_up_groups_a_large_simulated_fleet() -> None:
    args = build_parser().parse_args(["up", "--backend", "sim", "--prefill", "128", "--decode", "128"])
    size = per_process(args, 256)
    assert size == 32
    groups = worker_groups([("prefill", 128), ("decode", 128)], size)
    assert len(groups) == 8 and groups[0] == ("prefill", 0, 32) and groups[-1] == ("decode", 96, 32)
    assert worker_groups([("decode", 5)], 2) == [("decode", 0, 2), ("decode", 2, 2), ("decode", 4, 1)]
    small = build_parser().parse_args(["up", "--backend", "sim"])
    assert per_process(small, FLEET_THRESHOLD) is None  # one process per worker, as before
    torch = build_parser().parse_args(["up", "--prefill", "64", "--decode", "64"])
    assert per_process(torch, 128) is None
    with pytest.raises(ConfigError, match="--per-process groups simulated workers only"):
        per_process(build_parser().parse_args(["up", "--per-process", "4"]), 2)


async def test_one_worker_stops_alone_and_the_rest_keep_serving(tiny_model: Path, redis_url: str) -> None:
    args = build_parser().parse_args(["decode", "--backend", "sim", "--model", str(tiny_model), "--redis",
                                      redis_url, "--count", "3", "--worker-id", "solo", "--num-blocks", "64",
                                      "--time-scale", "0"])
    fleet = Fleet(fleet_from_args(args), build_role)
    client = aioredis.Redis.from_url(redis_url)
    registry = WorkerRegistry(client, "tiny")
    try:
        await fleet.start()
        assert sorted(w.record.worker_id for w in await registry.live_workers()) == ["solo-0", "solo-1", "solo-2"]
        await fleet.stop_worker("solo-1")
        await fleet.stop_worker("solo-1")  # again: nothing more happens
        assert [w.config.worker_id for w in fleet.running] == ["solo-0", "solo-2"]
        assert sorted(r.worker_id for r in await registry.records()) == ["solo-0", "solo-2"]
        await asyncio.sleep(1.2)  # a heartbeat later the others are still live and serving
        assert sorted(w.record.worker_id for w in await registry.live_workers()) == ["solo-0", "solo-2"]
        for worker in fleet.running:
            assert await check_health(worker.address, "pdrouter.v1.DecodeWorker")
    finally:
        await fleet.stop()
        assert await registry.records() == []
        await client.aclose()


def spawn_fleet(role: str, model: Path, redis_url: str, token: str, count: int) -> ManagedProcess:
    args = worker_args(role, model, redis_url=redis_url, num_blocks=256, sim=sim_args(0.0), count=count,
                       extra=("--worker-id", f"fl-{role}"))
    return ManagedProcess(f"fleet-{role}", args, env={INTERNAL_TOKEN_ENV: token})


async def test_two_fleet_processes_serve_through_a_router_and_deregister_on_sigterm(tiny_model: Path,
                                                                                    redis_url: str) -> None:
    token = secrets.token_hex(16)
    fleets = [spawn_fleet(role, tiny_model, redis_url, token, FLEET) for role in ("prefill", "decode")]
    client = aioredis.Redis.from_url(redis_url)
    registry = WorkerRegistry(client, "tiny")
    router: RouterProcess | None = None
    try:
        addresses = [a for f in fleets for a in await asyncio.to_thread(f.wait_ready_all, FLEET)]
        ready_at = time.monotonic()
        records = await registry.records()
        assert len(records) == 2 * FLEET
        assert sorted(r.worker_id for r in records) == sorted(
            [f"fl-prefill-{i}" for i in range(FLEET)] + [f"fl-decode-{i}" for i in range(FLEET)])
        assert sorted(r.address for r in records) == sorted(addresses)
        ports = [r.address for r in records] + [r.lane_address for r in records] + \
            [r.kv_address for r in records if r.role is WorkerRole.DECODE]
        assert len(set(ports)) == len(ports) == 2 * FLEET * 2 + FLEET  # every port its own
        assert len({r.epoch for r in records}) == 2 * FLEET  # every worker its own incarnation
        config = RouterConfig(model_dir=tiny_model, redis_url=redis_url, http_port=0, grpc_port=0,
                              refresh_interval_s=0.2, internal_token=token,
                              dispatch=DispatchConfig(local_prefill_tokens=0),
                              admission_config=AdmissionConfig(queue_timeout_s=5.0))
        router = RouterProcess(config)
        await router.start()
        assert router.pool is not None
        for _ in range(100):
            if len(router.pool.workers()) == 2 * FLEET:
                break
            await asyncio.sleep(0.05)
        url = f"http://127.0.0.1:{router.http_port}/v1/completions"
        async with httpx.AsyncClient(timeout=60) as http:
            async def ask(i: int) -> int:
                resp = await http.post(url, json={
                    "model": "tiny", "prompt": f"{i} {PROMPT}", "max_tokens": 24, "ignore_eos": True})
                return resp.status_code
            statuses = await asyncio.gather(*(ask(i) for i in range(48)))
        assert statuses == [200] * 48
        assert router.dispatcher is not None
        assert router.dispatcher.stats.transfers == 48  # every one disaggregated: KV from prefill to decode
        assert len(router.dispatcher.stats.placed_tokens) >= 3  # spread over the prefill workers
        # Heartbeats: still all live past the heartbeat TTL, and each carries its own load.
        await asyncio.sleep(max(0.0, 3.5 - (time.monotonic() - ready_at)))
        live = await registry.live_workers()
        assert len(live) == 2 * FLEET
        assert sum(1 for w in live if w.record.role is WorkerRole.DECODE and w.load.sim_modeled_s > 0) >= 3
        await router.stop(grace=1.0)
        router = None
        for f in fleets:
            assert await asyncio.to_thread(f.stop, 30.0) == 0
        assert await registry.records() == []
        keys = PoolKeys("pdr", "tiny")
        assert await client.zcard(keys.prefix_live) == 0  # every incarnation cleared its index entries
        assert [k async for k in client.scan_iter(match=keys.prefix_set_pattern)] == []
    finally:
        if router is not None:
            await router.stop(grace=1.0)
        for f in fleets:
            f.stop()
        await client.aclose()


def test_up_runs_a_simulated_fleet_in_a_few_processes(tmp_path: Path) -> None:
    done = subprocess.run([sys.executable, "-m", "pdrouter", "up", "--backend", "sim", "--prefill", "16",
                           "--decode", "16", "--time-scale", "0", "--http-port", "0", "--grpc-port", "0", "--once"],
                          capture_output=True, text=True, timeout=240, cwd=tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "prefill-0..15 16 workers at 127.0.0.1:" in done.stdout
    assert "decode-0..15 16 workers at 127.0.0.1:" in done.stdout
    body = json.loads(done.stdout[done.stdout.index("{"):done.stdout.rindex("}") + 1])
    assert body["usage"]["completion_tokens"] >= 1
