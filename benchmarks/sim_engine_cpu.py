"""The simulated engine's own CPU per request: the part of a simulated worker's cost no worker change removes.

    python benchmarks/sim_engine_cpu.py [--quick] [--json] [--vs REV [--rounds N]]

A simulated GPU (``SimEngine``, Llama-3-8B geometry on an H100, time scale 0) stepped on one thread,
with no worker around it: no event loop, lane, gRPC, Redis or KV transport. Requests are added as a
worker adds them (a packed prompt, 32 at a time) and stepped until they finish; the process's CPU
clock over the measured requests, divided by them. The workload of ``sim_worker_cpu.py`` (8 shared
2,000-token prefixes, a unique 200-token suffix, 16 output tokens), then variations that split it:

* ``engine_cpu_per_request``: that workload;
* ``engine_cpu_per_request_short_prompt``: the same with prompts a tenth as long (200 + 20 tokens);
  the difference, per 16-token block of prompt, is ``engine_cpu_per_prompt_block`` (hashing the
  block, matching it in the prefix cache, taking and freeing its reference);
* ``engine_cpu_per_output_token``: the slope between 2 and 64 output tokens (one request's share of
  a decode step: scheduling, the simulated step, its output).

Set beside ``sim_worker_cpu.py``'s per-request figure, the first is the floor a worker built on this
engine cannot go under.

``--vs REV``: the same figures of commit ``REV``'s engine as well (its ``pdrouter`` exported with
``git archive``), each tree measured in a process of its own, in turn, the order reversed every round
(``--rounds``, default 7), so that the machine's drift hits both: ``<figure>_vs`` is theirs (the
median of the rounds), ``<figure>_ratio`` theirs ÷ this tree's, the median of the rounds' ratios, with
``..._ratio_min`` and ``..._ratio_max``: how many times less CPU the figure costs now.
"""

from __future__ import annotations

import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _report import Report, base_parser
from tracing_overhead import export_tree, tree_environment

from pdrouter.core.gpu import get_gpu_preset
from pdrouter.core.ids import RequestId
from pdrouter.core.model_spec import get_model_preset
from pdrouter.core.sampling import SamplingParams
from pdrouter.core.tokens import PackedPrompt, pack_token_ids
from pdrouter.engine.sim.config import BYTE_TEXT_TOKENS, SimEngineConfig
from pdrouter.engine.sim.engine import SimEngine

PRESET = "llama-3-8b"
GPU = "h100"
PREFIXES = 8
CONCURRENCY = 32
BLOCK = 16
"""The engine's default block size (tokens)."""
TOKEN_RANGE = (32, 127)


def prompts(prefix: int, suffix: int, n: int, seed: int = 0) -> list[PackedPrompt]:
    """``n`` packed prompts: one of the shared prefixes, then a unique suffix (as a worker hands them on)."""
    rng = random.Random(seed)
    low, high = TOKEN_RANGE
    shared = [[rng.randrange(low, high) for _ in range(prefix)] for _ in range(PREFIXES)]
    out = []
    for i in range(n):
        ids = shared[i % PREFIXES] + [rng.randrange(low, high) for _ in range(suffix)]
        out.append(PackedPrompt(pack_token_ids(ids), max(ids)))
    return out


def cpu_per_request(prefix: int, suffix: int, output: int, requests: int, warmup: int) -> float:
    """CPU seconds per request of a fresh engine serving ``requests`` after ``warmup`` others."""
    engine = SimEngine(SimEngineConfig(spec=get_model_preset(PRESET), gpu=get_gpu_preset(GPU), time_scale=0.0,
                                       token_range=BYTE_TEXT_TOKENS))
    sampling = SamplingParams(max_tokens=output, temperature=0.0, ignore_eos=True)
    todo = prompts(prefix, suffix, warmup + requests)

    def serve(start: int, count: int) -> None:
        live = done = 0
        i = start
        while done < count:
            while live < CONCURRENCY and i < start + count:
                engine.add_request(RequestId(f"r{i}"), todo[i], sampling)
                i += 1
                live += 1
            for out in engine.step():
                if out.finished:
                    live -= 1
                    done += 1

    serve(0, warmup)
    started = time.process_time()
    serve(warmup, requests)
    return (time.process_time() - started) / requests


FIGURES = {"engine_cpu_per_request": "us/req", "engine_cpu_per_request_short_prompt": "us/req",
           "engine_cpu_per_prompt_block": "us/block", "engine_cpu_per_output_token": "us/token"}


def figures(requests: int, warmup: int) -> dict[str, float]:
    """This process's engine: the four figures (see the module docstring), in their units."""
    base = cpu_per_request(2000, 200, 16, requests, warmup)
    short = cpu_per_request(200, 20, 16, requests, warmup)
    few = cpu_per_request(2000, 200, 2, requests, warmup)
    many = cpu_per_request(2000, 200, 64, requests, warmup)
    return {"engine_cpu_per_request": base * 1e6, "engine_cpu_per_request_short_prompt": short * 1e6,
            "engine_cpu_per_prompt_block": (base - short) / ((2200 - 220) / BLOCK) * 1e6,
            "engine_cpu_per_output_token": (many - few) / (64 - 2) * 1e6}


def measured_in(env: dict[str, str] | None, quick: bool) -> dict[str, float]:
    """The figures of the engine a child process imports with ``env`` added (None: this tree's)."""
    argv = [sys.executable, str(Path(__file__).resolve()), "--json", *(["--quick"] if quick else [])]
    done = subprocess.run(argv, capture_output=True, text=True, env=None if env is None else {**os.environ, **env})
    if done.returncode != 0:
        raise SystemExit(f"sim_engine_cpu.py exited {done.returncode}: {done.stderr.strip()[-400:]}")
    printed = json.loads(done.stdout)
    return {name: float(printed[name]) for name in FIGURES}


def compare(rev: str, rounds: int, quick: bool, report: Report) -> None:
    """This tree against ``rev``, in turn; medians and the rounds' ratios (theirs ÷ ours) into ``report``."""
    if rounds < 1:
        raise SystemExit(f"--rounds must be >= 1, got {rounds}")
    with tempfile.TemporaryDirectory(prefix="sim-engine-cpu-") as tmp:
        theirs_env = tree_environment(export_tree(rev, Path(tmp) / "vs"))
        ours: list[dict[str, float]] = []
        theirs: list[dict[str, float]] = []
        for r in range(rounds):
            for env in ((None, theirs_env) if r % 2 == 0 else (theirs_env, None)):
                (ours if env is None else theirs).append(measured_in(env, quick))
    report.add("vs", rev, "")
    report.add("rounds", rounds, "rounds")
    for name, unit in FIGURES.items():
        mine = [f[name] for f in ours]
        other = [f[name] for f in theirs]
        ratios = [b / a for a, b in zip(mine, other, strict=True) if a > 0]
        report.add(name, statistics.median(mine), unit)
        report.add(f"{name}_vs", statistics.median(other), unit)
        if ratios:
            report.add(f"{name}_ratio", statistics.median(ratios), "x")
            report.add(f"{name}_ratio_min", min(ratios), "x")
            report.add(f"{name}_ratio_max", max(ratios), "x")


def main() -> None:
    parser = base_parser(__doc__.splitlines()[0])
    parser.add_argument("--vs", default=None, metavar="REV",
                        help="also measure this commit's engine, in turn, and report the ratios")
    parser.add_argument("--rounds", type=int, default=7, help="with --vs: rounds (default: 7)")
    args = parser.parse_args()
    requests, warmup = (300, 64) if args.quick else (1000, 200)
    report = Report()
    report.add("requests", requests, "per figure")
    if args.vs is not None:
        compare(args.vs, args.rounds, args.quick, report)
    else:
        for name, value in figures(requests, warmup).items():
            report.add(name, value, FIGURES[name])
    report.emit(args.json)


if __name__ == "__main__":
    main()
