"""pd-router: a router for prefill/decode-disaggregated LLM serving.

One import root in layers; a layer imports only the layers below it (``pyproject.toml`` holds the
import-linter contract that CI runs):

* ``core``: vocabulary (geometry, GPU specs, capacity math, block hashing, tokenizers, ids, errors);
  imports no torch, grpc or redis;
* ``state``: Redis-backed shared state (registry, prefix index, KV reservations);
* ``engine``: the torch engine; ``transfer``: KV blocks prefill → decode (TCP, torch.distributed);
* ``wire``: generated stubs, protobuf ⇄ dataclass conversion, gRPC plumbing, the worker lane;
* ``worker``: the worker process and its roles (prefill, decode, colocated);
* ``router``: front doors, placement, admission, the request flow;
* ``cli``: the ``pdrouter`` command and local clusters;
* ``testing``: fakes shared by tests, benchmarks and users (an echo model with fault directives).
"""


def _check_compiled() -> None:
    """Refuse to run modules compiled from sources that have changed since (``scripts/compile_engine.py``).

    A compiled module's extension sits beside its ``.py`` and is imported in its place, so an edit to
    the source would otherwise be silently ignored. Only a checkout with that script's record pays
    for the check (a few files hashed at import)."""
    import hashlib
    import json
    from pathlib import Path

    root = Path(__file__).resolve().parent
    record = root / "_compiled.json"
    if not record.is_file():
        return
    try:
        modules: dict[str, str] = json.loads(record.read_text())["modules"]
        changed = [m for m, sha in modules.items()
                   if hashlib.sha256((root.parent / m).read_bytes()).hexdigest() != sha]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        changed = [f"{record.name} unreadable: {exc}"]
    if changed:
        raise ImportError(
            f"pdrouter: compiled modules no longer match their sources ({', '.join(changed[:3])}"
            f"{' ...' if len(changed) > 3 else ''} changed since they were compiled): run "
            f"`python scripts/compile_engine.py` to compile them again, or with --clean to run the sources")


_check_compiled()
