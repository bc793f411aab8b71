"""The compose services, run as local processes with their own command lines, serve a completion.

This is the compose cluster without Docker (see ``local_compose``; scripts/compose_check.sh runs
the real one): the secrets and model steps, the workers and the router run exactly the arguments
the compose file gives them, with the secrets the secrets step generated (Redis asks for its
password), the compose health checks must pass before dependents start, and the router's
published HTTP port answers a real ``/v1/completions`` request with the generated API key. The
``colocated`` profile gets the same treatment.
"""

from __future__ import annotations

import argparse
import json
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from pdrouter.state.embedded_redis import EmbeddedRedis

from .deploy_files import (
    HEALTHCHECK_COMMAND,
    active_services,
    compose_argv,
    load_compose,
    parse_pdrouter,
    pdrouter_commands,
    published_ports,
)
from .local_compose import LOOPBACK, LocalCompose

pytestmark = pytest.mark.slow


@pytest.fixture
def local_compose(tmp_path: Path) -> Iterator[LocalCompose]:
    with EmbeddedRedis() as redis:
        stack = LocalCompose(load_compose(), tmp_path, redis)
        try:
            yield stack
        finally:
            stack.down()


def router_args(stack: LocalCompose, router: str) -> argparse.Namespace:
    (argv,) = pdrouter_commands(compose_argv(stack.services[router]))
    return parse_pdrouter(argv)


def served_model(args: argparse.Namespace) -> str:
    return str(args.served_model_name or Path(args.model).name)


def api_key(stack: LocalCompose, router: str) -> str:
    """The first key of the router's ``--api-key-file`` (written by the secrets step)."""
    args = router_args(stack, router)
    (path,) = args.api_key_file
    return Path(stack.localize_text(router, str(path))).read_text().split()[0]


def complete(port: int, model: str, key: str, timeout: float = 90.0) -> dict[str, Any]:
    """POST one completion; retried while the router has not yet seen the workers in Redis."""
    body = json.dumps({"model": model, "prompt": "The capital of France is", "max_tokens": 8,
                       "temperature": 0}).encode()
    deadline = time.monotonic() + timeout
    while True:
        req = urllib.request.Request(f"http://{LOOPBACK}:{port}/v1/completions", data=body,
                                     headers={"Content-Type": "application/json", "Authorization": f"Bearer {key}"})
        try:
            with urllib.request.urlopen(req, timeout=60) as reply:
                assert reply.status == 200
                return dict(json.loads(reply.read()))
        except urllib.error.HTTPError as exc:
            detail = exc.read().decode(errors="replace")
            if exc.code not in (429, 503) or time.monotonic() > deadline:
                raise AssertionError(f"HTTP {exc.code}: {detail}") from None
        time.sleep(0.25)


def assert_completion(answer: dict[str, Any]) -> None:
    assert answer["object"] == "text_completion"
    assert isinstance(answer["choices"][0]["text"], str)
    usage = answer["usage"]
    assert usage["prompt_tokens"] > 0
    assert usage["completion_tokens"] >= 1
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]


def test_default_services_serve_a_completion(local_compose: LocalCompose) -> None:
    stack = local_compose
    selected = active_services({"services": stack.services})
    assert selected == ["decode", "model", "prefill", "redis", "router", "secrets"]
    stack.up(selected)

    args = router_args(stack, "router")
    assert set(published_ports(stack.services["router"])) == {args.http_port, args.grpc_port}
    answer = complete(stack.port("router", args.http_port), served_model(args), api_key(stack, "router"))
    assert_completion(answer)
    # The gRPC front door answers grpc.health.v1 on its published port.
    grpc_check = stack.healthcheck("router", [HEALTHCHECK_COMMAND, "grpc", f"127.0.0.1:{args.grpc_port}"])
    assert grpc_check.returncode == 0, grpc_check.stderr


def test_colocated_profile_serves_a_completion(local_compose: LocalCompose) -> None:
    stack = local_compose
    selected = active_services({"services": stack.services}, profiles=["colocated"], unprofiled=False)
    assert selected == ["model", "redis", "router-colocated", "secrets", "worker"]
    stack.up(selected)
    args = router_args(stack, "router-colocated")
    answer = complete(stack.port("router-colocated", args.http_port), served_model(args),
                      api_key(stack, "router-colocated"))
    assert_completion(answer)


def test_model_step_is_idempotent(local_compose: LocalCompose) -> None:
    stack = local_compose
    stack.run_once("model")
    models = stack.volumes["models"]
    first = {p.relative_to(models): p.stat().st_mtime_ns for p in models.rglob("*")}
    assert first, "the model step wrote nothing"
    assert not any(part.startswith(".") for p in first for part in p.parts), "a partial folder was left"

    again = stack.run_once("model")
    assert "exists" in again.stdout
    assert {p.relative_to(models): p.stat().st_mtime_ns for p in models.rglob("*")} == first
