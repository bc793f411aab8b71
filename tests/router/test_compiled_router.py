"""The router compiled with mypyc (``scripts/compile_engine.py --router``) behaves as its sources do.

A copy of the package is compiled once with the router's modules, and the router's own tests run
against it: the HTTP door's parsing and bad input (400s, never a 500 from a compiled module's type
checks), placement, admission, the prefix index, and requests end to end through real worker
processes and Redis. Skipped without a C compiler or mypy.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "compile_engine.py"

TESTS = (
    "tests/router/frontdoor", "tests/router/placement", "tests/router/admission",
    "tests/router/test_input_bounds.py", "tests/router/test_worker_errors.py", "tests/router/test_metrics.py",
    "tests/router/test_admission_integrity.py", "tests/router/test_api_keys.py",
    "tests/state/test_prefix_index.py",
    "tests/e2e/test_router_e2e.py", "tests/e2e/test_prefix_routing.py", "tests/e2e/test_colocated_placement.py",
    "tests/e2e/test_placement_feedback.py", "tests/e2e/test_failing_request.py", "tests/e2e/test_door_hardening.py",
)
"""The router's tests that run against the compiled copy: every test of the modules compiled, and
requests end to end. Not the tests that replace a compiled class's methods at run time (a compiled
class does not allow it), nor the whole suite (its time)."""


def _python(cwd: Path, *args: str, timeout: float = 1200) -> subprocess.CompletedProcess[str]:
    # The copy first on every process's path, the processes the tests start included.
    env = {k: v for k, v in os.environ.items() if k != "PYTHONSAFEPATH"} | {"PYTHONPATH": str(cwd)}
    return subprocess.run([sys.executable, *args], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=timeout)


@pytest.fixture(scope="module")
def compiled(tmp_path_factory: pytest.TempPathFactory) -> Path:
    if shutil.which("cc") is None and shutil.which("gcc") is None:
        pytest.skip("no C compiler")
    pytest.importorskip("mypyc")
    root = tmp_path_factory.mktemp("compiled_router") / "tree"
    root.mkdir()
    ignore = shutil.ignore_patterns("__pycache__", "*.so", "_compiled.json")
    shutil.copytree(ROOT / "pdrouter", root / "pdrouter", ignore=ignore)
    shutil.copytree(ROOT / "tests", root / "tests", ignore=ignore)
    shutil.copy(ROOT / "pyproject.toml", root / "pyproject.toml")
    done = _python(root, str(SCRIPT), "--router", "--root", str(root), timeout=900)
    assert done.returncode == 0, done.stdout + done.stderr
    return root


def test_the_router_modules_are_compiled_in_the_copy(compiled: Path) -> None:
    modules = ("pdrouter.router.placement.cache_aware", "pdrouter.router.frontdoor.http_cycle",
               "pdrouter.router.frontdoor.openai_schema")
    code = f"import importlib; print(*[importlib.import_module(m).__file__ for m in {modules}])"
    done = _python(compiled, "-c", code)
    assert done.returncode == 0, done.stderr
    assert all(path.endswith(".so") and path.startswith(str(compiled)) for path in done.stdout.split()), done.stdout


def test_the_routers_own_tests_pass_against_the_compiled_router(compiled: Path) -> None:
    done = _python(compiled, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-x", *TESTS)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    assert " passed" in done.stdout and "failed" not in done.stdout
