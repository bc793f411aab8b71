"""The simulated engine's own CPU per request: the part of a simulated worker's cost no worker change removes.

    python benchmarks/sim_engine_cpu.py [--quick] [--json]

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
"""

from __future__ import annotations

import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _report import Report, base_parser

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


def main() -> None:
    args = base_parser(__doc__.splitlines()[0]).parse_args()
    requests, warmup = (300, 64) if args.quick else (1000, 200)
    report = Report()
    report.add("requests", requests, "per figure")
    base = cpu_per_request(2000, 200, 16, requests, warmup)
    short = cpu_per_request(200, 20, 16, requests, warmup)
    few = cpu_per_request(2000, 200, 2, requests, warmup)
    many = cpu_per_request(2000, 200, 64, requests, warmup)
    report.add("engine_cpu_per_request", base * 1e6, "us/req")
    report.add("engine_cpu_per_request_short_prompt", short * 1e6, "us/req")
    report.add("engine_cpu_per_prompt_block", (base - short) / ((2200 - 220) / BLOCK) * 1e6, "us/block")
    report.add("engine_cpu_per_output_token", (many - few) / (64 - 2) * 1e6, "us/token")
    report.emit(args.json)


if __name__ == "__main__":
    main()
