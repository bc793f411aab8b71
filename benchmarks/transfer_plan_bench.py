"""The KV sender's set-up of one transfer: pairing its blocks and cutting them into frames.

Before a prefill worker writes a request's first KV byte it pairs the prompt's blocks with the
decode worker's (``pair_segments``) and plans the frames (``plan_frames``): pure Python, on the
critical path of every hand-off. Measured for one 2,200-token prompt of Llama-3-8B (138 blocks of
16 tokens, 32 layers, bfloat16: 32 KiB of K or V per block and layer, frames of up to 4 MiB and 256
runs), with the blocks on both sides contiguous (a pool fresh from start) and scattered (a pool
after hours of churn: a run per block), and with the simulated workers' stand-in (1 byte of K or
V per block and layer).

Per case: ``<case>_pair_us`` and ``<case>_plan_us`` (the median of repeated timings, warm),
``<case>_frames``. ``--vs REV``: the same measured in commit ``REV``'s tree (its ``pdrouter``
exported with ``git archive``), in a process of its own, and ``<case>_<step>_vs_us`` and
``<case>_<step>_ratio`` (theirs ÷ this tree's: how many times faster it is now).

    python benchmarks/transfer_plan_bench.py [--quick] [--json] [--vs REV]
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
from collections.abc import Callable
from pathlib import Path
from typing import Any

from _report import Report, base_parser

REPO = Path(__file__).resolve().parent.parent
BLOCKS = 138
LAYERS = 32
HALF_BLOCK_BYTES = 16 * 8 * 128 * 2  # 16 tokens x 8 KV heads x 128 dims x 2 bytes
MAX_FRAME_BYTES = 4 << 20
MAX_RUNS = 256
POOL_BLOCKS = 30_000


def cases() -> dict[str, tuple[list[int], list[int], int]]:
    rng = random.Random(0)
    return {
        "contiguous": (list(range(100, 100 + BLOCKS)), list(range(2_000, 2_000 + BLOCKS)), HALF_BLOCK_BYTES),
        "scattered": (rng.sample(range(POOL_BLOCKS), BLOCKS), rng.sample(range(POOL_BLOCKS), BLOCKS),
                      HALF_BLOCK_BYTES),
        "sim_scattered": (rng.sample(range(POOL_BLOCKS), BLOCKS), rng.sample(range(POOL_BLOCKS), BLOCKS), 1),
    }


def timed(fn: Callable[[], object], repeats: int) -> float:
    """Median seconds of one call, over ``repeats`` timings of a few calls each."""
    fn()
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(5):
            fn()
        samples.append((time.perf_counter() - start) / 5)
    return statistics.median(samples)


def measure(repeats: int) -> dict[str, float]:
    """This process's ``pdrouter``: microseconds per step and frames per case."""
    from pdrouter.transfer.frame_plan import plan_frames
    from pdrouter.transfer.target import pair_segments

    out: dict[str, float] = {}
    for name, (src, dst, half) in cases().items():
        segments = pair_segments(src, dst)

        def pair(s: list[int] = src, d: list[int] = dst) -> object:
            return pair_segments(s, d)

        def plan(s: Any = segments, h: int = half) -> list[Any]:
            return plan_frames(s, range(LAYERS), h, MAX_FRAME_BYTES, MAX_RUNS)

        out[f"{name}_pair_us"] = timed(pair, repeats) * 1e6
        out[f"{name}_plan_us"] = timed(plan, repeats) * 1e6
        out[f"{name}_frames"] = len(plan())
    return out


def measure_in(tree: Path, repeats: int) -> dict[str, float]:
    """``measure`` in a process whose ``pdrouter`` is the one exported to ``tree``."""
    env = {**os.environ, "PYTHONPATH": f"{tree}{os.pathsep}{Path(__file__).resolve().parent}",
           "PYTHONSAFEPATH": "1"}
    code = f"import json, transfer_plan_bench as b; print(json.dumps(b.measure({repeats})))"
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    result: dict[str, float] = json.loads(done.stdout)
    return result


def main() -> None:
    parser = base_parser(__doc__ or "")
    parser.add_argument("--vs", default=None, metavar="REV", help="also measure this commit's tree")
    args = parser.parse_args()
    repeats = 40 if args.quick else 200
    mine = measure(repeats)
    theirs: dict[str, float] | None = None
    if args.vs:
        with tempfile.TemporaryDirectory(prefix="transfer-plan-") as tmp:
            archive = subprocess.run(["git", "-C", str(REPO), "archive", args.vs, "pdrouter"], check=True,
                                     capture_output=True).stdout
            subprocess.run(["tar", "-x", "-C", tmp], input=archive, check=True)
            theirs = measure_in(Path(tmp), repeats)
    report = Report()
    report.add("blocks", BLOCKS, "blocks")
    report.add("layers", LAYERS, "layers")
    for name, value in mine.items():
        unit = "frames" if name.endswith("_frames") else "us"
        report.add(name, value, unit)
        if theirs is not None and name in theirs and unit == "us":
            report.add(name.removesuffix("_us") + "_vs_us", theirs[name], "us")
            report.add(name.removesuffix("_us") + "_ratio", theirs[name] / value, "x")
    report.emit(args.json)


if __name__ == "__main__":
    main()
