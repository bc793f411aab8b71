"""Worker test fixtures: a tiny model folder, worker processes (torch or simulated), gRPC stubs."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from pdrouter.cli.local_cluster import ManagedProcess, worker_args
from pdrouter.engine.model_io import make_model
from pdrouter.wire.v1 import worker_pb2, worker_pb2_grpc

SpawnWorker = Callable[..., ManagedProcess]

BACKENDS = ["torch", "sim"]
"""The worker engines: the torch model on the CPU, or a simulated H100 (``--backend sim``) over the
same model folder's geometry. A test that needs no real logits runs on both with
``@pytest.mark.parametrize("backend", BACKENDS)``, which overrides the ``backend`` fixture."""


def sim_args(time_scale: float = 0.0) -> list[str]:
    """The further arguments of a simulated worker: an H100, ``time_scale`` × the modeled time
    (0: answer without sleeping; a step of the tiny model costs about 1.7 ms of modeled time)."""
    return ["--gpu", "h100", "--time-scale", f"{time_scale:g}"]


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny preset, seed 0, in a folder named ``tiny`` (so the served model name is ``tiny``)."""
    return make_model("tiny", 0, tmp_path_factory.mktemp("models") / "tiny")


@pytest.fixture
def backend() -> str:
    """The engine ``spawn_worker`` starts unless told otherwise: torch, or the test's parameter."""
    return "torch"


@contextmanager
def worker_spawner(default_model: Path, default_backend: str) -> Iterator[SpawnWorker]:
    """A ``spawn`` function (``spawn_worker``'s) whose processes are all stopped when the block ends."""
    procs: list[ManagedProcess] = []

    def spawn(role: str, *, redis_url: str | None = None, num_blocks: int = 256,
              kv_backend: str | None = None, extra: tuple[str, ...] = (), model: Path | None = None,
              backend: str | None = None, time_scale: float = 0.0) -> ManagedProcess:
        engine = backend or default_backend
        assert engine in BACKENDS, engine
        args = worker_args(role, model or default_model, redis_url=redis_url, num_blocks=num_blocks,
                           kv_backend=kv_backend, torch_threads=1,
                           sim=sim_args(time_scale) if engine == "sim" else None, extra=extra)
        proc = ManagedProcess(f"{role}-{len(procs)}", args)
        procs.append(proc)
        proc.wait_ready()
        return proc

    try:
        yield spawn
    finally:
        for proc in procs:
            proc.stop()


@pytest.fixture
def spawn_worker(tiny_model: Path, backend: str) -> Iterator[SpawnWorker]:
    """Start ``pdrouter worker|prefill|decode`` processes; every one is stopped at the end.

    ``backend``: torch or sim (default: the ``backend`` fixture's); ``time_scale``: a simulated
    worker's (ignored by torch workers).
    """
    with worker_spawner(tiny_model, backend) as spawn:
        yield spawn


@pytest.fixture(scope="module")
def spawn_module_worker(tiny_model: Path) -> Iterator[SpawnWorker]:
    """``spawn_worker`` for processes the tests of a module share (torch unless ``backend=`` says
    otherwise); every one is stopped after the module's last test."""
    with worker_spawner(tiny_model, "torch") as spawn:
        yield spawn


async def load_of(info: worker_pb2_grpc.WorkerInfoServiceStub) -> tuple[int, int]:
    """A worker's (free KV blocks, running requests)."""
    load = await info.GetLoad(worker_pb2.GetLoadRequest())
    return load.free_blocks, load.running


async def settle(info: worker_pb2_grpc.WorkerInfoServiceStub, free: int) -> tuple[int, int]:
    """Poll until the worker shows ``free`` blocks and nothing running (or give the last reading)."""
    reading = (-1, -1)
    for _ in range(200):
        reading = await load_of(info)
        if reading == (free, 0):
            break
        await asyncio.sleep(0.025)
    return reading
