"""deploy/Dockerfile{,.cuda} and /.dockerignore, read without Docker; the build context builds a wheel."""

from __future__ import annotations

import re
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest

from .deploy_files import (
    DOCKERFILES,
    HEALTHCHECK_COMMAND,
    HEALTHCHECK_SCRIPT,
    PORT_FLAGS,
    REPO,
    Instruction,
    build_context,
    compose_argv,
    dockerfile_instructions,
    dockerignore_patterns,
    dockerignored,
    expand_args,
    load_compose,
    parse_pdrouter,
    pdrouter_commands,
    stage_args,
)

PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())
DOCKERIGNORE = REPO / ".dockerignore"
IDS = [p.name for p in DOCKERFILES]


def final_stage(instructions: list[Instruction]) -> list[Instruction]:
    last = max(i.stage for i in instructions)
    return [i for i in instructions if i.stage == last]


def base_images(path: Path) -> list[str]:
    instructions = dockerfile_instructions(path)
    args = stage_args(instructions)
    return [expand_args(i.value.split()[0], -1, args) for i in instructions if i.keyword == "FROM"]


def package_dirs() -> list[str]:
    """Top-level package folders pyproject.toml installs (its ``packages.find.include`` patterns)."""
    includes = PYPROJECT["tool"]["setuptools"]["packages"]["find"]["include"]
    return sorted({pattern.rstrip("*").rstrip(".") for pattern in includes})


def torch_pin() -> str:
    (pin,) = [d for d in PYPROJECT["project"]["dependencies"] if re.match(r"torch\b", d)]
    return pin.split("==")[1]


def test_cpu_image_is_python_311_slim() -> None:
    assert set(base_images(DOCKERFILES[0])) == {"python:3.11-slim"}


def test_cuda_image_is_built_on_a_cuda_base() -> None:
    assert all(image.startswith("nvidia/cuda:") for image in base_images(DOCKERFILES[1]))


def build_stage(instructions: list[Instruction]) -> list[Instruction]:
    return [i for i in instructions if i.stage == 0]


def pip_runs(instructions: list[Instruction]) -> list[tuple[int, Instruction]]:
    return [(n, i) for n, i in enumerate(instructions) if i.keyword == "RUN" and "pip install" in i.value]


@pytest.mark.parametrize("path", DOCKERFILES, ids=IDS)
def test_torch_is_installed_first_at_the_project_pin_with_or_without_the_pytorch_index(path: Path) -> None:
    instructions = dockerfile_instructions(path)
    args = stage_args(instructions)
    assert args[(0, "TORCH_VERSION")] == torch_pin()
    kind = "cpu" if path.name == "Dockerfile" else "cu"
    assert args[(0, "TORCH_INDEX_URL")].startswith(f"https://download.pytorch.org/whl/{kind}")
    (first, torch_run), *_ = pip_runs(instructions)
    script = torch_run.value
    assert 'if [ -n "${TORCH_INDEX_URL}" ]' in script
    assert 'pip install --index-url "${TORCH_INDEX_URL}" "torch==${TORCH_VERSION}"' in script
    # Without the PyTorch index (a network that does not reach it): from the configured indexes, and
    # for the CPU image the CPU build by its local version, never PyPI's CUDA build.
    without = script.split("else", 1)[1]
    assert ('"torch==${TORCH_VERSION}+cpu"' if kind == "cpu" else '"torch==${TORCH_VERSION}"') in without
    assert "--index-url" not in without
    copies = [k for k, i in enumerate(instructions) if i.keyword == "COPY" and not i.value.startswith("--from")
              and not i.value.startswith("deploy/build-extra")]
    assert copies and first < min(copies), "torch goes in its own layer, before the project's files"
    (copy_src,) = [k for k, i in enumerate(instructions) if i.keyword == "COPY" and i.value.startswith(". ")]
    deps = [k for k, i in pip_runs(instructions) if "/tmp/deps" in i.value]
    assert deps and deps[0] < copy_src, "the dependencies before the sources, which change often"


PIP_ARGS = ("PIP_INDEX_URL", "PIP_EXTRA_INDEX_URL", "PIP_FIND_LINKS", "PIP_TRUSTED_HOST")


@pytest.mark.parametrize("path", DOCKERFILES, ids=IDS)
def test_builds_behind_a_proxy_get_a_package_index_and_a_ca_bundle(path: Path) -> None:
    instructions = dockerfile_instructions(path)
    stage = build_stage(instructions)
    declared = {i.value for i in stage if i.keyword == "ARG"}
    # pip reads these from the environment; declared without a default they stay unset unless given.
    assert set(PIP_ARGS) <= declared, f"{path.name}: ARG {sorted(set(PIP_ARGS) - declared)} missing"
    env = " ".join(i.value for i in stage if i.keyword == "ENV")
    assert "PIP_CERT=/tmp/build-extra/ca-bundle.pem" in env and "PIP_CONFIG_FILE=/tmp/build-extra/pip.conf" in env
    copies = [i for i in instructions if i.keyword == "COPY" and i.value.startswith("deploy/build-extra/")]
    assert [(i.stage, i.value) for i in copies] == [(0, "deploy/build-extra/ /tmp/build-extra/")], \
        "the extra CA certificates and pip.conf are for the build stage only"
    (bundle,) = [i.value for i in stage if i.keyword == "RUN" and "ca-bundle.pem" in i.value]
    assert "/etc/ssl/certs/ca-certificates.crt" in bundle and "*.crt" in bundle, "the base's CAs plus the extra ones"
    # The first pip call comes after the bundle and the config are in place.
    keywords = [(i.keyword, i.value) for i in stage]
    assert keywords.index(("RUN", bundle)) < min(k for k, (kw, v) in enumerate(keywords) if "pip install" in v)
    assert (REPO / "deploy/build-extra/README.md").is_file()


@pytest.mark.parametrize("path", DOCKERFILES, ids=IDS)
def test_no_syntax_directive_so_builds_need_no_registry(path: Path) -> None:
    """``# syntax=docker/dockerfile:1`` makes BuildKit pull a frontend image from a registry first."""
    first = path.read_text().lstrip().splitlines()[0]
    assert not re.match(r"#\s*syntax\s*=", first), f"{path.name}: {first}"


def test_the_base_image_is_a_build_argument() -> None:
    instructions = dockerfile_instructions(DOCKERFILES[0])
    froms = [i.value for i in instructions if i.keyword == "FROM"]
    assert froms == ["${BASE_IMAGE} AS build", "${BASE_IMAGE}"]
    assert stage_args(instructions)[(-1, "BASE_IMAGE")] == "python:3.11-slim"


@pytest.mark.parametrize("path", DOCKERFILES, ids=IDS)
def test_final_stage_runs_pdrouter_as_a_non_root_user(path: Path) -> None:
    stage = final_stage(dockerfile_instructions(path))
    (user,) = [i.value for i in stage if i.keyword == "USER"]
    uid = user.split(":")[0]
    assert uid not in ("root", "0")
    assert any(f"--uid {uid}" in i.value for i in stage if i.keyword == "RUN"), "the user is created"
    keywords = [i.keyword for i in stage]
    assert keywords.index("USER") < keywords.index("ENTRYPOINT")
    (entrypoint,) = [i for i in stage if i.keyword == "ENTRYPOINT"]
    assert entrypoint.exec_form() == ["pdrouter"]
    (cmd,) = [i for i in stage if i.keyword == "CMD"]
    assert cmd.exec_form() == ["--help"]


@pytest.mark.parametrize("path", DOCKERFILES, ids=IDS)
def test_health_check_script_is_installed_on_the_path(path: Path) -> None:
    stage = final_stage(dockerfile_instructions(path))
    copies = [i.value.split() for i in stage if i.keyword == "COPY" and not i.value.startswith("--")]
    target = f"/usr/local/bin/{HEALTHCHECK_COMMAND}"
    assert [str(HEALTHCHECK_SCRIPT.relative_to(REPO)), target] in copies
    assert any(f"chmod 0755 {target}" in i.value for i in stage if i.keyword == "RUN")
    assert HEALTHCHECK_SCRIPT.read_text().startswith("#!/usr/bin/env python3\n")


@pytest.mark.parametrize("path", DOCKERFILES, ids=IDS)
def test_copy_sources_are_in_the_build_context(path: Path) -> None:
    patterns = dockerignore_patterns(DOCKERIGNORE)
    for ins in dockerfile_instructions(path):
        if ins.keyword != "COPY" or ins.value.startswith("--from"):
            continue
        *sources, _ = ins.value.split()
        for source in sources:
            assert (REPO / source).exists(), f"{path.name}: COPY {source}: no such file"
            if source != ".":
                assert not dockerignored(source, patterns), f"{path.name}: COPY {source} is excluded by .dockerignore"


@pytest.mark.parametrize("path", DOCKERFILES, ids=IDS)
def test_image_exposes_the_ports_the_services_listen_on(path: Path) -> None:
    (expose,) = [i for i in final_stage(dockerfile_instructions(path)) if i.keyword == "EXPOSE"]
    exposed = {int(p) for p in expose.value.split()}
    listened: set[int] = set()
    for service in load_compose()["services"].values():
        if "build" in service:
            for argv in pdrouter_commands(compose_argv(service)):
                args = parse_pdrouter(argv)
                listened |= {getattr(args, f[2:].replace("-", "_"), 0) for f in PORT_FLAGS} - {0, None}
    assert listened and listened <= exposed, f"listened {sorted(listened)}, exposed {sorted(exposed)}"


def test_dockerignore_keeps_the_installable_project_and_nothing_else() -> None:
    patterns = dockerignore_patterns(DOCKERIGNORE)
    kept = ["pyproject.toml", PYPROJECT["project"]["readme"], str(HEALTHCHECK_SCRIPT.relative_to(REPO)),
            "deploy/build-extra/README.md", "deploy/build-extra/corp-proxy.crt"]
    for package in package_dirs():
        files = [p.relative_to(REPO).as_posix() for p in (REPO / package).rglob("*.py")]
        assert files, f"no package folder {package}"
        kept += files
    assert [f for f in kept if dockerignored(f, patterns)] == []
    dropped = [".venv/bin/python", ".git/HEAD", "tests/conftest.py", "models/tiny/config.json",
               "pd_router.egg-info/PKG-INFO", "router/__pycache__/server.cpython-311.pyc", "deploy/Dockerfile",
               "benchmarks/hash_bench.py", ".pdrouter/models/tiny/config.json", "deploy/docker-compose.yml",
               "deploy/k8s/base/secret.yaml"]
    assert [f for f in dropped if not dockerignored(f, patterns)] == []


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The wheel pip builds from the image's build context (what .dockerignore lets through)."""
    tmp_path = tmp_path_factory.mktemp("wheel")
    context = build_context(tmp_path / "context")
    built = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
                            "--no-index", "-q", "-w", str(tmp_path / "dist"), str(context)],
                           capture_output=True, text=True, timeout=300)
    assert built.returncode == 0, built.stdout + built.stderr
    (path,) = (tmp_path / "dist").glob("pd_router-*.whl")
    return path


@pytest.mark.slow
def test_the_wheel_installs_exactly_one_top_level_package(wheel: Path) -> None:
    with zipfile.ZipFile(wheel) as archive:
        names = archive.namelist()
        top_level = next(n for n in names if n.endswith(".dist-info/top_level.txt"))
        assert archive.read(top_level).decode().split() == ["pdrouter"]
    installed = {n.split("/")[0] for n in names if not n.split("/")[0].endswith(".dist-info")}
    assert installed == {"pdrouter"}


@pytest.mark.slow
def test_build_context_builds_a_wheel_with_every_package(wheel: Path) -> None:
    names = set(zipfile.ZipFile(wheel).namelist())
    for package in package_dirs():
        expected = {p.relative_to(REPO).as_posix() for p in (REPO / package).rglob("*.py")
                    if "__pycache__" not in p.parts}
        assert expected <= names, f"{package}: {sorted(expected - names)[:5]} missing from the wheel"
    assert "pdrouter/wire/v1/router_pb2_grpc.py" in names
    entry_points = next(n for n in names if n.endswith("entry_points.txt"))
    assert "pdrouter = pdrouter.cli:main" in zipfile.ZipFile(wheel).read(entry_points).decode()
