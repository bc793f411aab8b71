"""A worker started with Redis unreachable exits with one clear line naming it, exit code 2, no traceback."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import pytest


def closed_port() -> int:
    """A loopback port nothing listens on (bound, then released)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.mark.parametrize("argv", [
    ["decode", "--backend", "sim", "--model-preset", "tiny"],
    ["prefill", "--backend", "sim", "--model-preset", "tiny", "--count", "2"],  # a fleet shares one client
], ids=["decode", "prefill-fleet"])
def test_a_worker_with_redis_unreachable_exits_with_one_line(argv: list[str]) -> None:
    url = f"redis://worker:hunter2-password@127.0.0.1:{closed_port()}/0"
    proc = subprocess.run([sys.executable, "-m", "pdrouter", *argv, "--redis", url, "--log-level", "ERROR"],
                          capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PDROUTER_INTERNAL_TOKEN": "internal-secret-0123456789"})
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    (line,) = lines
    assert line.startswith(f"pdrouter {argv[0]}: error: cannot reach Redis at redis://worker:***@127.0.0.1:"), line
    assert "hunter2" not in line and "Connection refused" in line and "--redis" in line, line
    assert proc.stdout == ""  # no ready line: nothing was started

