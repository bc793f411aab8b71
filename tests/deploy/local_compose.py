"""Run a compose file's services as local processes, with the very commands the containers run.

Only what cannot be the same on one host changes: service hostnames and bind-all addresses
become 127.0.0.1 (so does ``$HOSTNAME`` in a service's script), every port a service listens on
becomes a free local port (references to it from other services follow), named volumes become
folders, and the ``redis`` service is an embedded ``redis-server`` that asks for the password its
compose command reads (``requirepass $(cat FILE)``) and has the users it defines. A long-running
service whose command is a ``sh -c`` script runs the one ``exec pdrouter ...`` of that script. Services start in
``depends_on`` order; a service others wait on as ``service_healthy`` must pass its own compose
health check first, and a one-shot service must exit 0.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import redis as redis_py

from pdrouter.cli.local_cluster import ManagedProcess
from pdrouter.state.embedded_redis import EmbeddedRedis, free_port, redis_version

from .deploy_files import (
    HEALTHCHECK_COMMAND,
    HEALTHCHECK_SCRIPT,
    PORT_FLAGS,
    compose_argv,
    compose_env,
    compose_healthcheck,
    compose_mounts,
    shell_pdrouter_commands,
    shell_script,
    start_order,
)

LOOPBACK = "127.0.0.1"
_BIND_ALL = ("0.0.0.0", "::")
_HOST_FLAGS = ("--host", "--advertise-host")


class LocalCompose:
    """The services of one compose file on this host; ``up`` starts them, ``down`` stops them."""

    def __init__(self, compose: dict[str, Any], workdir: Path, redis: EmbeddedRedis,
                 redis_service: str = "redis", redis_port: int = 6379) -> None:
        self.services: dict[str, Any] = compose["services"]
        self.workdir = workdir
        self.redis_service = redis_service
        self.redis = redis
        self.ports: dict[tuple[str, int], int] = {(redis_service, redis_port): redis.port}
        self.volumes: dict[str, Path] = {}
        for name in compose.get("volumes") or {}:
            self.volumes[name] = workdir / "volumes" / name
            self.volumes[name].mkdir(parents=True)
        self.procs: dict[str, ManagedProcess] = {}
        names = sorted([*self.services, LOOPBACK, "localhost", *_BIND_ALL], key=len, reverse=True)
        self._host_port = re.compile(r"(?<![\w.-])(" + "|".join(map(re.escape, names)) + r"):(\d+)\b")

    # -- localization ---------------------------------------------------------------------------

    def port(self, service: str, container_port: int) -> int:
        """The local port standing in for ``service``'s ``container_port``."""
        key = (service, container_port)
        if key not in self.ports:
            self.ports[key] = free_port()
        return self.ports[key]

    def localize_text(self, service: str, text: str) -> str:
        """``text`` with ``host:port`` and volume paths moved to this host."""
        def host_port(m: re.Match[str]) -> str:
            host = m.group(1)
            owner = host if host in self.services else service
            return f"{LOOPBACK}:{self.port(owner, int(m.group(2)))}"

        text = self._host_port.sub(host_port, text)
        for mount in compose_mounts(self.services[service]):
            if mount.source in self.volumes:
                pattern = r"(?<![\w./-])" + re.escape(mount.target) + r"(?![\w.-])"
                text = re.sub(pattern, str(self.volumes[mount.source]).replace("\\", r"\\"), text)
        return text

    def localize_argv(self, service: str, argv: Sequence[str]) -> list[str]:
        out: list[str] = []
        for i, token in enumerate(argv):
            flag = argv[i - 1] if i else ""
            if flag in PORT_FLAGS and token.isdigit() and int(token) != 0:
                out.append(str(self.port(service, int(token))))
            elif flag in _HOST_FLAGS and (token in self.services or token in _BIND_ALL):
                out.append(LOOPBACK)
            else:
                out.append(self.localize_text(service, token))
        return out

    def env(self, service: str) -> dict[str, str]:
        """The service's environment; a ``NAME_FILE`` one blanks an inherited ``NAME`` (a container
        has only what compose gives it, and pdrouter refuses both forms at once)."""
        env = {k: self.localize_text(service, v) for k, v in compose_env(self.services[service]).items()}
        for name in [k for k in env if k.endswith("_FILE")]:
            env.setdefault(name.removesuffix("_FILE"), "")
        return env

    # -- running --------------------------------------------------------------------------------

    def up(self, selected: Sequence[str], timeout: float = 120.0) -> None:
        """Start ``selected`` (and nothing else) wave by wave, as ``docker compose up --wait`` would."""
        for wave in start_order(self.services, selected):
            started = [name for name in wave if self._start(name, timeout)]
            for name in started:
                self.procs[name].wait_ready(timeout)
            for name in wave:
                if self.services[name].get("healthcheck") and name != self.redis_service:
                    self.wait_healthy(name, timeout)

    def _start(self, name: str, timeout: float) -> bool:
        """Run a one-shot service to completion (False) or start a long-running one (True)."""
        if name == self.redis_service:
            self._require_redis_password()
            return False
        argv = compose_argv(self.services[name])
        script = shell_script(argv)
        if script is not None and self.services[name].get("restart") == "no":
            self.run_once(name, timeout)
            return False
        if script is not None:
            (command,) = shell_pdrouter_commands(script)
            assert script.lstrip().startswith("exec pdrouter "), f"{name}: pdrouter must be the container's process"
            argv = ["pdrouter", *(self._expand(token) for token in command)]
        assert argv[0] == "pdrouter", f"{name}: runs {argv[0]!r}, not pdrouter"
        self.procs[name] = ManagedProcess(name, self.localize_argv(name, argv[1:]), env=self.env(name))
        return True

    @staticmethod
    def _expand(token: str) -> str:
        """A script's word with the variables a container has (``$HOSTNAME``) expanded for this host."""
        return re.sub(r"\$(?:\{HOSTNAME\}|HOSTNAME\b)", LOOPBACK, token)

    def _require_redis_password(self) -> None:
        """Give the embedded Redis the password the redis service reads from its file, if it does, and
        its users (``user NAME on >$(cat FILE) RULES``; on a Redis older than 7, read-only key
        patterns ``%R~`` become plain ones, which it lacks)."""
        script = shell_script(compose_argv(self.services[self.redis_service])) or ""
        m = re.search(r"requirepass \$\(cat (\S+)\)", script)
        if m is None:
            return
        client = redis_py.Redis(host=self.redis.host, port=self.redis.port)
        old = redis_version(self.redis.binary) < (7, 0)
        for user, file, rules in re.findall(r"\nuser (\S+) on >\$\(cat (\S+)\) ([^\n]*)", script):
            secret = Path(self.localize_text(self.redis_service, file)).read_text().strip()
            words = [w.replace("%R~", "~") if old else w for w in rules.split()]
            client.execute_command("ACL", "SETUSER", user, "on", f">{secret}", *words)
        path = Path(self.localize_text(self.redis_service, m.group(1)))
        client.config_set("requirepass", path.read_text().strip())

    def run_once(self, name: str, timeout: float = 120.0) -> subprocess.CompletedProcess[str]:
        """Run a one-shot ``sh -c`` service (the secrets and model steps); AssertionError unless it exits 0."""
        argv = compose_argv(self.services[name])
        script = shell_script(argv)
        assert script is not None, f"{name} is not a shell one-shot"
        env = {**os.environ, **self.env(name), "PATH": f"{self._pdrouter_shim()}{os.pathsep}{os.environ['PATH']}"}
        done = subprocess.run([*argv[:2], self.localize_text(name, script)], env=env, capture_output=True,
                              text=True, timeout=timeout)
        assert done.returncode == 0, f"{name} exited {done.returncode}:\n{done.stdout}\n{done.stderr}"
        return done

    def _pdrouter_shim(self) -> Path:
        """A folder whose ``pdrouter`` and ``python`` run this interpreter (and its pdrouter), for shell scripts."""
        folder = self.workdir / "bin"
        shim = folder / "pdrouter"
        if not shim.exists():
            folder.mkdir(exist_ok=True)
            shim.write_text(f'#!/bin/sh\nexec "{sys.executable}" -m pdrouter "$@"\n')
            shim.chmod(0o755)
            python = folder / "python"
            python.write_text(f'#!/bin/sh\nexec "{sys.executable}" "$@"\n')
            python.chmod(0o755)
        return folder

    def healthcheck(self, name: str, argv: Sequence[str] | None = None) -> subprocess.CompletedProcess[str]:
        """Run the service's compose health check (or ``pdrouter-healthcheck ARGV``) against it, here."""
        argv = list(argv) if argv is not None else compose_healthcheck(self.services[name])
        assert argv is not None and argv[0] == HEALTHCHECK_COMMAND, f"{name}: health check {argv!r}"
        local = [sys.executable, str(HEALTHCHECK_SCRIPT), *self.localize_argv(name, argv[1:])]
        return subprocess.run(local, capture_output=True, text=True, timeout=30)

    def wait_healthy(self, name: str, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while True:
            done = self.healthcheck(name)
            if done.returncode == 0:
                return
            proc = self.procs.get(name)
            if (proc is not None and not proc.alive) or time.monotonic() > deadline:
                tail = "\n".join(proc.tail) if proc is not None else ""
                raise AssertionError(f"{name} never became healthy: {done.stderr.strip()}\n{tail}")
            time.sleep(0.2)

    def down(self) -> None:
        for proc in reversed(list(self.procs.values())):
            proc.stop()
        self.procs.clear()
