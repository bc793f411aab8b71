"""Readers for the files in ``deploy/``: the Dockerfiles, the compose file, the Kubernetes manifests.

Each reader does only what the checks need, without Docker or a cluster: compose variable
defaults, YAML merge keys (PyYAML), kustomize resources and strategic-merge patches for the
shapes the manifests use, Dockerfile instructions, ``.dockerignore`` matching, and the
``pdrouter`` command lines a container runs (directly or inside a ``sh -c`` script).
"""

from __future__ import annotations

import argparse
import copy
import importlib.util
import json
import re
import shlex
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


def build_kustomization(folder: Path, components: Sequence[Path] = ()) -> list[dict[str, Any]]:
    """The objects of a kustomization: its resources (files and folders), its components, then its patches.

    ``components`` are applied after the folder's own (as if listed under ``components:``). A
    component contributes its resources and patches the same way. Patches are strategic merges
    as kustomize applies them to these manifests (maps merge, lists of named items such as
    containers, env, ports and volumes merge by name, other lists are replaced), or inline JSON
    patches (RFC 6902: add, replace, remove) on every object their ``target`` selects (kind, name,
    label selector). Labels and image transforms are not applied (the checks compare manifests as
    written).
    """
    spec = kustomization(folder)
    objects = _resources(folder, spec)
    for component in [*(folder / c for c in spec.get("components", [])), *components]:
        component_spec = kustomization(component)
        objects = _patch(component, component_spec, [*objects, *_resources(component, component_spec)])
    return _patch(folder, spec, objects)


def _resources(folder: Path, spec: dict[str, Any]) -> list[dict[str, Any]]:
    objects: list[dict[str, Any]] = []
    for resource in spec.get("resources", []):
        path = (folder / resource).resolve()
        objects += build_kustomization(path) if path.is_dir() else load_yaml_docs(path)
    return objects


def _patch(folder: Path, spec: dict[str, Any], objects: list[dict[str, Any]]) -> list[dict[str, Any]]:
    objects = list(objects)
    for patch in spec.get("patches", []):
        docs = load_yaml_docs(folder / patch["path"]) if "path" in patch else [yaml.safe_load(patch["patch"])]
        for doc in docs:
            if isinstance(doc, list):  # a JSON patch: a list of operations
                targets = [o for o in objects if selects(patch["target"], o)]
                assert targets, f"{folder}: the patch's target {patch['target']} selects nothing"
                for target in targets:
                    objects[objects.index(target)] = json_patch(target, doc)
                continue
            target = find_object(objects, doc["kind"], doc["metadata"]["name"])
            objects[objects.index(target)] = strategic_merge(target, doc)
    return objects


def selects(target: dict[str, Any], obj: dict[str, Any]) -> bool:
    """Whether a patch ``target`` (kind, name, labelSelector with ``k=v``, ``k!=v``, ``k in (a,b)``)
    selects ``obj``."""
    if "kind" in target and obj["kind"] != target["kind"]:
        return False
    if "name" in target and obj["metadata"]["name"] != target["name"]:
        return False
    labels = obj["metadata"].get("labels", {})
    for requirement in re.split(r",(?![^(]*\))", target.get("labelSelector", "")):
        requirement = requirement.strip()
        if not requirement:
            continue
        m = re.fullmatch(r"(\S+)\s+(in|notin)\s+\(([^)]*)\)", requirement)
        if m:
            values = {v.strip() for v in m.group(3).split(",")}
            if (labels.get(m.group(1)) in values) != (m.group(2) == "in"):
                return False
            continue
        m = re.fullmatch(r"([^!=\s]+)\s*(!=|==|=)\s*(\S*)", requirement)
        assert m, f"label selector requirement {requirement!r} is not supported here"
        if (labels.get(m.group(1)) == m.group(3)) != (m.group(2) != "!="):
            return False
    return True


def json_patch(obj: dict[str, Any], operations: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """``obj`` with RFC 6902 ``add`` / ``replace`` / ``remove`` operations applied (a copy)."""
    out = copy.deepcopy(obj)
    for operation in operations:
        *parents, last = [p.replace("~1", "/").replace("~0", "~") for p in operation["path"].split("/")[1:]]
        node: Any = out
        for part in parents:
            node = node[int(part)] if isinstance(node, list) else node[part]
        op = operation["op"]
        assert op in ("add", "replace", "remove"), f"JSON patch op {op!r} is not supported here"
        if isinstance(node, list):
            index = len(node) if last == "-" else int(last)
            if op == "remove":
                del node[index]
            elif op == "add":
                node.insert(index, copy.deepcopy(operation["value"]))
            else:
                node[index] = copy.deepcopy(operation["value"])
        elif op == "remove":
            del node[last]
        else:
            assert op == "add" or last in node, f"JSON patch: replace of a missing {operation['path']}"
            node[last] = copy.deepcopy(operation["value"])
    return out


def strategic_merge(base: Any, patch: Any) -> Any:
    if isinstance(base, dict) and isinstance(patch, dict):
        merged = dict(base)
        for key, value in patch.items():
            merged[key] = strategic_merge(base[key], value) if key in base else copy.deepcopy(value)
        return merged
    named = isinstance(base, list) and isinstance(patch, list) and all(
        isinstance(item, dict) and "name" in item for item in [*base, *patch])
    if named:
        merged_items = [copy.deepcopy(item) for item in base]
        names = [item["name"] for item in merged_items]
        for item in patch:
            if item["name"] in names:
                i = names.index(item["name"])
                merged_items[i] = strategic_merge(merged_items[i], item)
            else:
                merged_items.append(copy.deepcopy(item))
        return merged_items
    return copy.deepcopy(patch)


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
