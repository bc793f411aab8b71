"""Child processes for a local cluster: ``pdrouter up`` and the multi-process tests use the same code.

Each child is a ``pdrouter`` subcommand that prints one ready line once it serves
(:func:`ready_line`: ``ready: WHAT at HOST:PORT[ grpc HOST:PORT]``, the marker at the start of the
line); the parent waits for that line, keeps the process handle, and stops it with SIGTERM (then
SIGKILL). Only a whole line in that form counts, so the parent never takes an address from
anything else the child prints (a traceback quoting the code that prints the line, a log line).
A fleet of simulated workers (``pdrouter prefill|decode --backend sim --count N``) prints one
such line per worker: ``ManagedProcess.wait_ready_all(N)`` waits for all of them.

A child started with ``die_with_parent`` stops when its parent dies, however it dies (even by
SIGKILL): it holds the read end of a pipe whose only write end is the parent's, and a thread of
its own (:func:`follow_parent`, run by ``pdrouter``'s entry point) waits on it; when the parent's
end closes, the child sends itself SIGTERM (its graceful stop) and exits at the latest
``ORPHAN_GRACE_S`` later.
"""

from __future__ import annotations

import errno
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Sequence
from pathlib import Path
from types import TracebackType

from pdrouter.core.errors import ConfigError, UnavailableError

PARENT_FD_ENV = "PDROUTER_PARENT_FD"
"""In a child started with ``die_with_parent``: the descriptor of its end of the lifeline pipe."""
ORPHAN_GRACE_S = 30.0
"""How long a child whose parent died has for its graceful stop before it exits regardless."""
READY_MARKER = "ready:"
_ADDRESS = r"[^\s{}]+:\d+"
_READY = re.compile(rf"{re.escape(READY_MARKER)} \S.* at (?P<address>{_ADDRESS})(?: grpc (?P<grpc>{_ADDRESS}))?")


def ready_line(what: str, address: str, grpc_address: str | None = None) -> str:
    """The line a serving child prints: ``ready: WHAT at HOST:PORT`` (`` grpc HOST:PORT`` for the router)."""
    return f"{READY_MARKER} {what} at {address}" + (f" grpc {grpc_address}" if grpc_address else "")


def parse_ready_line(line: str) -> tuple[str, str | None] | None:
    """(address, gRPC address or None) of a ready line; None for any other line."""
    m = _READY.fullmatch(line.rstrip("\r\n"))
    return None if m is None else (m.group("address"), m.group("grpc"))


def check_ports_free(host: str, ports: Sequence[tuple[int, str]]) -> None:
    """ConfigError naming the first ``(port, flag)`` that cannot be bound on ``host`` (port 0 is skipped).

    Binds as the servers do (``SO_REUSEADDR``, so a port left in TIME_WAIT by an earlier run passes)
    and lets go at once.
    """
    for port, flag in ports:
        if not port:
            continue
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        with socket.socket(family, socket.SOCK_STREAM) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                sock.bind((host, port))
            except OSError as exc:
                if exc.errno == errno.EADDRINUSE:
                    raise ConfigError(f"port {port} on {host} is already in use: stop what listens there or "
                                      f"choose another port with {flag}") from None
                raise ConfigError(f"cannot listen on {host}:{port} ({exc.strerror or exc}): choose another "
                                  f"port with {flag}") from None


class ManagedProcess:
    """A ``pdrouter`` child process, its readiness address and the tail of its output."""

    def __init__(self, name: str, args: Sequence[str], env: dict[str, str] | None = None,
                 log_file: Path | None = None, die_with_parent: bool = True) -> None:
        """``die_with_parent`` (the default): the child stops when this process dies, however it dies
        (module docstring), so a test or benchmark killed mid-run leaves no worker behind."""
        self.name = name
        self.args = [sys.executable, "-m", "pdrouter", *args]
        full_env = {**os.environ, **(env or {}), "PYTHONUNBUFFERED": "1"}
        full_env.pop(PARENT_FD_ENV, None)
        lifeline: tuple[int, ...] = ()
        self._lifeline: int | None = None
        if die_with_parent:
            child_end, self._lifeline = os.pipe()  # neither end inherited by anything but this child
            lifeline = (child_end,)
            full_env[PARENT_FD_ENV] = str(child_end)
        try:
            self.proc = subprocess.Popen(self.args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=full_env,
                                         text=True, bufsize=1, start_new_session=True, pass_fds=lifeline)
        finally:
            for fd in lifeline:
                os.close(fd)
        self.tail: deque[str] = deque(maxlen=200)
        self.address: str | None = None
        self.grpc_address: str | None = None
        self.ready: list[tuple[str, str | None]] = []
        """Every ready line's (address, gRPC address or None), in the order printed."""
        self._ready = threading.Event()
        self._changed = threading.Condition()
        self._log = log_file.open("a") if log_file else None
        self._ended = False
        self._reader = threading.Thread(target=self._read, name=f"{name}-output", daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.tail.append(line.rstrip())
            if self._log:
                self._log.write(line)
                self._log.flush()
            ready = parse_ready_line(line)
            if ready is not None:
                with self._changed:
                    self.ready.append(ready)
                    if self.address is None:
                        self.address, self.grpc_address = ready
                    self._changed.notify_all()
                self._ready.set()
        with self._changed:
            self._ended = True
            self._changed.notify_all()
        self._ready.set()

    def wait_ready(self, timeout: float = 120.0) -> str:
        """The address the child serves at; UnavailableError with its output if it died or hung."""
        deadline = time.monotonic() + timeout
        while not self._ready.wait(0.1):
            if time.monotonic() > deadline:
                self.stop()
                raise UnavailableError(f"{self.name} not ready after {timeout}s:\n" + "\n".join(self.tail))
        if self.address is None:
            raise UnavailableError(f"{self.name} exited with {self.proc.wait()}:\n" + "\n".join(self.tail))
        return self.address

    def wait_ready_all(self, count: int, timeout: float = 120.0) -> list[str]:
        """The addresses of the child's first ``count`` ready lines (a fleet prints one per worker);
        UnavailableError with its output if it died, or hung, before printing them all."""
        deadline = time.monotonic() + timeout
        with self._changed:
            while len(self.ready) < count and not self._ended:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._changed.wait(min(left, 0.5))
            got = len(self.ready)
        if got < count:
            if self._ended:
                raise UnavailableError(f"{self.name} exited with {self.proc.wait()} after {got} of {count} ready "
                                       f"lines:\n" + "\n".join(self.tail))
            self.stop()
            raise UnavailableError(f"{self.name}: {got} of {count} ready lines after {timeout}s:\n"
                                   + "\n".join(self.tail))
        return [address for address, _ in self.ready[:count]]

    @property
    def alive(self) -> bool:
        return self.proc.poll() is None

    def kill(self) -> None:
        """SIGKILL now (a crash, for fault tests)."""
        if self.alive:
            self.proc.kill()
            self.proc.wait()

    def terminate(self) -> None:
        """SIGTERM now, without waiting (``stop`` then waits; :func:`stop_all` stops many at once)."""
        if self.alive:
            self.proc.send_signal(signal.SIGTERM)

    def stop(self, timeout: float = 15.0) -> int:
        """SIGTERM, wait for a graceful exit, SIGKILL if it does not come."""
        if self.alive:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._reader.join(2.0)
        if self._log:
            self._log.close()
            self._log = None
        if self._lifeline is not None:
            os.close(self._lifeline)
            self._lifeline = None
        return int(self.proc.returncode)

    def __enter__(self) -> ManagedProcess:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()


def follow_parent() -> None:
    """In a child started with ``die_with_parent``: stop when the parent is gone (module docstring).

    Does nothing in any other process. The variable is removed, so the child's own children do not
    take it for theirs.
    """
    value = os.environ.pop(PARENT_FD_ENV, None)
    if not value:
        return
    fd = int(value)

    def watch() -> None:
        try:
            while os.read(fd, 1):  # nothing is ever written: this returns at the end of the pipe
                pass
        except OSError:
            pass
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(ORPHAN_GRACE_S)
        os._exit(1)

    threading.Thread(target=watch, name="parent-lifeline", daemon=True).start()


def stop_all(procs: Sequence[ManagedProcess], timeout: float = 15.0) -> None:
    """SIGTERM every process at once, then ``stop`` each (SIGKILL for one still running after ``timeout``)."""
    for proc in procs:
        proc.terminate()
    for proc in procs:
        proc.stop(timeout)


def cores_each(processes: int) -> int:
    """Cores per process when ``processes`` share the CPUs this process may use (its affinity mask,
    capped by its cgroup CPU limit: ``pdrouter.worker.cpus``); at least 1."""
    from pdrouter.worker.cpus import cpu_budget

    return max(1, cpu_budget().usable // max(1, processes))


def worker_args(role: str, model_dir: Path | str, *, redis_url: str | None = None, num_blocks: int | None = None,
                kv_backend: str | None = None, torch_threads: int | None = None,
                sim: Sequence[str] | None = None, count: int | None = None, first_index: int = 0,
                extra: Sequence[str] = ()) -> list[str]:
    """Command-line arguments of ``pdrouter worker|prefill|decode``.

    ``count`` (with ``sim``): a fleet of that many simulated workers in the one process, ids
    ``<--worker-id>-<first_index + i>`` (pass ``--worker-id`` in ``extra``); wait for it with
    ``ManagedProcess.wait_ready_all(count)``.

    ``torch_threads``: the worker's torch intra-op threads (None: the worker's default). Workers
    sharing a machine should split its cores (:func:`cores_each`): torch's default gives each of
    them one thread per core, and the extra threads spin on cores the others need. ``sim``: run a
    simulated GPU (``--backend sim``) with these further arguments (``--gpu h100``, ``--time-scale 1``…).
    """
    args = [role, "--model", str(model_dir), "--port", "0", "--log-level", "WARNING"]
    if sim is not None:
        args += ["--backend", "sim", *sim]
    elif torch_threads is not None:
        args += ["--torch-threads", str(torch_threads)]
    if redis_url:
        args += ["--redis", redis_url]
    if num_blocks:
        args += ["--num-blocks", str(num_blocks)]
    if kv_backend and role != "worker":
        args += ["--kv-backend", kv_backend]
    if count is not None:
        args += ["--count", str(count), "--first-index", str(first_index)]
    return [*args, *extra]
