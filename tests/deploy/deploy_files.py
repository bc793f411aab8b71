"""Readers for the files in ``deploy/``: the Dockerfiles, the compose file, the Kubernetes manifests.

Each reader does only what the checks need, without Docker or a cluster: compose variable
defaults and YAML merge keys (PyYAML), Dockerfile instructions, ``.dockerignore`` matching, and the
``pdrouter`` command lines a container runs (directly or inside a ``sh -c`` script). Kubernetes
manifests are rendered by the real tool, ``kubectl kustomize``, and validated against the official
schemas by ``kubernetes-validate`` (offline).
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import json
import os
import re
import shlex
import shutil
import subprocess
import tempfile
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import yaml

from pdrouter.cli.main import build_parser

REPO = Path(__file__).resolve().parents[2]
DEPLOY = REPO / "deploy"
COMPOSE_FILE = DEPLOY / "docker-compose.yml"
K8S = DEPLOY / "k8s"
DOCKERFILES = (DEPLOY / "Dockerfile", DEPLOY / "Dockerfile.cuda")
HEALTHCHECK_SCRIPT = DEPLOY / "healthcheck.py"
HEALTHCHECK_COMMAND = "pdrouter-healthcheck"
"""The name the Dockerfiles install ``deploy/healthcheck.py`` under."""
IMAGE_ENTRYPOINT = ("pdrouter",)
"""The images' ENTRYPOINT (test_dockerfile checks it): what a container runs without ``entrypoint``."""
PORT_FLAGS = ("--port", "--lane-port", "--kv-port", "--http-port", "--grpc-port")
"""The ``pdrouter`` flags whose value is a port the process listens on."""


# --- pdrouter command lines -------------------------------------------------------------------


def subcommand_parsers() -> dict[str, argparse.ArgumentParser]:
    """``pdrouter``'s subcommand parsers by name, from the real CLI."""
    for action in build_parser()._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    raise AssertionError("pdrouter's parser has no subcommands")


def parse_pdrouter(argv: Sequence[str]) -> argparse.Namespace:
    """The parsed arguments of ``pdrouter ARGV``; AssertionError for an unknown subcommand or flag.

    Flags must be spelled out in full: argparse would accept a unique prefix, the checks do not.
    """
    parsers = subcommand_parsers()
    if not argv or argv[0] not in parsers:
        raise AssertionError(f"`pdrouter {shlex.join(argv)}`: not a pdrouter subcommand (have {sorted(parsers)})")
    known = parsers[argv[0]]._option_string_actions
    for token in argv[1:]:
        flag = token.split("=", 1)[0]
        if flag.startswith("--") and flag not in known:
            raise AssertionError(f"`pdrouter {shlex.join(argv)}`: `pdrouter {argv[0]}` has no flag {flag}")
    try:
        return build_parser().parse_args(list(argv))
    except SystemExit as exc:
        raise AssertionError(f"`pdrouter {shlex.join(argv)}` is rejected by the CLI parser "
                             f"(exit {exc.code}; its message is in the captured stderr)") from None


_SHELL_OPERATORS = {";", "&&", "||", "|", "&"}


def shell_pdrouter_commands(script: str) -> list[list[str]]:
    """The argument lists (after ``pdrouter``) of every ``pdrouter`` command in a shell script."""
    commands: list[list[str]] = []
    for line in script.splitlines():
        lexer = shlex.shlex(line, posix=True, punctuation_chars=True)
        lexer.whitespace_split = True
        lexer.commenters = "#"
        segment: list[str] = []
        for word in [*lexer, ";"]:
            if word not in _SHELL_OPERATORS:
                segment.append(word)
                continue
            if segment[:1] == ["exec"]:
                segment = segment[1:]
            if segment[:1] == ["pdrouter"]:
                commands.append(segment[1:])
            segment = []
    return commands


def shell_script(argv: Sequence[str]) -> str | None:
    """The script of ``sh -c SCRIPT`` (``-ec`` and friends too); None for any other command."""
    if len(argv) >= 3 and Path(argv[0]).name in ("sh", "bash") and argv[1].startswith("-") and "c" in argv[1]:
        return argv[2]
    return None


def pdrouter_commands(argv: Sequence[str]) -> list[list[str]]:
    """The ``pdrouter`` invocations (arguments after ``pdrouter``) a container command runs."""
    if not argv:
        return []
    if argv[0] == "pdrouter":
        return [list(argv[1:])]
    script = shell_script(argv)
    return shell_pdrouter_commands(script) if script is not None else []


def load_healthcheck_module() -> ModuleType:
    """``deploy/healthcheck.py`` as a module (it is a script, not a package)."""
    spec = importlib.util.spec_from_file_location("pdrouter_deploy_healthcheck", HEALTHCHECK_SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# --- Docker Compose ---------------------------------------------------------------------------

_VARIABLE = re.compile(r"\$(?:\$|\{(?P<name>\w+)(?:(?P<op>:?[-?])(?P<arg>[^}]*))?\}|(?P<bare>\w+))")


def compose_variables(text: str) -> list[tuple[str, str | None]]:
    """(name, default or None) of every ``${VAR}`` / ``$VAR`` interpolation in a compose text."""
    found = []
    for m in _VARIABLE.finditer(text):
        if m.group(0) == "$$":
            continue
        name = m.group("name") or m.group("bare")
        default = m.group("arg") if m.group("op") in (":-", "-") else None
        found.append((name, default))
    return found


def interpolate(value: Any) -> Any:
    """``value`` with every compose variable replaced by its default (the environment is ignored)."""
    if isinstance(value, str):
        def sub(m: re.Match[str]) -> str:
            if m.group(0) == "$$":
                return "$"
            if m.group("op") not in (":-", "-"):
                raise AssertionError(f"compose variable {m.group(0)} has no default")
            return m.group("arg")

        return _VARIABLE.sub(sub, value)
    if isinstance(value, dict):
        return {k: interpolate(v) for k, v in value.items()}
    if isinstance(value, list):
        return [interpolate(v) for v in value]
    return value


def load_compose() -> dict[str, Any]:
    """The compose file, YAML merge keys applied and variables at their defaults."""
    return dict(interpolate(yaml.safe_load(COMPOSE_FILE.read_text())))


def _argv(value: str | Sequence[Any]) -> list[str]:
    return shlex.split(value) if isinstance(value, str) else [str(a) for a in value]


def compose_argv(service: dict[str, Any]) -> list[str]:
    """What the service's container runs: its entrypoint (default: the image's) and command."""
    return [*_argv(service.get("entrypoint", IMAGE_ENTRYPOINT)), *_argv(service.get("command", []))]


def compose_env(service: dict[str, Any]) -> dict[str, str]:
    env = service.get("environment") or {}
    if isinstance(env, list):
        env = dict(item.split("=", 1) for item in env)
    return {str(k): str(v) for k, v in env.items()}


@dataclass(frozen=True)
class Mount:
    source: str
    target: str
    read_only: bool


def compose_mounts(service: dict[str, Any]) -> list[Mount]:
    mounts = []
    for entry in service.get("volumes", []):
        if isinstance(entry, dict):
            mounts.append(Mount(entry["source"], entry["target"], bool(entry.get("read_only"))))
            continue
        source, target, *mode = entry.split(":")
        mounts.append(Mount(source, target, "ro" in (mode[0].split(",") if mode else [])))
    return mounts


def compose_healthcheck(service: dict[str, Any]) -> list[str] | None:
    """The exec-form argv of the service's health check (``CMD`` form), None when it has none."""
    test = (service.get("healthcheck") or {}).get("test")
    if test is None:
        return None
    assert isinstance(test, list) and test[0] == "CMD", f"health check {test!r}: use the exec form [CMD, ...]"
    return [str(a) for a in test[1:]]


def published_ports(service: dict[str, Any]) -> dict[int, int]:
    """Container port → default host port of the service's ``ports:``."""
    out = {}
    for entry in service.get("ports", []):
        host, _, container = str(entry).rpartition(":")
        out[int(container)] = int(host.rpartition(":")[2])
    return out


def depends_on(service: dict[str, Any]) -> dict[str, str]:
    """Dependency → condition (the short list form means ``service_started``)."""
    deps = service.get("depends_on") or {}
    if isinstance(deps, list):
        return dict.fromkeys(deps, "service_started")
    return {name: (spec or {}).get("condition", "service_started") for name, spec in deps.items()}


def start_order(services: dict[str, Any], selected: Sequence[str]) -> list[list[str]]:
    """The selected services in waves: each wave depends only on earlier ones. Fails on a cycle."""
    waiting = {name: set(depends_on(services[name])) for name in selected}
    waves: list[list[str]] = []
    done: set[str] = set()
    while waiting:
        ready = sorted(name for name, deps in waiting.items() if deps <= done)
        if not ready:
            raise AssertionError(f"depends_on cycle or unselected dependency among {sorted(waiting)}")
        waves.append(ready)
        done.update(ready)
        for name in ready:
            del waiting[name]
    return waves


def active_services(compose: dict[str, Any], profiles: Sequence[str] = (), unprofiled: bool = True) -> list[str]:
    """Services ``docker compose [--profile P] up`` starts, with the dependencies they pull in.

    ``unprofiled=False`` leaves out the services without a profile, unless something depends on them.
    """
    services = compose["services"]
    chosen = {n for n, s in services.items()
              if (s.get("profiles") and set(s["profiles"]) & set(profiles)) or (unprofiled and not s.get("profiles"))}
    stack = list(chosen)
    while stack:
        for dep in depends_on(services[stack.pop()]):
            if dep not in chosen:
                chosen.add(dep)
                stack.append(dep)
    return sorted(chosen)


# --- Kubernetes -------------------------------------------------------------------------------


def load_yaml_docs(path: Path) -> list[dict[str, Any]]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc is not None]


def kustomization(folder: Path) -> dict[str, Any]:
    return dict(yaml.safe_load((folder / "kustomization.yaml").read_text()))


KUBECTL = shutil.which("kubectl")
NO_KUBECTL = "kubectl is not installed (scripts/test.sh installs it with apt when run as root)"


class KubectlMissing(Exception):
    """``kubectl`` is not on PATH: the checks that need rendered manifests skip."""


@functools.cache
def _rendered(folder: Path, components: tuple[Path, ...]) -> str:
    if KUBECTL is None:
        raise KubectlMissing(NO_KUBECTL)
    with tempfile.TemporaryDirectory(prefix="pdrouter-kustomize-") as tmp:
        target = folder
        if components:  # a kustomization of our own enabling them (kustomize takes relative paths only)
            rel = [os.path.relpath(p, tmp) for p in (folder, *components)]
            (Path(tmp) / "kustomization.yaml").write_text(yaml.safe_dump({
                "apiVersion": "kustomize.config.k8s.io/v1beta1", "kind": "Kustomization",
                "resources": rel[:1], "components": rel[1:]}))
            target = Path(tmp)
        done = subprocess.run([KUBECTL, "kustomize", str(target)], capture_output=True, text=True, timeout=120)
    if done.returncode != 0:
        raise AssertionError(f"kubectl kustomize {folder} failed: {done.stderr.strip()}")
    return done.stdout


def kubectl_kustomize(folder: Path, components: Sequence[Path] = ()) -> list[dict[str, Any]]:
    """The objects ``kubectl kustomize FOLDER`` renders (with ``components`` enabled on top, as if
    listed under ``components:``). KubectlMissing without kubectl."""
    return [doc for doc in yaml.safe_load_all(_rendered(folder.resolve(), tuple(p.resolve() for p in components)))
            if doc]


def k8s_schema_errors(obj: dict[str, Any], version: str | None = None) -> str | None:
    """None when ``obj`` validates against the official OpenAPI schema of Kubernetes ``version``
    (default: the newest release ``kubernetes-validate`` ships, offline), strictly (no unknown
    fields); else the reason."""
    import kubernetes_validate

    try:
        kubernetes_validate.validate(obj, version or kubernetes_validate.latest_version(), strict=True)
    except kubernetes_validate.ValidationError as exc:
        where = "/".join(str(p) for p in exc.path) or "(top level)"
        return f"{obj.get('kind')}/{obj.get('metadata', {}).get('name')}: {where}: {exc.message}"
    except kubernetes_validate.SchemaNotFoundError as exc:
        return f"{obj.get('kind')}/{obj.get('metadata', {}).get('name')}: no schema: {exc}"
    return None


def find_object(objects: Sequence[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    found = [o for o in objects if o["kind"] == kind and o["metadata"]["name"] == name]
    assert len(found) == 1, f"expected one {kind}/{name}, found {len(found)}"
    return found[0]


def pod_templates(objects: Sequence[dict[str, Any]]) -> Iterator[tuple[dict[str, Any], dict[str, Any]]]:
    """(workload object, pod template) of every Deployment, StatefulSet, DaemonSet and Job."""
    for obj in objects:
        if obj["kind"] in ("Deployment", "StatefulSet", "DaemonSet", "Job"):
            yield obj, obj["spec"]["template"]


def all_containers(pod_spec: dict[str, Any]) -> list[dict[str, Any]]:
    return [*pod_spec.get("initContainers", []), *pod_spec.get("containers", [])]


def container_argv(container: dict[str, Any]) -> list[str]:
    """What the container runs: ``command`` (default: the image's ENTRYPOINT) then ``args``."""
    command = container.get("command", list(IMAGE_ENTRYPOINT) if is_project_image(container["image"]) else [])
    return [str(a) for a in [*command, *container.get("args", [])]]


def is_project_image(image: str) -> bool:
    name = image.rsplit("/", 1)[-1].split(":", 1)[0]
    return name in ("pd-router", "pd-router-cuda")


def k8s_env_refs(text: str) -> list[str]:
    """Names of the ``$(VAR)`` references Kubernetes expands in command and args."""
    return re.findall(r"(?<!\$)\$\((\w+)\)", text)


def env_var_value(container: dict[str, Any], name: str, objects: Sequence[dict[str, Any]]) -> str | None:
    """The value of a container env var: literal, or resolved from a ConfigMap/Secret in ``objects``."""
    for var in container.get("env", []):
        if var["name"] != name:
            continue
        if "value" in var:
            return str(var["value"])
        source = var.get("valueFrom", {})
        for ref_key, kind in (("configMapKeyRef", "ConfigMap"), ("secretKeyRef", "Secret")):
            if ref_key in source:
                ref = source[ref_key]
                obj = find_object(objects, kind, ref["name"])
                data = {**obj.get("data", {}), **obj.get("stringData", {})}
                return str(data[ref["key"]])
        return None
    return None


# --- Dockerfile -------------------------------------------------------------------------------


@dataclass(frozen=True)
class Instruction:
    keyword: str
    value: str
    stage: int
    """Index of the build stage (FROM) the instruction belongs to; -1 before the first FROM."""

    def exec_form(self) -> list[str]:
        value = json.loads(self.value)
        assert isinstance(value, list) and all(isinstance(v, str) for v in value), self
        return value


def dockerfile_instructions(path: Path) -> list[Instruction]:
    """Instructions with line continuations joined, comments and parser directives dropped."""
    out: list[Instruction] = []
    stage = -1
    pending = ""
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if not pending and (not line or line.startswith("#")):
            continue
        if pending and line.startswith("#"):
            continue
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        line, pending = pending + line, ""
        keyword, _, value = line.partition(" ")
        keyword = keyword.upper()
        if keyword == "FROM":
            stage += 1
        out.append(Instruction(keyword, " ".join(value.split()), stage))
    return out


def stage_args(instructions: Sequence[Instruction]) -> dict[tuple[int, str], str]:
    """Default of every ``ARG`` by (stage, name); global ARGs (before FROM) use stage -1."""
    args = {}
    for ins in instructions:
        if ins.keyword == "ARG":
            name, _, default = ins.value.partition("=")
            args[(ins.stage, name)] = default.strip('"')
    return args


def expand_args(text: str, stage: int, args: dict[tuple[int, str], str]) -> str:
    def sub(m: re.Match[str]) -> str:
        name = m.group(1) or m.group(2)
        if (stage, name) in args:
            return args[(stage, name)]
        return args.get((-1, name), m.group(0))

    return re.sub(r"\$\{(\w+)\}|\$(\w+)", sub, text)


def dockerignore_patterns(path: Path) -> list[str]:
    lines = [line.strip() for line in path.read_text().splitlines()]
    return [line for line in lines if line and not line.startswith("#")]


def _pattern_regex(pattern: str) -> re.Pattern[str]:
    out = ""
    i = 0
    while i < len(pattern):
        if pattern.startswith("**/", i):
            out += "(?:.*/)?"
            i += 3
        elif pattern.startswith("**", i):
            out += ".*"
            i += 2
        elif pattern[i] == "*":
            out += "[^/]*"
            i += 1
        elif pattern[i] == "?":
            out += "[^/]"
            i += 1
        else:
            out += re.escape(pattern[i])
            i += 1
    return re.compile(out + r"\Z")


def dockerignored(relpath: str, patterns: Sequence[str]) -> bool:
    """Whether Docker leaves ``relpath`` out of the build context (last matching pattern wins;
    a pattern that matches a parent folder matches everything under it)."""
    parts = relpath.strip("/").split("/")
    prefixes = ["/".join(parts[: i + 1]) for i in range(len(parts))]
    ignored = False
    for pattern in patterns:
        negated = pattern.startswith("!")
        regex = _pattern_regex(pattern.lstrip("!").strip("/"))
        if any(regex.match(p) for p in prefixes):
            ignored = not negated
    return ignored


def build_context(dest: Path) -> Path:
    """Copy what .dockerignore lets into the build context, as Docker would send it."""
    patterns = dockerignore_patterns(REPO / ".dockerignore")
    tops = {p.lstrip("!").split("/")[0] for p in patterns if p.startswith("!")}
    for top in sorted(tops):
        src = REPO / top
        for path in [src] if src.is_file() else sorted(src.rglob("*")):
            rel = path.relative_to(REPO).as_posix()
            if path.is_file() and not dockerignored(rel, patterns):
                (dest / rel).parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(path, dest / rel)
    return dest
