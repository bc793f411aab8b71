"""deploy/docker-compose.yml: real pdrouter command lines, services that agree with each other,
generated secrets, and a file Compose v1 (``docker-compose``) and v2 (``docker compose``) both take."""

from __future__ import annotations

import argparse
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
import yaml

from pdrouter.state.acl import ROUTER_USER, WORKER_USER, acl_rules

from .deploy_files import (
    COMPOSE_FILE,
    DEPLOY,
    HEALTHCHECK_COMMAND,
    PORT_FLAGS,
    REPO,
    active_services,
    compose_argv,
    compose_env,
    compose_healthcheck,
    compose_mounts,
    compose_variables,
    depends_on,
    dockerfile_instructions,
    load_compose,
    load_healthcheck_module,
    parse_pdrouter,
    pdrouter_commands,
    published_ports,
    shell_script,
    start_order,
)

WORKER_ROLES = ("prefill", "decode", "worker")
KV_ROLES = ("prefill", "decode")
SECRETS_SERVICE = "secrets"
SECRET_FILES = {"PDROUTER_INTERNAL_TOKEN_FILE": "internal-token",
                "PDROUTER_REDIS_PASSWORD_FILE": "redis-{user}-password", "PDROUTER_KV_TOKEN_FILE": "kv-token"}
"""The ``*_FILE`` variables of the pdrouter components and the secret each names (``{user}``: the
component's Redis user, ``router`` or ``worker``)."""
REDIS_USERS = {"router": ROUTER_USER, "prefill": WORKER_USER, "decode": WORKER_USER, "worker": WORKER_USER}
COMPOSE_V1_TOP_LEVEL = {"version", "services", "networks", "volumes", "secrets", "configs"}
"""The top-level keys Compose v1 (1.27+, the Compose Specification) accepts, besides ``x-`` extensions.
``name:``, ``include:`` and the like are v2 only: v1 rejects the whole file."""


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    return load_compose()


@pytest.fixture(scope="module")
def services(compose: dict[str, Any]) -> dict[str, Any]:
    return dict(compose["services"])


@pytest.fixture(scope="module")
def commands(services: dict[str, Any]) -> dict[str, list[argparse.Namespace]]:
    """Every service's pdrouter invocations, parsed by the real CLI (which fails on a bad flag)."""
    return {name: [parse_pdrouter(argv) for argv in pdrouter_commands(compose_argv(svc))]
            for name, svc in services.items() if "build" in svc}


def long_running(commands: dict[str, list[argparse.Namespace]], *subcommands: str) -> dict[str, argparse.Namespace]:
    """Service → its single pdrouter server command, for services running one of ``subcommands``."""
    out = {}
    for name, parsed in commands.items():
        if len(parsed) == 1 and parsed[0].command in subcommands:
            out[name] = parsed[0]
    return out


def listen_ports(args: argparse.Namespace) -> set[int]:
    return {getattr(args, flag[2:].replace("-", "_")) for flag in PORT_FLAGS
            if getattr(args, flag[2:].replace("-", "_"), 0)}


def test_every_variable_has_a_local_default() -> None:
    variables = compose_variables(COMPOSE_FILE.read_text())
    assert variables, "expected the images and the published ports to be configurable"
    assert [name for name, default in variables if not default] == []
    assert ("PDROUTER_REDIS_IMAGE", "redis:7.4-alpine") in variables


def test_no_compose_v2_only_keys() -> None:
    raw = yaml.safe_load(COMPOSE_FILE.read_text())
    extra = {key for key in raw if not key.startswith("x-")} - COMPOSE_V1_TOP_LEVEL
    assert extra == set(), f"top-level keys Compose v1 rejects: {sorted(extra)} (name the project with -p)"
    for name, service in raw["services"].items():
        for key in ("develop", "attach", "post_start", "pre_stop", "provider", "models", "gpus", "use_api_socket"):
            assert key not in service, f"{name}: {key} is Compose v2 only"
        assert "!reset" not in str(service) and "!override" not in str(service), name


def test_documented_commands_work_under_compose_v1() -> None:
    """``up --wait`` is v2 only (v1 prints its usage and exits 0 without starting anything)."""
    docs = {COMPOSE_FILE: COMPOSE_FILE.read_text(), DEPLOY / "README.md": (DEPLOY / "README.md").read_text(),
            REPO / "README.md": (REPO / "README.md").read_text()}
    for path, text in docs.items():
        for line in text.splitlines():
            if re.search(r"docker[ -]compose\b.*\bup\b", line):
                assert "--wait" not in line, f"{path.relative_to(REPO)}: {line.strip()}"
    assert "deploy/compose-wait.sh" in docs[DEPLOY / "README.md"]
    assert (DEPLOY / "compose-wait.sh").stat().st_mode & 0o111, "compose-wait.sh must be executable"


@pytest.mark.skipif(shutil.which("docker-compose") is None, reason="docker-compose (Compose v1) is not installed")
def test_compose_v1_accepts_the_file() -> None:
    done = subprocess.run(["docker-compose", "-p", "pd-router", "-f", str(COMPOSE_FILE), "--profile", "colocated",
                           "config", "-q"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr


def test_every_project_service_runs_a_pdrouter_command(services: dict[str, Any],
                                                       commands: dict[str, list[argparse.Namespace]]) -> None:
    for name, parsed in commands.items():
        if name == SECRETS_SERVICE:
            assert parsed == [], "the secrets step runs no pdrouter command"
            continue
        assert parsed, f"{name} runs no pdrouter command: {compose_argv(services[name])}"
    started = {args.command for parsed in commands.values() for args in parsed}
    assert started == {"make-model", "prefill", "decode", "worker", "router"}


def test_project_services_share_one_image_built_from_the_repo(services: dict[str, Any]) -> None:
    built = {name: svc for name, svc in services.items() if "build" in svc}
    assert len({svc["image"] for svc in built.values()}) == 1
    for name, svc in built.items():
        context = (COMPOSE_FILE.parent / svc["build"]["context"]).resolve()
        assert (context / "pyproject.toml").is_file(), f"{name}: build context {context} is not the repository"
        dockerfile = context / svc["build"]["dockerfile"]
        assert dockerfile == DEPLOY / "Dockerfile"
        entrypoint = [i for i in dockerfile_instructions(dockerfile) if i.keyword == "ENTRYPOINT"][-1]
        assert entrypoint.exec_form() == ["pdrouter"], "compose_argv assumes the image's entrypoint"


def redis_script(services: dict[str, Any]) -> str:
    script = shell_script(compose_argv(services["redis"]))
    assert script is not None, "redis runs a shell script (the password comes from a file)"
    return script


def test_redis_runs_in_any_redis_image_with_auth_and_a_health_check(services: dict[str, Any]) -> None:
    redis = services["redis"]
    assert redis["image"].split(":")[0] in ("redis", "docker.io/library/redis")
    assert "ports" not in redis, "Redis stays on the compose network"
    script = redis_script(services)
    # Debian's redis-server refuses other hosts in protected mode and binds loopback unless told.
    assert "--protected-mode no" in script and "--bind 0.0.0.0" in script
    assert "--save \"\"" in script and "--appendonly no" in script
    # The passwords: from the secrets volume, on stdin (not the command line); a user per component
    # with the rules of pdrouter.state.acl.
    assert re.search(r"exec redis-server - .*<<EOF\nrequirepass \$\(cat /secrets/redis-password\)\n", script), script
    for user in (ROUTER_USER, WORKER_USER):
        secret = f"/secrets/redis-{user.removeprefix('pdrouter-')}-password"
        assert f"\nuser {user} on >$(cat {secret}) {acl_rules(user)}\n" in script, (user, script)
    (mount,) = compose_mounts(redis)
    assert (mount.source, mount.target, mount.read_only) == ("secrets", "/secrets", True)
    assert depends_on(redis) == {SECRETS_SERVICE: "service_completed_successfully"}
    check = compose_healthcheck(redis)
    assert check is not None and check[:2] == ["/bin/sh", "-c"]
    assert check[2] == 'REDISCLI_AUTH="$(cat /secrets/redis-password)" redis-cli ping | grep -q PONG', \
        "redis-cli exits 0 on NOAUTH too: the check must authenticate and want PONG"


def test_every_redis_url_points_at_the_redis_service(commands: dict[str, list[argparse.Namespace]],
                                                     services: dict[str, Any]) -> None:
    servers = long_running(commands, *WORKER_ROLES, "router")
    assert set(servers) == {"prefill", "decode", "worker", "router", "router-colocated"}
    for name, args in servers.items():
        url = args.redis or compose_env(services[name]).get("PDROUTER_REDIS_URL")
        assert url, f"{name} has no Redis URL"
        parts = urlsplit(url)
        assert (parts.scheme, parts.hostname, parts.port) == ("redis", "redis", 6379), f"{name}: {url}"
        assert depends_on(services[name]).get("redis") == "service_healthy"


def test_workers_advertise_their_container_hostname_so_replicas_differ(
        commands: dict[str, list[argparse.Namespace]], services: dict[str, Any]) -> None:
    """``up --scale prefill=2`` works: each replica advertises its own hostname (Docker's DNS
    resolves it on the compose network) and registers under an id made from it."""
    workers = long_running(commands, *WORKER_ROLES)
    assert sorted(args.command for args in workers.values()) == ["decode", "prefill", "worker"]
    for name, args in workers.items():
        script = shell_script(compose_argv(services[name]))
        assert script is not None and script.startswith("exec pdrouter "), f"{name}: pdrouter is the container's pid 1"
        assert args.host == "0.0.0.0", name
        assert args.advertise_host == "$HOSTNAME", f"{name} advertises {args.advertise_host!r}"
        assert args.worker_id == f"{name}-$HOSTNAME", f"{name}: worker id {args.worker_id!r}"
        assert args.port, f"{name}: a fixed gRPC port, so that health checks can find it"
        assert set(map(int, services[name].get("expose", []))) == listen_ports(args), name
        assert "container_name" not in services[name] and "hostname" not in services[name], f"{name} cannot scale"
        for entry in services[name].get("ports", []):
            raise AssertionError(f"{name} publishes {entry}: replicas would fight over the host port")


def test_decode_kv_port_is_fixed_and_exposed(commands: dict[str, list[argparse.Namespace]],
                                             services: dict[str, Any]) -> None:
    (decode,) = [args for args in long_running(commands, "decode").values()]
    assert decode.kv_port, "the KV receiver port must be fixed to be reachable on the compose network"
    assert str(decode.kv_port) in services["decode"]["expose"]
    backends = {args.kv_backend for args in long_running(commands, *KV_ROLES).values()}
    assert len(backends) == 1, f"prefill and decode must use one KV backend, got {backends}"


def test_secrets_are_generated_once_into_a_volume_the_others_mount_read_only(
        services: dict[str, Any], commands: dict[str, list[argparse.Namespace]]) -> None:
    step = services[SECRETS_SERVICE]
    assert step["restart"] == "no"
    script = shell_script(compose_argv(step))
    assert script is not None
    (writable,) = compose_mounts(step)
    assert (writable.source, writable.target, writable.read_only) == ("secrets", "/secrets", False)
    generated = set(re.search(r"for name in ([\w\s-]+); do", script).group(1).split())  # type: ignore[union-attr]
    assert generated == {"internal-token", "kv-token", "redis-password", "redis-router-password",
                         "redis-worker-password", "api-keys"}
    assert "secrets.token_hex(32)" in script and "-s \"$name\"" in script, "random, and kept once written"
    assert re.search(r"> \"\.\$name\.partial\"\n\s*mv \"\.\$name\.partial\" \"\$name\"", script), \
        "written to a temporary name and renamed: never half a secret"
    servers = long_running(commands, *WORKER_ROLES, "router")
    for name in servers:
        mounts = {m.source: m for m in compose_mounts(services[name])}
        assert "secrets" in mounts and mounts["secrets"].read_only, f"{name}: the secrets volume, read-only"
        env = compose_env(services[name])
        wanted = set(SECRET_FILES) - ({"PDROUTER_KV_TOKEN_FILE"} if servers[name].command in ("router", "worker")
                                      else set())
        assert {k for k in env if k.startswith("PDROUTER_")} == wanted, f"{name}: {sorted(env)}"
        user = REDIS_USERS[servers[name].command]
        for variable in wanted:
            secret = SECRET_FILES[variable].format(user=user.removeprefix("pdrouter-"))
            assert env[variable] == f"{mounts['secrets'].target}/{secret}", f"{name}: {variable}"
            assert variable.removesuffix("_FILE") not in env, f"{name}: a secret in the environment"
        assert urlsplit(servers[name].redis).username == user, f"{name}: Redis user of {servers[name].redis}"
        # Started after the secrets exist (through Redis, which needs them too).
        assert "redis" in depends_on(services[name])
    for name, args in long_running(commands, "router").items():
        assert [str(p) for p in args.api_key_file] == ["/secrets/api-keys"], name
    assert not re.search(r"(TOKEN|PASSWORD|KEYS?)\s*:\s*\$\{", COMPOSE_FILE.read_text()), "no secret from variables"


def test_routers_publish_their_front_doors(commands: dict[str, list[argparse.Namespace]],
                                           services: dict[str, Any]) -> None:
    routers = long_running(commands, "router")
    assert {name: args.mode for name, args in routers.items()} == {
        "router": "disaggregated", "router-colocated": "colocated"}
    for name, args in routers.items():
        assert args.host == "0.0.0.0", name
        assert set(published_ports(services[name])) == {args.http_port, args.grpc_port}, name
    assert published_ports(services["router"]) == {8000: 8000, 50051: 50051}
    for name in routers:
        for entry in services[name]["ports"]:
            assert str(entry).startswith("127.0.0.1:"), f"{name}: published on loopback by default, not {entry}"
    host_ports = [p for name in routers for p in published_ports(services[name]).values()]
    assert len(set(host_ports)) == len(host_ports), "two routers publish the same host port"


def test_model_is_prepared_once_into_the_volume_the_others_read(
        commands: dict[str, list[argparse.Namespace]], services: dict[str, Any]) -> None:
    (make,) = commands["model"]
    assert make.command == "make-model"
    assert services["model"]["restart"] == "no"
    (writable,) = compose_mounts(services["model"])
    assert not writable.read_only and Path(make.out).is_relative_to(writable.target)
    for name, args in long_running(commands, *WORKER_ROLES, "router").items():
        (mount,) = [m for m in compose_mounts(services[name]) if m.source == writable.source]
        assert (mount.source, mount.read_only) == (writable.source, True), name
        assert args.model.is_relative_to(mount.target), f"{name} reads {args.model} outside {mount.target}"
        assert args.model.parent == make.out.parent, f"{name} reads {args.model}, the model step writes there"
        assert depends_on(services[name]).get("model") == "service_completed_successfully", name


def test_every_named_volume_is_declared(compose: dict[str, Any], services: dict[str, Any]) -> None:
    used = {m.source for svc in services.values() for m in compose_mounts(svc) if not m.source.startswith((".", "/"))}
    assert used == set(compose.get("volumes") or {})


def test_health_checks_probe_the_ports_the_service_listens_on(
        commands: dict[str, list[argparse.Namespace]], services: dict[str, Any]) -> None:
    parser = load_healthcheck_module().build_parser()
    servers = long_running(commands, *WORKER_ROLES, "router")
    for name, args in servers.items():
        argv = compose_healthcheck(services[name])
        assert argv is not None and argv[0] == HEALTHCHECK_COMMAND, f"{name}: {argv}"
        check = parser.parse_args(argv[1:])
        if args.command == "router":
            assert check.kind == "http", name
            url = urlsplit(check.url)
            assert (url.hostname, url.port, url.path) == ("127.0.0.1", args.http_port, "/health"), name
        else:
            assert check.kind == "grpc", name
            assert check.address == f"127.0.0.1:{args.port}", name


def test_depends_on_targets_exist_and_fit_their_conditions(services: dict[str, Any]) -> None:
    for name, svc in services.items():
        for dep, condition in depends_on(svc).items():
            assert dep in services, f"{name} depends on unknown {dep}"
            if condition == "service_healthy":
                assert compose_healthcheck(services[dep]), f"{name} waits for {dep} to be healthy; it has no check"
            elif condition == "service_completed_successfully":
                assert services[dep].get("restart") == "no", f"{dep} is a one-shot; it must not restart"
            else:
                raise AssertionError(f"{name} -> {dep}: use a condition, not {condition}")
    start_order(services, list(services))


def test_routers_wait_for_their_workers(services: dict[str, Any]) -> None:
    assert {"prefill", "decode"} <= set(depends_on(services["router"]))
    assert "worker" in depends_on(services["router-colocated"])


def test_profiles_split_the_disaggregated_and_colocated_stacks(compose: dict[str, Any]) -> None:
    assert active_services(compose) == ["decode", "model", "prefill", "redis", "router", "secrets"]
    assert active_services(compose, ["colocated"], unprofiled=False) == [
        "model", "redis", "router-colocated", "secrets", "worker"]
