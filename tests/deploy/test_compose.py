"""deploy/docker-compose.yml: real pdrouter command lines, and services that agree with each other."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest

from .deploy_files import (
    COMPOSE_FILE,
    DEPLOY,
    HEALTHCHECK_COMMAND,
    PORT_FLAGS,
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
    start_order,
)

WORKER_ROLES = ("prefill", "decode", "worker")
KV_ROLES = ("prefill", "decode")


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
    assert variables, "expected PDROUTER_KV_TOKEN and the published ports to be configurable"
    assert [name for name, default in variables if not default] == []


def test_every_project_service_runs_a_pdrouter_command(services: dict[str, Any],
                                                       commands: dict[str, list[argparse.Namespace]]) -> None:
    for name, parsed in commands.items():
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


def test_redis_is_the_official_image_with_a_health_check(services: dict[str, Any]) -> None:
    redis = services["redis"]
    assert redis["image"].split(":")[0] in ("redis", "docker.io/library/redis")
    assert compose_healthcheck(redis) == ["redis-cli", "ping"]
    assert "ports" not in redis, "Redis stays on the compose network"


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


def test_workers_listen_on_all_interfaces_and_advertise_their_service_name(
        commands: dict[str, list[argparse.Namespace]], services: dict[str, Any]) -> None:
    workers = long_running(commands, *WORKER_ROLES)
    assert sorted(args.command for args in workers.values()) == ["decode", "prefill", "worker"]
    for name, args in workers.items():
        assert args.host == "0.0.0.0", name
        assert args.advertise_host == name, f"{name} advertises {args.advertise_host!r}"
        assert args.port, f"{name}: a fixed gRPC port, so that health checks can find it"
        assert set(map(int, services[name].get("expose", []))) == listen_ports(args), name
    ids = [args.worker_id for args in workers.values()]
    assert all(ids) and len(set(ids)) == len(ids), f"worker ids must be set and unique: {ids}"


def test_decode_kv_port_is_fixed_and_exposed(commands: dict[str, list[argparse.Namespace]],
                                             services: dict[str, Any]) -> None:
    (decode,) = [args for args in long_running(commands, "decode").values()]
    assert decode.kv_port, "the KV receiver port must be fixed to be reachable on the compose network"
    assert str(decode.kv_port) in services["decode"]["expose"]
    backends = {args.kv_backend for args in long_running(commands, *KV_ROLES).values()}
    assert len(backends) == 1, f"prefill and decode must use one KV backend, got {backends}"


def test_prefill_and_decode_share_the_kv_token(services: dict[str, Any],
                                               commands: dict[str, list[argparse.Namespace]]) -> None:
    kv_services = long_running(commands, *KV_ROLES)
    tokens = {compose_env(services[name]).get("PDROUTER_KV_TOKEN") for name in kv_services}
    assert len(tokens) == 1 and None not in tokens, tokens
    raw = COMPOSE_FILE.read_text()
    assert ("PDROUTER_KV_TOKEN", tokens.pop()) in compose_variables(raw), "the token comes from the environment"


def test_routers_publish_their_front_doors(commands: dict[str, list[argparse.Namespace]],
                                           services: dict[str, Any]) -> None:
    routers = long_running(commands, "router")
    assert {name: args.mode for name, args in routers.items()} == {
        "router": "disaggregated", "router-colocated": "colocated"}
    for name, args in routers.items():
        assert args.host == "0.0.0.0", name
        assert set(published_ports(services[name])) == {args.http_port, args.grpc_port}, name
    assert published_ports(services["router"]) == {8000: 8000, 50051: 50051}
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
        (mount,) = compose_mounts(services[name])
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
    assert active_services(compose) == ["decode", "model", "prefill", "redis", "router"]
    assert active_services(compose, ["colocated"], unprofiled=False) == ["model", "redis", "router-colocated", "worker"]
