"""``pdrouter up`` as a supervised process: its Redis asks for a password, it stops cleanly on SIGINT
after its output pipe closed, and its children (workers, router, Redis) go when it dies, even by
SIGKILL.

Each test runs the real ``pdrouter up`` on simulated workers (``--time-scale 0``) and follows its
children through psutil. Waits are hang guards, never latency bounds.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest
import redis

WAIT_S = 60.0  # hang guard


class Up:
    """A running ``pdrouter up`` with its banner read up to the router's line."""

    def __init__(self, tmp_path: Path) -> None:
        env = {k: v for k, v in os.environ.items() if not k.startswith("PDROUTER_REDIS")}
        argv = [sys.executable, "-m", "pdrouter", "up", "--backend", "sim", "--time-scale", "0", "--model-preset",
                "tiny", "--model", str(tmp_path / "tiny"), "--http-port", "0", "--grpc-port", "0"]
        self.proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
        self.lines: list[str] = []
        assert self.proc.stdout is not None
        deadline = time.monotonic() + 120
        for line in self.proc.stdout:
            self.lines.append(line.rstrip("\n"))
            if line.startswith("router ") or time.monotonic() > deadline:
                break
        assert self.lines and self.lines[-1].startswith("router "), "\n".join(self.lines)
        self.children = psutil.Process(self.proc.pid).children(recursive=True)
        assert len(self.children) >= 4, self.children  # redis, prefill, decode, router

    def redis_port(self) -> int:
        found = re.search(r"redis:// ?(?:\S*@)?127\.0\.0\.1:(\d+)/0", "\n".join(self.lines))
        assert found is not None, self.lines
        return int(found.group(1))

    def close_output(self) -> None:
        assert self.proc.stdout is not None
        self.proc.stdout.close()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        for child in self.children:
            if child.is_running():
                child.kill()


@pytest.fixture
def up(tmp_path: Path) -> Iterator[Up]:
    started = Up(tmp_path)
    try:
        yield started
    finally:
        started.stop()


def children_left(up: Up) -> list[psutil.Process]:
    _, alive = psutil.wait_procs(up.children, timeout=WAIT_S)
    return [p for p in alive if p.status() != psutil.STATUS_ZOMBIE]


def test_its_redis_asks_for_a_password(up: Up) -> None:
    client = redis.Redis(host="127.0.0.1", port=up.redis_port(), socket_timeout=5)
    with pytest.raises(redis.exceptions.AuthenticationError):
        client.ping()
    with pytest.raises(redis.exceptions.AuthenticationError):
        client.execute_command("AUTH", "default", "guess-" + "x" * 26)
    client.close()


def test_sigint_after_its_output_closed_stops_everything_cleanly(up: Up) -> None:
    """The reader of ``up``'s output is gone (a supervising script died): Ctrl-C still stops every
    child, and ``up`` exits 0."""
    up.close_output()
    up.proc.send_signal(signal.SIGINT)
    assert up.proc.wait(WAIT_S) == 0
    assert children_left(up) == []


def test_its_children_go_when_it_is_killed(up: Up) -> None:
    up.proc.kill()
    up.proc.wait(WAIT_S)
    assert children_left(up) == []
