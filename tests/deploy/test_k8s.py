"""deploy/k8s: manifests rendered by ``kubectl kustomize``, valid against the Kubernetes schemas,
running real pdrouter command lines, referencing what exists, and exposing only the router.

Every layout is checked: ``deploy/k8s`` (CPU), ``deploy/k8s/gpu`` and ``deploy/k8s/gpu`` with its
``hami`` component (memory quotas), each as ``kubectl kustomize`` renders it; every rendered
object is validated against the official OpenAPI schemas of the newest Kubernetes release the
``kubernetes-validate`` package ships (offline, strict). The checks that need rendered objects skip
only when kubectl is not installed.
"""

from __future__ import annotations

import argparse
import copy
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest

from pdrouter.cli.worker_cmd import cuda_index, memory_quota
from pdrouter.core.capacity import resolve_utilization
from pdrouter.core.errors import ConfigError
from pdrouter.core.gpu import GiB
from pdrouter.router.frontdoor.auth import collect_api_keys
from pdrouter.state.acl import ROUTER_USER, WORKER_USER, acl_rules
from pdrouter.wire.security import check_token

from .deploy_files import (
    DEPLOY,
    K8S,
    KubectlMissing,
    all_containers,
    compose_argv,
    container_argv,
    dockerfile_instructions,
    env_var_value,
    find_object,
    is_project_image,
    k8s_env_refs,
    k8s_schema_errors,
    kubectl_kustomize,
    kustomization,
    load_compose,
    load_yaml_docs,
    parse_pdrouter,
    pdrouter_commands,
    pod_templates,
)

OVERLAYS: dict[str, tuple[Path, tuple[Path, ...]]] = {
    "cpu": (K8S, ()),
    "gpu": (K8S / "gpu", ()),
    "gpu-hami": (K8S / "gpu", (K8S / "gpu" / "hami",)),
}
"""Layout → (kustomization folder, the components enabled on top of it)."""
GPU_MEMORY_LIMIT = "nvidia.com/gpumem"
SECRET = "pd-router-secrets"
SECRETS_DIR = "/secrets"


def build_overlay(name: str) -> list[dict[str, Any]]:
    """The objects ``kubectl kustomize`` renders for a layout (a copy: tests may change them)."""
    folder, components = OVERLAYS[name]
    try:
        return copy.deepcopy(kubectl_kustomize(folder, components))
    except KubectlMissing as exc:
        pytest.skip(str(exc))


SERVERS = ("prefill", "decode", "worker", "router")


@dataclass(frozen=True)
class Server:
    """A long-running pdrouter container and the pod it runs in."""

    workload: dict[str, Any]
    pod: dict[str, Any]
    container: dict[str, Any]
    argv: list[str]
    args: argparse.Namespace

    @property
    def name(self) -> str:
        return f"{self.workload['metadata']['name']}/{self.container['name']}"

    @property
    def listen_ports(self) -> set[int]:
        names = ("port", "lane_port", "kv_port") if self.args.command != "router" else ("http_port", "grpc_port")
        return {getattr(self.args, n) for n in names if getattr(self.args, n, 0)}

    @property
    def grpc_port(self) -> int:
        return int(self.args.grpc_port if self.args.command == "router" else self.args.port)

    def container_port(self, port: int | str) -> int:
        """A probe's or Service's port (number or name) as a number; AssertionError if undeclared."""
        declared = {p.get("name"): p["containerPort"] for p in self.container.get("ports", [])}
        if isinstance(port, str):
            assert port in declared, f"{self.name}: no container port named {port!r}"
            return int(declared[port])
        assert port in declared.values(), f"{self.name}: port {port} is not a declared container port"
        return port


@pytest.fixture(scope="module", params=sorted(OVERLAYS))
def objects(request: pytest.FixtureRequest) -> list[dict[str, Any]]:
    return build_overlay(request.param)


@pytest.fixture(scope="module")
def servers(objects: list[dict[str, Any]]) -> list[Server]:
    out = []
    for workload, template in pod_templates(objects):
        pod = template["spec"]
        for container in pod["containers"]:
            if not is_project_image(container["image"]):
                continue
            (argv,) = pdrouter_commands(container_argv(container))
            out.append(Server(workload, pod, container, argv, parse_pdrouter(argv)))
    return out


def servers_of(servers: list[Server], *commands: str) -> list[Server]:
    return [s for s in servers if s.args.command in commands]


def test_manifests_parse_and_name_no_namespace() -> None:
    files = sorted(K8S.rglob("*.yaml"))
    assert files
    for path in files:
        docs = load_yaml_docs(path)
        assert docs, f"{path} is empty"
        for doc in docs:
            assert doc.get("apiVersion") and doc.get("kind"), f"{path}: {doc!r:.80}"
            if doc["kind"] in ("Kustomization", "Component"):
                assert "namespace" not in doc, f"{path} pins a namespace"
                continue
            assert doc["metadata"].get("name"), path
            assert "namespace" not in doc["metadata"], f"{path}: {doc['kind']} pins a namespace"


def test_every_manifest_file_belongs_to_its_kustomization() -> None:
    for folder in {p.parent for p in K8S.rglob("kustomization.yaml")}:
        spec = kustomization(folder)
        listed = {*spec.get("resources", []), *spec.get("components", []),
                  *(p["path"] for p in spec.get("patches", []) if "path" in p)}
        local = {p.name for p in folder.glob("*.yaml")} - {"kustomization.yaml"}
        assert local <= listed, f"{folder}: {sorted(local - listed)} are not in kustomization.yaml"
        for entry in listed:
            assert (folder / entry).exists(), f"{folder}: {entry} does not exist"


@pytest.mark.parametrize("overlay", sorted(OVERLAYS))
def test_every_rendered_object_validates_against_the_kubernetes_schemas(overlay: str) -> None:
    objects = build_overlay(overlay)
    kinds = {o["kind"] for o in objects}
    assert {"Deployment", "Service", "ConfigMap", "Secret", "NetworkPolicy", "PodDisruptionBudget"} <= kinds
    errors = [error for obj in objects if (error := k8s_schema_errors(obj)) is not None]
    assert errors == []


def test_the_schema_check_catches_a_misspelt_field() -> None:
    objects = build_overlay("cpu")
    router = find_object(objects, "Deployment", "pd-router")
    assert k8s_schema_errors(router) is None
    container = router["spec"]["template"]["spec"]["containers"][0]
    container["readynessProbe"] = container.pop("readinessProbe")
    error = k8s_schema_errors(router)
    assert error is not None and "readynessProbe" in error, error


def test_every_pdrouter_command_is_a_real_command(objects: list[dict[str, Any]], servers: list[Server]) -> None:
    started: set[str] = set()
    for _, template in pod_templates(objects):
        for container in all_containers(template["spec"]):
            if is_project_image(container["image"]):
                commands = pdrouter_commands(container_argv(container))
                assert commands, f"{container['name']} runs no pdrouter command"
                started.update(parse_pdrouter(argv).command for argv in commands)
    assert started == {"make-model", "prefill", "decode", "router"}
    assert sorted(s.args.command for s in servers) == ["decode", "prefill", "router"]


def test_argument_references_name_defined_env_vars(objects: list[dict[str, Any]]) -> None:
    for _, template in pod_templates(objects):
        for container in all_containers(template["spec"]):
            defined = {var["name"] for var in container.get("env", [])}
            refs = k8s_env_refs(" ".join(container_argv(container)))
            assert set(refs) <= defined, f"{container['name']}: $({sorted(set(refs) - defined)}) undefined"


def field_ref(container: dict[str, Any], name: str) -> str | None:
    for var in container.get("env", []):
        if var["name"] == name:
            return var.get("valueFrom", {}).get("fieldRef", {}).get("fieldPath")
    return None


def test_workers_advertise_their_pod_ip_under_their_pod_name(servers: list[Server]) -> None:
    workers = servers_of(servers, "prefill", "decode", "worker")
    assert workers
    for w in workers:
        assert w.args.host == "0.0.0.0", w.name
        (ip_var,) = k8s_env_refs(w.args.advertise_host)
        assert field_ref(w.container, ip_var) == "status.podIP", w.name
        (id_var,) = k8s_env_refs(w.args.worker_id)
        assert field_ref(w.container, id_var) == "metadata.name", f"{w.name}: worker ids must differ per pod"


def test_decode_kv_port_is_fixed_and_declared(servers: list[Server]) -> None:
    (decode,) = servers_of(servers, "decode")
    assert decode.args.kv_port
    decode.container_port(decode.args.kv_port)
    assert {s.args.kv_backend for s in servers_of(servers, "prefill", "decode")} == {decode.args.kv_backend}


def redis_url(server: Server, objects: list[dict[str, Any]]) -> str | None:
    if "--redis" in server.argv:
        return server.argv[server.argv.index("--redis") + 1]
    return env_var_value(server.container, "PDROUTER_REDIS_URL", objects)


def service_backends(service: dict[str, Any], objects: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The containers of the pods a Service selects."""
    selector = service["spec"]["selector"]
    return [c for _, template in pod_templates(objects)
            if selector.items() <= template["metadata"]["labels"].items() for c in template["spec"]["containers"]]


def target_container_port(port: dict[str, Any], container: dict[str, Any]) -> int | None:
    target = port.get("targetPort", port["port"])
    for declared in container.get("ports", []):
        if target in (declared.get("name"), declared["containerPort"]):
            return int(declared["containerPort"])
    return None


def test_redis_url_reaches_the_redis_container(objects: list[dict[str, Any]], servers: list[Server]) -> None:
    for server in servers:
        url = redis_url(server, objects)
        assert url, f"{server.name} has no Redis URL"
        parts = urlsplit(url)
        service = find_object(objects, "Service", str(parts.hostname))
        (port,) = [p for p in service["spec"]["ports"] if p["port"] == parts.port]
        backends = service_backends(service, objects)
        assert backends, f"Service {parts.hostname} selects no pods"
        for container in backends:
            assert container["image"].split(":")[0] == "redis"
            assert target_container_port(port, container) == 6379


def test_probes_hit_the_ports_the_process_listens_on(servers: list[Server]) -> None:
    for s in servers:
        declared = {p["containerPort"] for p in s.container.get("ports", [])}
        assert declared == s.listen_ports, f"{s.name}: declares {declared}, listens on {s.listen_ports}"
        assert "readinessProbe" in s.container and "livenessProbe" in s.container, s.name
        for kind in ("startupProbe", "readinessProbe", "livenessProbe"):
            probe = s.container.get(kind)
            if probe is None:
                continue
            if "grpc" in probe:
                port = probe["grpc"]["port"]
                assert isinstance(port, int), f"{s.name} {kind}: gRPC probes take a port number"
                assert port == s.grpc_port, f"{s.name} {kind}: gRPC probe on {port}, gRPC serves {s.grpc_port}"
            elif "httpGet" in probe:
                assert s.args.command == "router", f"{s.name}: only the router serves HTTP"
                assert probe["httpGet"]["path"] == "/health"
                assert s.container_port(probe["httpGet"]["port"]) == s.args.http_port
            else:
                raise AssertionError(f"{s.name} {kind}: use a gRPC or HTTP probe, got {probe}")


def test_router_probes_cover_both_front_doors(servers: list[Server]) -> None:
    (router,) = servers_of(servers, "router")
    kinds = {next(iter(k for k in ("grpc", "httpGet") if k in router.container[p]))
             for p in ("readinessProbe", "livenessProbe")}
    assert kinds == {"grpc", "httpGet"}


def test_every_reference_exists(objects: list[dict[str, Any]]) -> None:
    for workload, template in pod_templates(objects):
        pod = template["spec"]
        volumes = {v["name"]: v for v in pod.get("volumes", [])}
        for volume in volumes.values():
            if "configMap" in volume:
                find_object(objects, "ConfigMap", volume["configMap"]["name"])
            if "secret" in volume:
                find_object(objects, "Secret", volume["secret"]["secretName"])
            if "persistentVolumeClaim" in volume:
                find_object(objects, "PersistentVolumeClaim", volume["persistentVolumeClaim"]["claimName"])
        for container in all_containers(pod):
            for mount in container.get("volumeMounts", []):
                assert mount["name"] in volumes, f"{workload['metadata']['name']}: no volume {mount['name']}"
            for var in container.get("env", []):
                if "valueFrom" in var and "fieldRef" not in var["valueFrom"]:
                    assert env_var_value(container, var["name"], objects), f"{var['name']} resolves to nothing"
            for source in container.get("envFrom", []):
                for key, kind in (("configMapRef", "ConfigMap"), ("secretRef", "Secret")):
                    if key in source:
                        find_object(objects, kind, source[key]["name"])


def test_every_container_requests_resources_and_has_a_memory_limit(objects: list[dict[str, Any]]) -> None:
    for workload, template in pod_templates(objects):
        for container in all_containers(template["spec"]):
            resources = container.get("resources", {})
            where = f"{workload['metadata']['name']}/{container['name']}"
            assert {"cpu", "memory"} <= set(resources.get("requests", {})), where
            assert "memory" in resources.get("limits", {}), where


def test_selectors_match_their_pods(objects: list[dict[str, Any]]) -> None:
    for workload, template in pod_templates(objects):
        selector = workload["spec"]["selector"]["matchLabels"]
        assert selector.items() <= template["metadata"]["labels"].items(), workload["metadata"]["name"]
    for service in (o for o in objects if o["kind"] == "Service"):
        backends = service_backends(service, objects)
        assert backends, f"Service {service['metadata']['name']} selects no pods"
        for port in service["spec"]["ports"]:
            assert any(target_container_port(port, c) for c in backends), (service["metadata"]["name"], port)


def test_router_service_exposes_both_front_doors(objects: list[dict[str, Any]], servers: list[Server]) -> None:
    (router,) = servers_of(servers, "router")
    service = find_object(objects, "Service", "pd-router")
    ports = {target_container_port(p, router.container) for p in service["spec"]["ports"]}
    assert ports == {router.args.http_port, router.args.grpc_port}


def test_decode_has_a_disruption_budget(objects: list[dict[str, Any]], servers: list[Server]) -> None:
    (decode,) = servers_of(servers, "decode")
    budgets = [o for o in objects if o["kind"] == "PodDisruptionBudget"]
    labels = decode.workload["spec"]["template"]["metadata"]["labels"]
    assert any(b["spec"]["selector"]["matchLabels"].items() <= labels.items() for b in budgets)


def secret_file(container: dict[str, Any], pod: dict[str, Any], variable: str) -> tuple[str, str] | None:
    """(Secret name, key) of the file a ``*_FILE`` variable of ``container`` names; None when unset.

    AssertionError unless the file is on a read-only mount of a Secret volume that holds that key.
    """
    path = next((v.get("value") for v in container.get("env", []) if v["name"] == variable), None)
    if path is None:
        return None
    assert not any(v["name"] == variable.removesuffix("_FILE") for v in container.get("env", [])), \
        f"{container['name']}: both {variable} and its plain form"
    volumes = {v["name"]: v for v in pod.get("volumes", [])}
    for mount in container.get("volumeMounts", []):
        prefix = mount["mountPath"].rstrip("/") + "/"
        if not path.startswith(prefix) or "secret" not in volumes[mount["name"]]:
            continue
        assert mount.get("readOnly") is True, f"{container['name']}: {mount['mountPath']} must be read-only"
        source = volumes[mount["name"]]["secret"]
        relative = path[len(prefix):]
        keys = {item["path"]: item["key"] for item in source.get("items", [])}
        assert relative in keys, f"{container['name']}: {variable}={path}, but the mount has only {sorted(keys)}"
        return source["secretName"], keys[relative]
    raise AssertionError(f"{container['name']}: {variable}={path} is on no Secret volume")


def test_every_component_reads_its_secrets_from_files_of_one_secret(
        objects: list[dict[str, Any]], servers: list[Server]) -> None:
    secret = find_object(objects, "Secret", SECRET)
    keys = set(secret.get("stringData", {})) | set(secret.get("data", {}))
    assert keys == {"kv-token", "internal-token", "redis-password", "redis-router-password", "redis-worker-password",
                    "api-keys"}
    expected = {"prefill": {"PDROUTER_KV_TOKEN_FILE", "PDROUTER_INTERNAL_TOKEN_FILE", "PDROUTER_REDIS_PASSWORD_FILE"},
                "decode": {"PDROUTER_KV_TOKEN_FILE", "PDROUTER_INTERNAL_TOKEN_FILE", "PDROUTER_REDIS_PASSWORD_FILE"},
                "router": {"PDROUTER_INTERNAL_TOKEN_FILE", "PDROUTER_REDIS_PASSWORD_FILE"}}
    read: dict[str, set[tuple[str, str]]] = {}
    for s in servers:
        variables = {v["name"] for v in s.container.get("env", []) if v["name"].startswith("PDROUTER_")
                     and v["name"].endswith(("_TOKEN", "_PASSWORD", "_KEYS", "_TOKEN_FILE", "_PASSWORD_FILE"))}
        assert variables == expected[s.args.command], f"{s.name}: {sorted(variables)}"
        for variable in variables:
            source = secret_file(s.container, s.pod, variable)
            assert source is not None and source[0] == SECRET, f"{s.name}: {variable}"
            read.setdefault(variable, set()).add(source)
        # Only the secrets it needs are on its mount.
        mounted = {item["key"] for v in s.pod["volumes"] if "secret" in v for item in v["secret"]["items"]}
        needed = {src[1] for var in variables if (src := secret_file(s.container, s.pod, var))}
        if s.args.command == "router":
            needed.add("api-keys")
        assert mounted == needed, f"{s.name}: mounts {sorted(mounted)}, needs {sorted(needed)}"
        # Redis: its component's user, with that user's password.
        user = ROUTER_USER if s.args.command == "router" else WORKER_USER
        assert urlsplit(redis_url(s, objects)).username == user, s.name
        assert secret_file(s.container, s.pod, "PDROUTER_REDIS_PASSWORD_FILE") == (
            SECRET, f"redis-{user.removeprefix('pdrouter-')}-password"), s.name
    read.pop("PDROUTER_REDIS_PASSWORD_FILE")  # one per Redis user
    assert {v: len(sources) for v, sources in read.items()} == dict.fromkeys(read, 1), read


def test_the_router_asks_for_the_api_keys_of_the_secret(servers: list[Server]) -> None:
    (router,) = servers_of(servers, "router")
    (key_file,) = router.args.api_key_file
    volumes = {v["name"]: v for v in router.pod["volumes"]}
    (mount,) = [m for m in router.container["volumeMounts"] if str(key_file).startswith(m["mountPath"] + "/")]
    items = {i["path"]: i["key"] for i in volumes[mount["name"]]["secret"]["items"]}
    assert volumes[mount["name"]]["secret"]["secretName"] == SECRET
    assert items[str(key_file)[len(mount["mountPath"]) + 1:]] == "api-keys"
    assert mount.get("readOnly") is True


def test_redis_requires_the_secret_password(objects: list[dict[str, Any]]) -> None:
    redis = find_object(objects, "Deployment", "pd-redis")
    pod = redis["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    script = " ".join(container_argv(container))
    assert "requirepass $(cat /secrets/redis-password)" in script and "redis-server -" in script
    assert "--protected-mode no" in script and "--bind 0.0.0.0" in script
    for user in (ROUTER_USER, WORKER_USER):  # a user per component, with the rules of pdrouter.state.acl
        secret = f"/secrets/redis-{user.removeprefix('pdrouter-')}-password"
        assert f"user {user} on >$(cat {secret}) {acl_rules(user)}" in script, (user, script)
    (volume,) = [v for v in pod["volumes"] if "secret" in v]
    assert volume["secret"]["secretName"] == SECRET
    assert [i["key"] for i in volume["secret"]["items"]] == ["redis-password", "redis-router-password",
                                                             "redis-worker-password"]
    # Its probe authenticates and wants PONG (redis-cli exits 0 on a NOAUTH error too).
    probe = " ".join(container["readinessProbe"]["exec"]["command"])
    assert "REDISCLI_AUTH" in probe and "grep -q PONG" in probe
    # The file's mode lets the pod's group read it (Secret volumes are root-owned).
    assert volume["secret"]["defaultMode"] & 0o040 and pod["securityContext"]["fsGroup"] == 999


def test_an_unedited_secret_fails_closed(objects: list[dict[str, Any]]) -> None:
    """The placeholders are refused at start: a copy applied as it is never runs with known secrets."""
    data = find_object(objects, "Secret", SECRET)["stringData"]
    for key in ("kv-token", "internal-token"):
        with pytest.raises(ConfigError):
            check_token(data[key])
    with pytest.raises(ConfigError):
        collect_api_keys(env=data["api-keys"])


def test_only_the_router_is_exposed(objects: list[dict[str, Any]]) -> None:
    services = {o["metadata"]["name"]: o for o in objects if o["kind"] == "Service"}
    assert set(services) == {"pd-router", "pd-redis"}
    for name, service in services.items():
        assert service["spec"].get("type", "ClusterIP") == "ClusterIP", f"Service {name} leaves the cluster"
    for workload, template in pod_templates(objects):
        pod = template["spec"]
        assert not pod.get("hostNetwork"), workload["metadata"]["name"]
        for container in all_containers(pod):
            assert not any("hostPort" in p for p in container.get("ports", [])), container["name"]
    policies = {o["metadata"]["name"]: o["spec"] for o in objects if o["kind"] == "NetworkPolicy"}

    def policies_of(labels: dict[str, str]) -> list[dict[str, Any]]:
        out = []
        for spec in policies.values():
            selector = spec["podSelector"]
            if not selector.get("matchLabels", {}).items() <= labels.items():
                continue
            if all((labels.get(r["key"]) in r["values"]) == (r["operator"] == "In")
                   for r in selector.get("matchExpressions", [])):
                out.append(spec)
        return out

    stack = {"app.kubernetes.io/name": "pd-router"}
    for workload, template in pod_templates(objects):
        labels = template["metadata"]["labels"]
        selected = policies_of(labels)
        name = workload["metadata"]["name"]
        assert selected, f"{name}: no NetworkPolicy selects it"
        for spec in selected:
            assert "Ingress" in spec["policyTypes"]
            for rule in spec.get("ingress", []):
                if labels["app.kubernetes.io/component"] == "router":
                    ports = {p["port"] for p in rule["ports"]}
                    assert ports == {"http", "grpc"}, f"{name}: the router admits {ports}"
                    continue
                # Redis and the workers: only from the stack's pods.
                assert rule.get("from"), f"{name}: ingress from anywhere"
                for peer in rule["from"]:
                    assert set(peer) == {"podSelector"}, f"{name}: ingress from {peer}"
                    assert peer["podSelector"]["matchLabels"] == stack, f"{name}: ingress from {peer}"


def image_uid() -> int:
    (user,) = [i for i in dockerfile_instructions(DEPLOY / "Dockerfile") if i.keyword == "USER"]
    return int(user.value.split(":")[0])


def test_project_pods_run_as_the_image_user(objects: list[dict[str, Any]]) -> None:
    for workload, template in pod_templates(objects):
        pod = template["spec"]
        if not any(is_project_image(c["image"]) for c in all_containers(pod)):
            continue
        context = pod["securityContext"]
        assert context["runAsNonRoot"] is True
        assert context["runAsUser"] == context["fsGroup"] == image_uid(), workload["metadata"]["name"]


def make_model_args(argv: list[str]) -> tuple[str, int, str | None]:
    args = parse_pdrouter(argv)
    return args.preset, args.seed, args.dtype


def test_every_pod_prepares_the_same_model_as_compose(objects: list[dict[str, Any]], servers: list[Server]) -> None:
    compose = load_compose()
    (expected,) = [make_model_args(argv) for argv in pdrouter_commands(compose_argv(compose["services"]["model"]))]
    for server in servers:
        (init,) = [c for c in server.pod.get("initContainers", []) if is_project_image(c["image"])]
        (make,) = pdrouter_commands(container_argv(init))
        assert make_model_args(make) == expected, f"{server.name}: other weights than its peers"
        model_dir = str(server.args.model)
        (writes,) = [m for m in init["volumeMounts"] if model_dir.startswith(m["mountPath"] + "/")]
        (reads,) = [m for m in server.container["volumeMounts"] if model_dir.startswith(m["mountPath"] + "/")]
        assert reads["name"] == writes["name"] and reads.get("readOnly") is True, server.name


def test_gpu_overlay_puts_the_workers_on_a_gpu() -> None:
    cpu = build_overlay("cpu")
    gpu = build_overlay("gpu")
    for name in ("pd-prefill", "pd-decode"):
        (c_cpu,) = find_object(cpu, "Deployment", name)["spec"]["template"]["spec"]["containers"]
        (c_gpu,) = find_object(gpu, "Deployment", name)["spec"]["template"]["spec"]["containers"]
        assert parse_pdrouter(container_argv(c_cpu)[1:]).device == "cpu"
        args = parse_pdrouter(container_argv(c_gpu)[1:])
        # The pool comes from the device's memory: 0.9 of it, or quota ÷ memory under a quota.
        assert args.device == "cuda" and args.num_blocks is None and args.utilization is None
        assert c_gpu["image"].split(":")[0] == "pd-router-cuda"
        assert int(c_gpu["resources"]["limits"]["nvidia.com/gpu"]) == 1
        # Apart from the device and the pool sizing, the GPU worker runs the CPU worker's command.
        strip = re.compile(r"--(device|utilization|num-blocks) \S+ ?")
        assert strip.sub("", " ".join(container_argv(c_gpu))) == strip.sub("", " ".join(container_argv(c_cpu)))


def test_the_hami_memory_quota_is_written_once_and_sizes_every_gpu_worker(monkeypatch: pytest.MonkeyPatch) -> None:
    # One place in all the manifests sets the quota...
    setters = [(path.relative_to(K8S), line.strip()) for path in sorted(K8S.rglob("*.yaml"))
               for line in path.read_text().splitlines()
               if "gpumem" in line and not line.strip().startswith("#")]
    assert [str(path) for path, _ in setters] == ["gpu/hami/kustomization.yaml"], setters
    for plain in ("cpu", "gpu"):
        for _, template in pod_templates(build_overlay(plain)):
            for container in all_containers(template["spec"]):
                assert GPU_MEMORY_LIMIT not in container.get("resources", {}).get("limits", {}), plain
    # ...every GPU worker gets it, and no command line writes a utilization or a quota of its own.
    limits = {}
    objects = build_overlay("gpu-hami")
    for name in ("pd-prefill", "pd-decode"):
        (container,) = find_object(objects, "Deployment", name)["spec"]["template"]["spec"]["containers"]
        limits[name] = container["resources"]["limits"][GPU_MEMORY_LIMIT]
        args = parse_pdrouter(container_argv(container)[1:])
        assert args.utilization is None and args.quota_gb is None, name
        # HAMi passes the limit (MiB) to the container as CUDA_DEVICE_MEMORY_LIMIT_<device>=<MiB>m.
        device = cuda_index(args.device)
        monkeypatch.setenv(f"CUDA_DEVICE_MEMORY_LIMIT_{device}", f"{limits[name]}m")
        quota = memory_quota(args, device)
        assert quota is not None and quota.bytes == int(limits[name]) * 1024**2
        assert resolve_utilization(args.utilization, quota.bytes, 80 * GiB, default=0.9,
                                   source=quota.source) == int(limits[name]) / (80 * 1024)
    assert limits == {"pd-prefill": "40960", "pd-decode": "40960"}  # 0.5 of an 80 GiB card
    (router,) = find_object(objects, "Deployment", "pd-router")["spec"]["template"]["spec"]["containers"]
    assert GPU_MEMORY_LIMIT not in router["resources"].get("limits", {})
