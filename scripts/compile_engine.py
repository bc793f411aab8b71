"""Compile the simulated engine's modules (with ``--router``, the router's too) to C extensions with mypyc,
in place, or remove them again.

    python scripts/compile_engine.py [--router] [--clean] [--root DIR]

The engine that a simulated worker steps (its block manager, scheduler, requests, outputs,
``BatchEngine``, the simulated model step and timing model, the block hashes and packed prompts) is
pure Python that runs on every step of every request. Compiled by mypyc (mypy's compiler of
type-annotated modules; the same code, no rewrite), it takes much less CPU a request
(``docs/simulation.md``, "A compiled engine"), so a machine drives more simulated GPUs in a load test.

``--router`` also compiles the router's request path that compiles (``ROUTER_MODULES``: the HTTP
door's handlers and the OpenAI body's parsing, placement, admission, the prefix index, the tokenizer,
the metrics): less router CPU a request (``docs/benchmarks.md``, "The router compiled with mypyc").
The event-loop code stays Python (async generators, the HTTP/1.1 protocol, the lane and the Redis
connection): mypyc does not compile the first, and the others did not run compiled.

Opt-in, for a checkout installed in place (``pip install -e .``, as the README does):

* each module's extension (``.so``) is written beside its ``.py`` and Python imports it in its place,
  with the runtime they share (``pdrouter/_engine__mypyc*.so``);
* ``pdrouter/_compiled.json`` records each compiled source's SHA-256; ``import pdrouter`` refuses to
  run extensions whose sources have changed since (``pdrouter/__init__.py``), naming the command
  that rebuilds them or removes them;
* ``--clean`` removes the extensions, the record and mypyc's build folder: the sources run again.

Needs a C compiler and mypy (the ``dev`` extra has it). This script imports nothing of pd-router, so
it runs whatever state the extensions are in; it reads the same record ``pdrouter/__init__.py`` checks.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

ENGINE_MODULES = (
    "pdrouter/core/hashing.py",
    "pdrouter/core/tokens.py",
    "pdrouter/engine/block_manager.py",
    "pdrouter/engine/request.py",
    "pdrouter/engine/outputs.py",
    "pdrouter/engine/scheduler.py",
    "pdrouter/engine/batch_engine.py",
    "pdrouter/engine/sim/model_step.py",
    "pdrouter/engine/sim/timing.py",
    "pdrouter/engine/sim/engine.py",
)
"""The engine's compiled modules. Each must keep compiling: no async generators, no ``@runtime_checkable``
protocols, no class attribute read from the class, and a class that an uncompiled class subclasses
says so (``@mypyc_attr(allow_interpreted_subclasses=True)``)."""

ROUTER_MODULES = (
    "pdrouter/core/tokenizer.py",
    "pdrouter/state/prefix_index.py",
    "pdrouter/router/metrics.py",
    "pdrouter/router/request.py",
    "pdrouter/router/transfer_stats.py",
    "pdrouter/router/placing.py",
    "pdrouter/router/admission/admission.py",
    "pdrouter/router/admission/credit.py",
    "pdrouter/router/admission/queue.py",
    "pdrouter/router/placement/policy.py",
    "pdrouter/router/placement/least_loaded.py",
    "pdrouter/router/placement/cache_aware.py",
    "pdrouter/router/placement/circuit_breaker.py",
    "pdrouter/router/placement/worker_pool.py",
    "pdrouter/router/frontdoor/openai_schema.py",
    "pdrouter/router/frontdoor/openai_responses.py",
    "pdrouter/router/frontdoor/detokenize.py",
    "pdrouter/router/frontdoor/served_models.py",
    "pdrouter/router/frontdoor/http_api.py",
    "pdrouter/router/frontdoor/http_cycle.py",
)
"""The router's compiled modules (``--router``), on top of the engine's (the block hashes and packed
prompts are the router's too). These stay Python: ``router/dispatch.py`` (its decisions,
``placing.py``, compile), ``router/frontdoor/generation.py`` and ``wire/worker_client.py`` (async generators);
``router/frontdoor/http_server.py`` (it subclasses uvicorn's protocol class and declares
``@runtime_checkable`` protocols; its request cycle, ``http_cycle.py``, compiles); ``wire/lane/client.py``,
``wire/lane/frames.py``, ``wire/convert.py`` and ``state/pipelined.py`` (they compile, and the router's,
the lane's and the state's tests pass compiled, but the router took as much CPU a request with them
compiled as without: their time is asyncio's calls, which compiling does not shorten)."""

GROUP = "pdrouter._engine"
"""The runtime library the compiled modules share, ``GROUP__mypyc``: inside the package, where an
editable install's import finder reaches it."""
RECORD = "pdrouter/_compiled.json"
BUILD_DIR = "build/mypyc"

_SETUP = """
import sys
from mypyc.build import mypycify
from setuptools import setup

setup(name="pdrouter-engine-compiled", ext_modules=mypycify(sys.argv[1:], group_name={group!r}, target_dir={target!r}),
      script_args=["-q", "build_ext", "--inplace", "--build-temp", {temp!r}])
"""


def digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def extensions(root: Path) -> list[Path]:
    """The extension files in ``root``'s package: what a build leaves (one per module, and the shared
    runtime), and what an earlier build of another list left. pd-router ships no extension of its own."""
    return sorted((root / "pdrouter").rglob("*.so"))


def clean(root: Path) -> int:
    removed = extensions(root)
    for path in removed:
        path.unlink()
    (root / RECORD).unlink(missing_ok=True)
    shutil.rmtree(root / BUILD_DIR, ignore_errors=True)
    return len(removed)


def build(root: Path, modules: tuple[str, ...]) -> None:
    missing = [m for m in modules if not (root / m).is_file()]
    if missing:
        raise SystemExit(f"compile_engine.py: {root} is not a pd-router checkout (no {missing[0]})")
    if shutil.which("cc") is None and shutil.which("gcc") is None:
        raise SystemExit("compile_engine.py: needs a C compiler (cc or gcc on the PATH)")
    try:
        import mypyc  # noqa: F401  (only to say what is missing)
    except ImportError:
        raise SystemExit("compile_engine.py: needs mypy (pip install -e '.[dev]')") from None
    clean(root)
    about = "20 s" if len(modules) == len(ENGINE_MODULES) else "2 minutes"
    print(f"compiling {len(modules)} modules with mypyc (about {about})...", flush=True)
    started = time.monotonic()
    setup = _SETUP.format(group=GROUP, target=f"{BUILD_DIR}/c", temp=f"{BUILD_DIR}/temp")
    done = subprocess.run([sys.executable, "-c", setup, *modules], cwd=root, capture_output=True, text=True)
    if done.returncode != 0:
        clean(root)
        errors = [line for line in (done.stdout + done.stderr).splitlines() if "error" in line.lower()]
        raise SystemExit("compile_engine.py: mypyc failed (nothing was left compiled):\n" +
                         "\n".join(errors[:20] or (done.stdout + done.stderr).splitlines()[-20:]))
    record = {"compiler": "mypyc", "modules": {m: digest(root / m) for m in modules}}
    (root / RECORD).write_text(json.dumps(record, indent=1) + "\n")
    built = extensions(root)
    print(f"compiled {len(modules)} modules in {time.monotonic() - started:.0f} s: {len(built)} extensions "
          f"in {root}; `python scripts/compile_engine.py --clean` removes them")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--router", action="store_true",
                        help="also compile the router's request path (ROUTER_MODULES)")
    parser.add_argument("--clean", action="store_true", help="remove the compiled extensions (the sources run again)")
    parser.add_argument("--root", type=Path, default=Path(__file__).resolve().parent.parent,
                        help="the checkout (default: this script's)")
    args = parser.parse_args()
    root = args.root.resolve()
    if args.clean:
        print(f"removed {clean(root)} compiled extensions from {root}")
    else:
        build(root, ENGINE_MODULES + (ROUTER_MODULES if args.router else ()))


if __name__ == "__main__":
    main()
