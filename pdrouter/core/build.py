"""What this installation of pd-router is: its version, and how many of its modules run compiled."""

from __future__ import annotations

import functools
import importlib.metadata
from pathlib import Path

PACKAGE_ROOT = Path(__file__).resolve().parents[1]


@functools.cache
def version() -> str:
    """The installed distribution's version (``unknown`` for a tree run from ``PYTHONPATH`` alone)."""
    try:
        return importlib.metadata.version("pd-router")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


@functools.cache
def compiled_modules(root: Path = PACKAGE_ROOT) -> int:
    """How many of the package's modules are imported from an extension beside their source: a wheel built
    with ``PDROUTER_MYPYC`` (the images) or a checkout compiled with ``scripts/compile_engine.py``; 0 when
    the sources run. The runtime the extensions share has no source and is not counted."""
    return sum(1 for ext in root.rglob("*.so") if ext.with_name(ext.name.split(".", 1)[0] + ".py").is_file())
