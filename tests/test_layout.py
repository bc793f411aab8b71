"""The package's layering holds: the import-linter contract, no import cycles, protobuf at the edges.

The contract itself lives in ``pyproject.toml`` (``[tool.importlinter]``) and ``lint-imports`` runs
it in the README's test command; these tests also show that it can fail.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import grimp
import pytest

ROOT = Path(__file__).resolve().parents[1]
LINT_IMPORTS = Path(sys.executable).with_name("lint-imports")


def lint_imports(tree: Path) -> subprocess.CompletedProcess[str]:
    """``lint-imports`` over the ``pdrouter`` package found in ``tree`` (with its pyproject.toml)."""
    return subprocess.run([str(LINT_IMPORTS), "--config", str(tree / "pyproject.toml"), "--no-cache"],
                          cwd=tree, env={"PYTHONPATH": str(tree), "PATH": "/usr/bin:/bin"},
                          capture_output=True, text=True, timeout=300)


def planted_copy(tmp_path: Path, module: str, planted: str) -> Path:
    """A copy of the package (and its pyproject.toml) in ``tmp_path`` with ``planted`` imported in ``module``."""
    shutil.copytree(ROOT / "pdrouter", tmp_path / "pdrouter", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    target = tmp_path / "pdrouter" / module
    target.write_text(target.read_text() + f"\n\ndef _planted() -> None:\n    {planted}  # noqa\n")
    return tmp_path


def test_the_import_contract_holds() -> None:
    result = lint_imports(ROOT)
    assert result.returncode == 0, result.stdout + result.stderr
    contracts = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"]
    assert f"{len(contracts)} kept, 0 broken" in result.stdout


@pytest.mark.slow
@pytest.mark.parametrize(("module", "planted", "broken"), [
    ("core/ids.py", "import pdrouter.router.request", "pdrouter.core is not allowed to import pdrouter.router"),
    ("state/keys.py", "import pdrouter.engine.torch_engine", "pdrouter.state is not allowed to import pdrouter.engine"),
    ("wire/convert.py", "from pdrouter.worker import driver", "pdrouter.wire is not allowed to import pdrouter.worker"),
    ("router/request.py", "import torch", "pdrouter.router is not allowed to import torch"),
    ("engine/sim/link.py", "import torch", "pdrouter.engine.sim is not allowed to import torch"),
    ("worker/backend.py", "import vllm.v1", "pdrouter is not allowed to import vllm"),
])
def test_the_contract_fails_on_a_planted_import(tmp_path: Path, module: str, planted: str, broken: str) -> None:
    result = lint_imports(planted_copy(tmp_path, module, planted))
    assert result.returncode != 0
    assert broken in result.stdout, result.stdout


@pytest.mark.slow
@pytest.mark.parametrize(("module", "planted", "broken"), [
    ("router/dispatch.py", "from pdrouter.worker.roles import registry_view",
     "pdrouter.router is not allowed to import pdrouter.worker"),
    ("worker/roles/decode_serve.py", "from pdrouter.router import dispatch",
     "pdrouter.worker is not allowed to import pdrouter.router"),
])
def test_router_and_worker_are_independent(tmp_path: Path, module: str, planted: str, broken: str) -> None:
    """The router importing the worker is allowed by the layers alone: only the independence contract breaks."""
    result = lint_imports(planted_copy(tmp_path, module, planted))
    assert result.returncode != 0
    assert broken in result.stdout, result.stdout
    contracts = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"]
    expected = 1 if module.startswith("router/") else 2  # the worker importing the router is upward too
    assert f"{len(contracts) - expected} kept, {expected} broken" in result.stdout, result.stdout


def _cycles(graph: grimp.ImportGraph, modules: set[str]) -> list[list[str]]:
    """Strongly connected components of more than one module (or a module importing itself)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    counter = 0

    def visit(root: str) -> None:  # iterative Tarjan: the graph is deep enough to matter
        nonlocal counter
        work = [(root, iter(sorted(graph.find_modules_directly_imported_by(root) & modules)))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, edges = work[-1]
            for nxt in edges:
                if nxt not in index:
                    index[nxt] = low[nxt] = counter
                    counter += 1
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(sorted(graph.find_modules_directly_imported_by(nxt) & modules))))
                    break
                if nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    if len(component) > 1 or graph.direct_import_exists(importer=node, imported=node):
                        found.append(sorted(component))

    for module in sorted(modules):
        if module not in index:
            visit(module)
    return found


def test_no_import_cycles_lazy_imports_included() -> None:
    # grimp reads every import statement of a module, those inside functions too.
    graph = grimp.build_graph("pdrouter", cache_dir=None)
    modules = {m for m in graph.modules if m.startswith("pdrouter.")}
    assert len(modules) > 100
    assert _cycles(graph, modules) == []


def test_the_cycle_check_finds_a_cycle() -> None:
    graph = grimp.ImportGraph()
    for module in ("a", "b", "c", "d"):
        graph.add_module(module)
    graph.add_import(importer="a", imported="b")
    graph.add_import(importer="b", imported="c")
    graph.add_import(importer="c", imported="a")
    graph.add_import(importer="c", imported="d")
    assert _cycles(graph, {"a", "b", "c", "d"}) == [["a", "b", "c"]]


def test_protobuf_stops_at_the_modules_the_architecture_doc_names() -> None:
    """Below the wire layer only servicers and the front doors' conversion touch ``*_pb2`` types."""
    doc = (ROOT / "docs" / "architecture.md").read_text()
    section = doc[doc.index("## Where protobuf stops"):]
    section = section[:section.index("\n## ", 1)]
    named = set(re.findall(r"`(pdrouter/[\w/]+\.py)`", section))
    users = {p.relative_to(ROOT).as_posix()
             for folder in ("pdrouter/router", "pdrouter/worker/roles") for p in (ROOT / folder).rglob("*.py")
             if "_pb2" in p.read_text()}
    assert users, "the doors and the roles serve protobuf somewhere"
    assert users <= named, f"protobuf used in modules the architecture doc does not name: {sorted(users - named)}"
    assert all((ROOT / path).exists() for path in named), "the doc names a module that does not exist"
