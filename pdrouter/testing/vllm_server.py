"""vLLM's own OpenAI server as a child process: what the vLLM tests and benchmarks compare the router against.

``python -m vllm.entrypoints.openai.api_server`` (the ``vllm`` console script looks for a distribution
of that name, which the CPU wheel is not), in a session of its own, waited for on ``/health``, and
stopped with the whole session (its engine processes included). Imports no vLLM.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class VllmServer:
    proc: subprocess.Popen[bytes]
    url: str
    """``http://127.0.0.1:<port>``."""
    log: Path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.contextmanager
def vllm_server(model: Path, args: Sequence[str], log: Path, env: Mapping[str, str] | None = None,
                start_s: float = 900.0) -> Iterator[VllmServer]:
    """vLLM's server on ``model`` with the engine arguments ``args`` (its own CLI's), serving until the
    block ends; RuntimeError with the tail of its log when it exits or is not up after ``start_s``."""
    port = free_port()
    argv = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model), "--host", "127.0.0.1",
            "--port", str(port), *args]
    with log.open("wb") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                                env={**os.environ, **(env or {})})
    server = VllmServer(proc, f"http://127.0.0.1:{port}", log)
    try:
        deadline = time.monotonic() + start_s
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"vLLM's server exited with {proc.returncode}:\n{log.read_text()[-3000:]}")
            with contextlib.suppress(OSError), urllib.request.urlopen(f"{server.url}/health", timeout=2) as resp:
                if resp.status == 200:
                    break
            if time.monotonic() > deadline:
                raise RuntimeError(f"vLLM's server not up after {start_s:.0f} s:\n{log.read_text()[-3000:]}")
            time.sleep(0.5)
        yield server
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
