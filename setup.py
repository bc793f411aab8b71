"""pd-router's build. ``pyproject.toml`` holds everything but the optional compiled build, which is here.

    PDROUTER_MYPYC=router pip wheel --no-build-isolation --no-deps -w dist .

``PDROUTER_MYPYC`` names what a wheel build compiles with mypyc (mypy's compiler of type-annotated
modules; the same code, no rewrite):

* unset, empty or ``none``: nothing; a pure-Python wheel, as ``pip install .`` and ``pip install -e .`` build;
* ``engine``: the simulated engine's modules (``ENGINE_MODULES`` in ``scripts/compile_engine.py``);
* ``router``: those and the router's request path (``ROUTER_MODULES``), as ``compile_engine.py --router``.

The wheel then holds each module's extension beside its source (Python imports the extension) and the
runtime they share, and is tagged for this platform and Python. The images (``deploy/Dockerfile``,
build argument ``MYPYC``) are built this way. The compiling needs mypy and a C compiler with Python's
headers where the build runs, hence ``--no-build-isolation`` (with setuptools and mypy installed
beside pip). An editable install is refused: a checkout compiles in place with
``scripts/compile_engine.py``, which records the sources it compiled so that ``import pdrouter``
refuses extensions older than their sources.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

from setuptools import setup

ROOT = Path(__file__).resolve().parent
CHOICES = ("none", "engine", "router")
BUILDS = {"bdist_wheel", "build", "build_ext", "install"}
"""The commands that compile. pip's other calls of this file (requirements, metadata) build nothing, and
mypyc's type check (most of the time) is not repeated for them."""


def compiled_modules(which: str) -> list[str]:
    """The modules ``which`` compiles, from the lists ``scripts/compile_engine.py`` compiles in place."""
    spec = importlib.util.spec_from_file_location("compile_engine", ROOT / "scripts" / "compile_engine.py")
    if spec is None or spec.loader is None:
        raise SystemExit("PDROUTER_MYPYC: scripts/compile_engine.py (the lists of compiled modules) is missing")
    lists = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(lists)
    modules: tuple[str, ...] = lists.ENGINE_MODULES + (lists.ROUTER_MODULES if which == "router" else ())
    return list(modules)


def drop_stale_extensions() -> None:
    """Remove extensions an earlier build left in setuptools' build folder: a wheel packs the whole folder,
    so a pure wheel built after a compiled one (or a compiled one after the lists changed) would carry them."""
    for path in ROOT.glob("build/lib*/**/*.so"):
        path.unlink()


def ext_modules() -> list[object]:
    which = os.environ.get("PDROUTER_MYPYC", "").strip().lower() or "none"
    if which not in CHOICES:
        raise SystemExit(f"PDROUTER_MYPYC={which!r}: choose one of {', '.join(CHOICES)}")
    if which != "none" and {"editable_wheel", "develop"} & set(sys.argv[1:]):
        raise SystemExit("PDROUTER_MYPYC compiles a wheel (pip install .), not an editable install: compile a "
                         "checkout in place with `python scripts/compile_engine.py --router`")
    if not BUILDS & set(sys.argv[1:]):
        return []
    drop_stale_extensions()
    if which == "none":
        return []
    try:
        from mypyc.build import mypycify
    except ImportError:
        raise SystemExit("PDROUTER_MYPYC needs mypy where the build runs: `pip install mypy setuptools wheel`, then "
                         "build with --no-build-isolation (pip wheel or pip install)") from None
    modules = compiled_modules(which)
    print(f"PDROUTER_MYPYC={which}: compiling {len(modules)} modules with mypyc", flush=True)
    return list(mypycify(modules, group_name="pdrouter._engine", target_dir="build/mypyc-wheel"))


setup(ext_modules=ext_modules())
