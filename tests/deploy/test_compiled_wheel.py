"""The compiled wheel (``setup.py``, ``PDROUTER_MYPYC``) that the images install: built from the image's build
context, it holds every listed module compiled, and it serves."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path
from types import ModuleType

import pytest

from .deploy_files import REPO, build_context


def module_lists() -> ModuleType:
    spec = importlib.util.spec_from_file_location("compile_engine", REPO / "scripts" / "compile_engine.py")
    assert spec is not None and spec.loader is not None
    lists = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(lists)
    return lists


def pip_wheel(context: Path, out: Path, which: str | None, timeout: float = 600) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "PDROUTER_MYPYC"}
    if which is not None:
        env["PDROUTER_MYPYC"] = which
    return subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index",
                           "-q", "-w", str(out), str(context)],
                          capture_output=True, text=True, timeout=timeout, env=env)


def extension_of(name: str, source: str) -> bool:
    """Whether the wheel member ``name`` is the extension module of ``source`` (``pdrouter/a/b.py``)."""
    stem = source.removesuffix(".py")
    return name.startswith(stem + ".") and name.endswith(".so") and "/" not in name[len(stem):]


@pytest.fixture(scope="module")
def compiled_wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    tmp_path = tmp_path_factory.mktemp("compiled")
    context = build_context(tmp_path / "context")
    built = pip_wheel(context, tmp_path / "dist", "router")
    assert built.returncode == 0, built.stdout[-3000:] + built.stderr[-3000:]
    (path,) = (tmp_path / "dist").glob("pd_router-*.whl")
    return path


@pytest.mark.slow
def test_the_compiled_wheel_holds_every_listed_module_compiled(compiled_wheel: Path) -> None:
    lists = module_lists()
    abi = f"cp{sys.version_info.major}{sys.version_info.minor}"
    assert f"-{abi}-{abi}-" in compiled_wheel.name, f"{compiled_wheel.name}: not tagged for this Python"
    names = zipfile.ZipFile(compiled_wheel).namelist()
    extensions = [n for n in names if n.endswith(".so")]
    for source in lists.ENGINE_MODULES + lists.ROUTER_MODULES:
        assert source in names, f"{source}: the source is missing beside its extension"
        assert any(extension_of(n, source) for n in extensions), f"{source}: not compiled in the wheel"
    assert any(n.startswith("pdrouter/_engine__mypyc.") for n in extensions), "the shared runtime is missing"
    assert len(extensions) == len(lists.ENGINE_MODULES + lists.ROUTER_MODULES) + 1, sorted(extensions)
    assert "pdrouter/_compiled.json" not in names  # a checkout's record, not an installed wheel's


@pytest.mark.slow
def test_the_compiled_wheel_serves_from_its_extensions(compiled_wheel: Path, tmp_path: Path) -> None:
    target = tmp_path / "site"
    installed = subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "--no-index", "-q",
                                "--target", str(target), str(compiled_wheel)], capture_output=True, text=True,
                               timeout=300)
    assert installed.returncode == 0, installed.stdout + installed.stderr
    # The installed wheel, not the checkout, on every process's path (the workers' too).
    env = {**os.environ, "PYTHONPATH": str(target), "PYTHONSAFEPATH": "1"}
    empty = tmp_path / "run"
    empty.mkdir()
    where = subprocess.run([sys.executable, "-c", "import json, pdrouter.router.placing as p, "
                            "pdrouter.engine.scheduler as s, pdrouter.router.dispatch as d; "
                            "from pdrouter.core.build import compiled_modules; "
                            "print(json.dumps([p.__file__, s.__file__, d.__file__, compiled_modules()]))"],
                           capture_output=True, text=True, timeout=60, env=env, cwd=empty)
    assert where.returncode == 0, where.stderr
    placing, scheduler, dispatch, counted = json.loads(where.stdout)
    lists = module_lists()
    assert counted == len(lists.ENGINE_MODULES + lists.ROUTER_MODULES)  # pdrouter_build_info's figure
    assert placing.startswith(str(target)) and placing.endswith(".so"), placing
    assert scheduler.endswith(".so"), scheduler
    assert dispatch.endswith(".py"), dispatch  # the async generators stay Python
    done = subprocess.run([sys.executable, "-m", "pdrouter", "up", "--http-port", "0", "--grpc-port", "0", "--once"],
                          capture_output=True, text=True, timeout=180, env=env, cwd=empty)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    body = json.loads(done.stdout[done.stdout.index("{"):done.stdout.rindex("}") + 1])
    assert 1 <= body["usage"]["completion_tokens"] <= 16


@pytest.mark.slow
def test_a_pure_wheel_carries_no_extension_an_earlier_build_left(tmp_path: Path) -> None:
    context = build_context(tmp_path / "context")
    stale = context / "build" / "lib" / "pdrouter" / "router" / "placing.cpython-311-x86_64-linux-gnu.so"
    stale.parent.mkdir(parents=True)
    stale.write_bytes(b"not an extension")
    built = pip_wheel(context, tmp_path / "dist", None, timeout=300)
    assert built.returncode == 0, built.stdout + built.stderr
    (path,) = (tmp_path / "dist").glob("pd_router-*.whl")
    assert path.name.endswith("-py3-none-any.whl"), path.name
    assert [n for n in zipfile.ZipFile(path).namelist() if n.endswith(".so")] == []


@pytest.mark.parametrize(("which", "command", "expected"), [
    ("fast", "bdist_wheel", "PDROUTER_MYPYC='fast': choose one of none, engine, router"),
    ("router", "editable_wheel", "not an editable install"),
])
def test_setup_refuses_what_it_cannot_build(which: str, command: str, expected: str, tmp_path: Path) -> None:
    context = build_context(tmp_path / "context")
    env = {**os.environ, "PDROUTER_MYPYC": which}
    done = subprocess.run([sys.executable, "setup.py", "-q", command], capture_output=True, text=True, timeout=60,
                          env=env, cwd=context)
    assert done.returncode != 0
    assert expected in done.stderr, done.stderr
    assert "Traceback" not in done.stderr
