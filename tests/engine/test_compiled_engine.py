"""The simulated engine compiled with mypyc (``scripts/compile_engine.py``) behaves as its sources do.

A copy of the package is compiled once; the same workload runs on it and on an uncompiled copy,
the engine's own tests run against it, and a compiled module whose source changed afterwards is
refused at import. Skipped without a C compiler or mypy.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "compile_engine.py"

# A workload with shared prefixes (cache hits), evictions (a small pool), sampled and greedy
# requests, stop tokens, a salted prompt and an abort: every step's outputs and every block event.
WORKLOAD = r"""
import json, random, sys
import pdrouter.engine.batch_engine as batch_engine
from pdrouter.core.gpu import get_gpu_preset
from pdrouter.core.model_spec import get_model_preset
from pdrouter.core.sampling import SamplingParams
from pdrouter.engine.batch_engine import SchedulingConfig
from pdrouter.engine.events import RecordingBlockEventSink
from pdrouter.engine.sim.config import SimEngineConfig
from pdrouter.engine.sim.engine import SimEngine

sink = RecordingBlockEventSink()
engine = SimEngine(SimEngineConfig(spec=get_model_preset("llama-3-8b"), gpu=get_gpu_preset("h100"), time_scale=0.0,
                                   num_blocks=96, scheduling=SchedulingConfig(8, 512, True)), event_sink=sink)
rng = random.Random(7)
prefixes = [[rng.randrange(1, 1000) for _ in range(160)] for _ in range(3)]
log = []
live = set()
for i in range(60):
    prompt = prefixes[i % 3] + [rng.randrange(1, 1000) for _ in range(rng.randrange(1, 70))]
    sampling = SamplingParams(max_tokens=rng.randrange(1, 20), temperature=0.0 if i % 2 else 0.8, seed=i,
                              stop_token_ids=(7, 11), ignore_eos=bool(i % 3))
    engine.add_request(f"r{i}", prompt, sampling, cache_salt=b"s" if i % 7 == 0 else b"")
    live.add(f"r{i}")
    if i % 13 == 5:
        log.append(["abort", f"r{i}", engine.abort(f"r{i}")])
        live.discard(f"r{i}")
    steps = 0
    while len(live) >= 6 or (i == 59 and live):
        steps += 1
        assert steps < 1000, "the engine did not finish its requests"
        for out in engine.step():
            log.append([out.request_id, list(out.new_token_ids), out.finished, str(out.finish_reason),
                        out.num_cached_tokens])
            if out.finished:
                live.discard(out.request_id)
stats = engine.stats()
print(json.dumps({"file": batch_engine.__file__, "outputs": log,
                  "events": [[kind, [h.hex() for h in hashes]] for kind, hashes in sink.events],
                  "free": stats.num_free_blocks}))
"""


def _copy(dest: Path) -> Path:
    dest.mkdir()
    shutil.copytree(ROOT / "pdrouter", dest / "pdrouter",
                    ignore=shutil.ignore_patterns("__pycache__", "*.so", "_compiled.json"))
    shutil.copy(ROOT / "pyproject.toml", dest / "pyproject.toml")
    return dest


def _python(cwd: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONSAFEPATH")}
    return subprocess.run([sys.executable, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=600)


@pytest.fixture(scope="module")
def compiled(tmp_path_factory: pytest.TempPathFactory) -> Path:
    if shutil.which("cc") is None and shutil.which("gcc") is None:
        pytest.skip("no C compiler")
    pytest.importorskip("mypyc")
    root = _copy(tmp_path_factory.mktemp("compiled") / "tree")
    done = _python(root, str(SCRIPT), "--root", str(root))
    assert done.returncode == 0, done.stdout + done.stderr
    assert (root / "pdrouter" / "_compiled.json").is_file()
    return root


def test_the_compiled_engine_gives_every_output_and_block_event_its_sources_give(
        compiled: Path, tmp_path: Path) -> None:
    pure = _copy(tmp_path / "pure")
    runs = {}
    for name, root in (("compiled", compiled), ("pure", pure)):
        done = _python(root, "-c", WORKLOAD)
        assert done.returncode == 0, done.stderr
        runs[name] = json.loads(done.stdout)
    assert runs["compiled"]["file"].endswith(".so") and runs["pure"]["file"].endswith(".py")
    assert len(runs["pure"]["outputs"]) > 100 and any(kind == "removed" for kind, _ in runs["pure"]["events"])
    for key in ("outputs", "events", "free"):
        assert runs["compiled"][key] == runs["pure"][key], key


def test_the_engines_own_tests_pass_against_the_compiled_engine(compiled: Path) -> None:
    shutil.copytree(ROOT / "tests", compiled / "tests", dirs_exist_ok=True,
                    ignore=shutil.ignore_patterns("__pycache__", "test_compiled_engine.py"))
    done = _python(compiled, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-x",
                   "tests/engine/test_block_manager.py", "tests/engine/test_scheduler.py",
                   "tests/engine/test_sim_engine.py", "tests/engine/test_engine_api.py",
                   "tests/engine/test_bad_input.py", "tests/engine/test_request_faults.py",
                   "tests/engine/sim/test_timing.py", "tests/core/test_hashing.py")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    assert " passed" in done.stdout and "failed" not in done.stdout


def test_a_source_changed_after_compiling_is_refused_at_import_and_clean_runs_the_sources(compiled: Path) -> None:
    source = compiled / "pdrouter" / "engine" / "block_manager.py"
    text = source.read_text()
    source.write_text(text + "\n# edited\n")
    try:
        done = _python(compiled, "-c", "import pdrouter")
        assert done.returncode != 0
        message = done.stderr.strip().splitlines()[-1]
        assert "pdrouter/engine/block_manager.py" in message and "scripts/compile_engine.py" in message, message
    finally:
        source.write_text(text)
    assert _python(compiled, "-c", "import pdrouter").returncode == 0
    done = _python(compiled, str(SCRIPT), "--root", str(compiled), "--clean")
    assert done.returncode == 0 and not list((compiled / "pdrouter").rglob("*.so"))
    assert not (compiled / "pdrouter" / "_compiled.json").exists()
    done = _python(compiled, "-c", "import pdrouter.engine.block_manager as m; print(m.__file__)")
    assert done.returncode == 0 and done.stdout.strip().endswith("block_manager.py")
