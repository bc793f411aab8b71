"""Engine benchmark: batched decode throughput and prefill with a cached prefix.

    python benchmarks/engine_bench.py [--quick] [--json] [--preset small] [--threads N] [--device cpu]

Builds a seeded random model of the preset in a temporary folder, then measures

* decode tokens/s at batch 1, 8 and 32 (greedy, 32-token prompts, eos ignored), from the median
  time of one decode step; target: batch 32 >= 8x batch 1;
* the time of one prefill step for a prompt of which 90% (whole blocks) is already in the prefix
  cache, as a fraction of the same prompt length uncached; target <= 0.25.

One figure per line as ``name: value unit`` (targets met: 1 or 0); ``--json`` prints one JSON
object of the same figures. Torch uses every core (2 on the CI machine) unless ``--threads``.
"""

from __future__ import annotations

import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _report import Report, base_parser

from pdrouter.core.ids import RequestId
from pdrouter.core.sampling import SamplingParams
from pdrouter.engine.config import EngineConfig
from pdrouter.engine.model_io import make_model
from pdrouter.engine.torch_engine import TorchEngine

DECODE_TARGET = 8.0
PREFILL_TARGET = 0.25
_counter = iter(range(10**9))


def _rid() -> RequestId:
    return RequestId(f"bench-{next(_counter)}")


def _prompt(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(256) for _ in range(n)]


def decode_tokens_per_s(engine: TorchEngine, batch: int, steps: int, rng: random.Random) -> float:
    """Tokens/s of the decode steps of ``batch`` concurrent requests (median step time)."""
    params = SamplingParams(max_tokens=steps + 4, temperature=0.0, ignore_eos=True)
    ids = [_rid() for _ in range(batch)]
    for rid in ids:
        engine.add_request(rid, _prompt(rng, 32), params)
    engine.step()  # prefill of all prompts (the budget covers them)
    engine.step()  # warm-up decode
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        outs = engine.step()
        times.append(time.perf_counter() - start)
        assert len(outs) == batch, "every request must decode in every step"
    for rid in ids:
        engine.abort(rid)
    return batch / statistics.median(times)


def prefill_ms(engine: TorchEngine, prompt: list[int]) -> tuple[float, int]:
    """Milliseconds from admission to first token of one request, and its cached prompt tokens."""
    rid = _rid()
    engine.add_request(rid, prompt, SamplingParams(max_tokens=1, temperature=0.0))
    start = time.perf_counter()
    outs: list = []
    while not outs:
        outs = engine.step()
    elapsed = (time.perf_counter() - start) * 1e3
    return elapsed, outs[0].num_cached_tokens


def prefill_figures(engine: TorchEngine, length: int, trials: int, rng: random.Random) -> dict[str, float]:
    bs = engine.block_size
    cached_blocks = (length * 9 // 10) // bs
    uncached, cached = [], []
    prefill_ms(engine, _prompt(rng, length))  # warm-up
    for _ in range(trials):
        uncached.append(prefill_ms(engine, _prompt(rng, length))[0])
        prefix = _prompt(rng, cached_blocks * bs)
        prefill_ms(engine, prefix + _prompt(rng, length - len(prefix)))  # fills the cache
        ms, hit = prefill_ms(engine, prefix + _prompt(rng, length - len(prefix)))
        assert hit == len(prefix), f"expected a {len(prefix)}-token prefix hit, got {hit}"
        cached.append(ms)
    return {"prompt_tokens": length, "cached_tokens": cached_blocks * bs,
            "uncached_ms": statistics.median(uncached), "cached_ms": statistics.median(cached)}


def main(argv: list[str] | None = None) -> int:
    parser = base_parser(__doc__ or "")
    parser.add_argument("--preset", default="small")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: all cores)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads or os.cpu_count() or 1)
    rng = random.Random(args.seed)
    steps, length, trials = (16, 640, 3) if args.quick else (96, 1280, 7)
    report = Report()
    report.add("preset", args.preset)
    report.add("torch_threads", torch.get_num_threads(), "threads")
    report.add("load_avg_1m_before", round(os.getloadavg()[0], 2), "(other processes skew the figures)")
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = make_model(args.preset, args.seed, Path(tmp) / args.preset)
        engine = TorchEngine(EngineConfig(model_dir, device=args.device, num_blocks=1024,
                                     max_num_batched_tokens=2048, max_num_seqs=64))
        decode = {b: decode_tokens_per_s(engine, b, steps, rng) for b in (1, 8, 32)}
        prefill = prefill_figures(engine, length, trials, rng)
    for batch, tps in decode.items():
        report.add(f"decode_batch{batch}", tps, "tok/s")
    speedup = decode[32] / decode[1]
    report.add("decode_speedup_32_vs_1", speedup, "x")
    report.add("decode_target", DECODE_TARGET, "x")
    report.add("decode_target_met", int(speedup >= DECODE_TARGET), "bool")
    report.add("prefill_prompt", int(prefill["prompt_tokens"]), "tokens")
    report.add("prefill_cached_prefix", int(prefill["cached_tokens"]), "tokens")
    report.add("prefill_uncached", prefill["uncached_ms"], "ms")
    report.add("prefill_cached90", prefill["cached_ms"], "ms")
    fraction = prefill["cached_ms"] / prefill["uncached_ms"]
    report.add("prefill_cached_fraction", fraction, "of uncached")
    report.add("prefill_target", PREFILL_TARGET, "of uncached")
    report.add("prefill_target_met", int(fraction <= PREFILL_TARGET), "bool")
    report.emit(args.json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
