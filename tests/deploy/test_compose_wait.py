"""deploy/compose-wait.sh (the health wait Compose v1 lacks) against a stand-in ``docker`` command,
and the CI entry point that runs the real compose check."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

import pytest

from .deploy_files import DEPLOY, REPO

WAIT = DEPLOY / "compose-wait.sh"

FAKE_DOCKER = """#!/bin/sh
# ps -aq --filter label=...: the ids; inspect -f FORMAT IDS: one state line a container.
case "$1" in
  ps) [ -e "{dir}/no-daemon" ] && exit 1; cut -d' ' -f1 "{dir}/states" ;;
  inspect) cat "{dir}/states" ;;
esac
"""


@pytest.fixture
def docker(tmp_path: Path) -> Path:
    fake = tmp_path / "docker"
    fake.write_text(FAKE_DOCKER.format(dir=tmp_path))
    fake.chmod(0o755)
    return tmp_path


def wait(docker: Path, states: list[str], timeout_s: int = 2) -> subprocess.CompletedProcess[str]:
    """compose-wait.sh with the containers in ``states`` ('/name status exit health policy')."""
    (docker / "states").write_text("".join(f"{s}\n" for s in states))
    return subprocess.run(["sh", str(WAIT), "proj", str(timeout_s)], capture_output=True, text=True, timeout=60,
                          env={"PATH": "/usr/bin:/bin", "DOCKER": str(docker / "docker")})


def test_ready_when_every_service_is_healthy_and_every_step_done(docker: Path) -> None:
    done = wait(docker, ["/proj_secrets_1 exited 0 none no", "/proj_redis_1 running 0 healthy unless-stopped",
                         "/proj_router_1 running 0 healthy unless-stopped", "/proj_tool_1 running 0 none no"])
    assert done.returncode == 0, done.stderr


@pytest.mark.parametrize(("state", "why"), [
    ("/proj_router_1 running 0 unhealthy unless-stopped", "proj_router_1 is unhealthy"),
    ("/proj_model_1 exited 1 none no", "proj_model_1 exited 1"),
])
def test_fails_at_once_naming_the_container(docker: Path, state: str, why: str) -> None:
    started = time.monotonic()
    done = wait(docker, ["/proj_redis_1 running 0 healthy unless-stopped", state], timeout_s=30)
    assert done.returncode == 1
    assert f"compose-wait: proj not ready: {why}" in done.stderr
    assert "proj_redis_1 running 0 healthy" in done.stderr, "every container's state is printed"
    assert time.monotonic() - started < 10, "a failure does not wait for the timeout"


@pytest.mark.parametrize("state", ["/proj_decode_1 running 0 starting unless-stopped",
                                   "/proj_decode_1 restarting 137 starting unless-stopped",
                                   "/proj_decode_1 exited 137 none unless-stopped",
                                   "/proj_decode_1 created 0 none unless-stopped"])
def test_waits_for_what_is_still_coming_up_until_the_timeout(docker: Path, state: str) -> None:
    started = time.monotonic()
    done = wait(docker, [state], timeout_s=2)
    assert done.returncode == 1
    assert "timed out after 2 s" in done.stderr and "proj_decode_1" in done.stderr
    assert time.monotonic() - started >= 2, "a 2 s timeout waits at least 2 s"


def test_no_containers_is_not_ready(docker: Path) -> None:
    done = wait(docker, [], timeout_s=1)
    assert done.returncode == 1 and "no containers for project proj" in done.stderr


def test_no_daemon_is_not_ready(docker: Path) -> None:
    (docker / "no-daemon").touch()
    done = wait(docker, [], timeout_s=1)
    assert done.returncode == 1 and "cannot list its containers" in done.stderr


def test_ci_runs_the_compose_check_after_the_test_suite() -> None:
    lines = [line.strip() for line in (REPO / ".ci" / "run").read_text().splitlines()
             if line.strip() and not line.lstrip().startswith("#")]
    tests, check = lines.index("bash scripts/test.sh"), lines.index("bash scripts/compose_check.sh")
    assert tests < check
    assert not any(line.startswith("exec ") for line in lines), "exec would end .ci/run before the compose check"
    script = (REPO / "scripts" / "compose_check.sh").read_text()
    assert "up --wait" not in script.replace("`up --wait`", ""), "v1 has no --wait: the check polls"
    assert "deploy/compose-wait.sh" in script
