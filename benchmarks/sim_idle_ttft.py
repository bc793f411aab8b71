"""Where an idle request's TTFT goes on a simulated cluster at time scale 1, against its modeled time.

Brings up ``pdrouter up --backend sim`` (Llama-3-8B on H100s, 1P1D, or ``--colocated``: one colocated
worker) at time scale 1 and sends ``--prompt-tokens`` prompts one at a time, a pause between them,
with several clients in turns (rounds), all in one run so the machine's drift hits them alike:

* ``model_ms``: the timing model's prefill of the prompt, plus its KV transfer on the link (1P1D);
* ``engine_ms``: the simulated engine and its driver in this process (no router, no sockets): the
  step thread's wake-up and the engine's own Python;
* ``router_ms``: the router's own TTFT (``pdrouter_time_to_first_token_seconds``: from its door
  reading the request to the first token written), over the raw client's requests;
* ``raw_client_ms``: a bare HTTP/1.1 client on one kept-alive connection, through the router;
* ``bench_client_ms``: ``pdrouter bench``'s own client (httpx, the body encoded before the clock);
* ``loaded_raw_client_ms``: the bare client again while ``pdrouter bench run`` offers ``--load-rate``
  requests/s of the same prompts in the background (their prefills queue with the probe's).

Medians over the rounds, in milliseconds of wall time, which at time scale 1 is simulated time; the
``*_unmodeled_ms`` figures are the median less ``model_ms``: what the machine adds that the timing
model does not know of. A larger ``--time-scale`` of the workers divides it by the scale.

    python benchmarks/sim_idle_ttft.py [--quick] [--json] [--colocated] [--prompt-tokens 1000]
"""

from __future__ import annotations

import asyncio
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
from _load import HttpCompletions
from _report import Report, base_parser
from prometheus_client.parser import text_string_to_metric_families

from pdrouter.bench.client import CompletionsClient
from pdrouter.bench.compare import Layout, bring_up
from pdrouter.bench.workload import RequestSpec
from pdrouter.core.capacity import kv_bytes_per_token
from pdrouter.core.gpu import get_gpu_preset
from pdrouter.core.model_spec import get_model_preset
from pdrouter.core.sampling import SamplingParams
from pdrouter.engine.batch_engine import SchedulingConfig
from pdrouter.engine.model_folder import write_config_folder
from pdrouter.engine.sim.config import SimEngineConfig
from pdrouter.engine.sim.engine import SimEngine
from pdrouter.engine.sim.link import get_link_preset
from pdrouter.engine.sim.timing import TimingModel
from pdrouter.worker.driver import EngineDriver

MODEL, GPU, LINK = "llama-3-8b", "h100", "rdma-400g"
PAUSE_S = 0.05


def prompt(n: int, rng: random.Random) -> list[int]:
    return [rng.randrange(32, 127) for _ in range(n)]


async def engine_ms(tokens: int, rounds: int, rng: random.Random) -> list[float]:
    """First-token latency of the engine and its driver alone, in this process."""
    spec = get_model_preset(MODEL)
    engine = SimEngine(SimEngineConfig(spec=spec, gpu=get_gpu_preset(GPU), token_range=(32, 127),
                                       scheduling=SchedulingConfig(max_num_seqs=256, max_num_batched_tokens=8192)))
    driver = EngineDriver(engine)
    out = []
    try:
        for i in range(rounds):
            start = time.perf_counter()
            async for _ in driver.generate(f"probe-{i}", prompt(tokens, rng),
                                           SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)):
                out.append((time.perf_counter() - start) * 1e3)
                break
            await asyncio.sleep(PAUSE_S)
    finally:
        await driver.close()
    return out


def router_ttft(url: str) -> tuple[float, float]:
    """(sum, count) of the router's TTFT histogram (HTTP door)."""
    text = httpx.get(url.removesuffix("/v1") + "/metrics", timeout=10).text
    found = {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples
             if s.name.startswith("pdrouter_time_to_first_token_seconds") and s.labels.get("frontdoor") == "http"}
    return found.get("pdrouter_time_to_first_token_seconds_sum", 0.0), \
        found.get("pdrouter_time_to_first_token_seconds_count", 0.0)


async def probe(url: str, model: str, tokens: int, rounds: int, rng: random.Random) -> dict[str, list[float]]:
    """The clients in turns, ``rounds`` times: TTFTs in ms, and the router's over the raw client's."""
    host, _, port = url.split("//")[1].split("/")[0].rpartition(":")
    bench = CompletionsClient(url, model)
    fresh = (prompt(tokens, rng) for _ in iter(int, 1))  # a fresh prompt each time: no cache hit
    raw_client = HttpCompletions(host, int(port), model, [], 1, stream=True, prompts=fresh)
    got: dict[str, list[float]] = {"raw_client": [], "bench_client": [], "router": []}
    try:
        for i in range(rounds):
            before = router_ttft(url)
            _, first = await raw_client.once(0)
            got["raw_client"].append(first * 1e3)
            after = router_ttft(url)
            if after[1] - before[1] == 1:
                got["router"].append((after[0] - before[0]) * 1e3)
            await asyncio.sleep(PAUSE_S)
            spec = RequestSpec(i, tuple(prompt(tokens, rng)), 1)
            record = await bench.send(spec, 0.0, time.perf_counter())
            if record.ttft_s is not None:
                got["bench_client"].append(record.ttft_s * 1e3)
            await asyncio.sleep(PAUSE_S)
    finally:
        await bench.close()
        await raw_client.close()
    return got


async def main_async() -> None:
    parser = base_parser(__doc__ or "")
    parser.add_argument("--colocated", action="store_true", help="one colocated worker instead of 1P1D")
    parser.add_argument("--prompt-tokens", type=int, default=1000)
    parser.add_argument("--rounds", type=int, default=40)
    parser.add_argument("--load-rate", type=float, default=8.0, help="background requests/s while loaded")
    args = parser.parse_args()
    if args.quick:
        args.rounds = 12
    rng = random.Random(7)
    spec = get_model_preset(MODEL)
    timing = TimingModel(spec, get_gpu_preset(GPU))
    model = timing.prefill(args.prompt_tokens).seconds
    if not args.colocated:
        model += get_link_preset(LINK).transfer_s(args.prompt_tokens * kv_bytes_per_token(spec))
    report = Report()
    report.add("prompt_tokens", args.prompt_tokens, "tokens")
    report.add("model_ms", model * 1e3, "ms")
    engine = await engine_ms(args.prompt_tokens, args.rounds, rng)
    report.add("engine_ms", statistics.median(engine), "ms")
    report.add("engine_unmodeled_ms", statistics.median(engine) - timing.prefill(args.prompt_tokens).seconds * 1e3,
               "ms")
    layout = Layout("colocated-1", colocated=1) if args.colocated else Layout("1p1d", prefill=1, decode=1)
    with tempfile.TemporaryDirectory(prefix="idle-ttft-") as tmp:
        folder = write_config_folder(spec, Path(tmp) / MODEL)
        with bring_up(layout, folder, gpu=GPU, time_scale=1.0, extra=["--link", LINK]) as cluster:
            await probe(cluster.url, folder.name, 64, 4, rng)  # warm up: connections, first code paths
            idle = await probe(cluster.url, folder.name, args.prompt_tokens, args.rounds, rng)
            load = subprocess.Popen([sys.executable, "-m", "pdrouter", "bench", "run", "--no-progress", "--no-metrics",
                                     "--url", cluster.url, "--model", folder.name, "--rate", str(args.load_rate),
                                     "--num-requests", str(int(args.load_rate * 600)), "--input-len",
                                     str(args.prompt_tokens), "--output-len", "32", "--seed", "99", "--out",
                                     str(Path(tmp) / "load")], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            try:
                await asyncio.sleep(3.0)  # the load reaches its pace
                loaded = await probe(cluster.url, folder.name, args.prompt_tokens, args.rounds, rng)
            finally:
                load.terminate()
                load.wait(60)
    for name in ("router", "raw_client", "bench_client"):
        median = statistics.median(idle[name]) if idle[name] else float("nan")
        report.add(f"{name}_ms", median, "ms")
        report.add(f"{name}_unmodeled_ms", median - model * 1e3, "ms")
    for name in ("raw_client", "bench_client"):
        median = statistics.median(loaded[name])
        report.add(f"loaded_{name}_ms", median, "ms")
        report.add(f"loaded_{name}_unmodeled_ms", median - model * 1e3, "ms")
    report.add("rounds", args.rounds, "requests per client")
    report.emit(args.json)


if __name__ == "__main__":
    asyncio.run(main_async())
