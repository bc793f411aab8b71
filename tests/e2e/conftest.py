"""End-to-end fixtures: worker processes (torch or simulated), Redis, and a router running in the test's event loop."""

from __future__ import annotations

import asyncio
import secrets
import sys
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from pdrouter.cli.local_cluster import ManagedProcess, worker_args
from pdrouter.engine.model_io import make_model
from pdrouter.router.admission import AdmissionConfig
from pdrouter.router.config import RouterConfig
from pdrouter.router.dispatch import DispatchConfig
from pdrouter.router.server import RouterProcess
from pdrouter.wire.security import INTERNAL_TOKEN_ENV


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_model("tiny", 0, tmp_path_factory.mktemp("models") / "tiny")


BACKENDS = ["torch", "sim"]
"""The workers' engines: the torch model on the CPU, or a simulated H100 (``--backend sim``) over the
same model folder's geometry, with pseudo-random tokens. A test that needs no real logits runs on
both with ``@pytest.mark.parametrize("backend", BACKENDS)``, which overrides the ``backend`` fixture."""


@dataclass
class Cluster:
    model: Path
    redis_url: str
    backend: str = "torch"
    """The engine of the workers ``spawn`` starts: torch or sim."""
    internal_token: str = field(default_factory=lambda: secrets.token_hex(16), repr=False)
    """The secret the cluster's router and workers share (internal calls without it are refused)."""
    procs: list[ManagedProcess] = field(default_factory=list)
    routers: list[RouterProcess] = field(default_factory=list)

    def __post_init__(self) -> None:
        assert self.backend in BACKENDS, self.backend

    def spawn(self, role: str, *, num_blocks: int = 256, worker_id: str | None = None,
              extra: tuple[str, ...] = (), time_scale: float = 0.0,
              env: dict[str, str] | None = None) -> ManagedProcess:
        """Start a worker. ``time_scale``: a simulated worker's (0: no sleeping; a step of the tiny
        model costs about 1.7 ms of modeled time); torch workers ignore it. ``env``: more variables
        for the worker's environment (e.g. an injected engine fault)."""
        ident = worker_id or f"{role}-{len(self.procs)}"
        sim = ["--gpu", "h100", "--time-scale", f"{time_scale:g}"] if self.backend == "sim" else None
        proc = ManagedProcess(ident, worker_args(role, self.model, redis_url=self.redis_url, num_blocks=num_blocks,
                                                 torch_threads=1, sim=sim, extra=("--worker-id", ident, *extra)),
                              env={INTERNAL_TOKEN_ENV: self.internal_token, **(env or {})})
        self.procs.append(proc)
        proc.wait_ready()
        return proc

    async def router(self, mode: str = "disaggregated", **kw: Any) -> RouterProcess:
        orch = kw.pop("dispatch", DispatchConfig(mode=mode))  # type: ignore[arg-type]
        adm = kw.pop("admission_config", AdmissionConfig(queue_timeout_s=2.0))
        config = RouterConfig(model_dir=self.model, redis_url=self.redis_url, mode=mode,  # type: ignore[arg-type]
                              http_port=0, grpc_port=0, refresh_interval_s=0.2, dispatch=orch,
                              admission_config=adm, **{"internal_token": self.internal_token, **kw})
        router = RouterProcess(config)
        await router.start()
        self.routers.append(router)
        return router


def spawn_router(cluster: Cluster, name: str) -> ManagedProcess:
    """A router as its own process (``pdrouter router``) on the cluster's Redis, with short queue and lease
    times, every prompt prefilled remotely; tracked by the cluster and stopped with it."""
    proc = ManagedProcess(name, ["router", "--model", str(cluster.model), "--redis", cluster.redis_url,
                                 "--http-port", "0", "--grpc-port", "0", "--queue-timeout-s", "0.05",
                                 "--lease-ms", "1500", "--local-prefill-tokens", "0", "--log-level", "WARNING"],
                          env={INTERNAL_TOKEN_ENV: cluster.internal_token})
    cluster.procs.append(proc)
    proc.wait_ready()
    return proc


@pytest.fixture
def backend() -> str:
    """The engine of the ``cluster``'s workers: torch, or the test's parameter."""
    return "torch"


@pytest.fixture
async def cluster(tiny_model: Path, redis_url: str, backend: str) -> AsyncIterator[Cluster]:
    c = Cluster(tiny_model, redis_url, backend)
    yield c
    try:
        for r in c.routers:
            stopping = asyncio.ensure_future(r.stop(grace=1.0))
            done, _ = await asyncio.wait({stopping}, timeout=60)
            if not done:
                dump_tasks()
                stopping.cancel()
                raise AssertionError("the router did not stop within 60 s; its tasks are printed above")
            stopping.result()
    finally:
        for p in c.procs:
            p.stop()


def dump_tasks() -> None:
    """Print every task of the running loop with its stack: what a hung teardown was waiting for."""
    for task in asyncio.all_tasks():
        print(f"--- {task.get_name()}: {task!r}", file=sys.stderr)
        task.print_stack(file=sys.stderr)


@pytest.fixture
def wait_for() -> Iterator[Callable[..., Any]]:
    async def wait(predicate: Callable[[], Any], timeout: float = 10.0, interval: float = 0.05) -> Any:
        loop = asyncio.get_running_loop()
        end = loop.time() + timeout
        while True:
            value = predicate()
            if asyncio.iscoroutine(value):
                value = await value
            if value:
                return value
            if loop.time() > end:
                raise AssertionError("condition not met in time")
            await asyncio.sleep(interval)

    yield wait
