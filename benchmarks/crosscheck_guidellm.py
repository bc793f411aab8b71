"""Cross-check of ``pdrouter bench run`` against GuideLLM: one simulated cluster, one workload, both tools.

Brings up ``pdrouter up --backend sim --prefill 1 --decode 1`` (Llama-3-8B on H100s, time scale 1,
deterministic simulated latencies: a decode step ≈ 7 ms) and drives it, one tool after the
other (``--rounds`` rounds, each a run of both tools in turn, the order alternating, every run with
prompts of its own), with the same workload: ``--requests`` requests of ``--input-len`` prompt tokens and exactly
``--output-len`` output tokens (``max_tokens`` with ``ignore_eos``), streamed from
``/v1/completions``, arriving at a constant ``--rate`` (request ``i`` at ``i / rate`` seconds). Our
tool replays that as a ``jsonl`` trace (``timestamp`` per line), GuideLLM runs its ``constant``
profile; Poisson arrivals would make the output throughput depend on each tool's random draw (the
span of 100 Poisson arrivals varies by ~10%).

The model folder holds the llama-3-8b ``config.json`` and a character-level ``tokenizer.json``
that both the router and GuideLLM load (GuideLLM needs a Hugging Face tokenizer to build its
synthetic prompts; nothing is downloaded): ids 32–126 are the printable ASCII characters (the ids
``pdrouter bench`` draws its prompts from), 9 and 10 are tab and newline, every other id of the
128,256 is a word such as `` t4711``. The model keeps its vocabulary (and so its timing), and every
id decodes to non-empty text, so every simulated output token (drawn from the whole vocabulary)
is one streamed chunk with text. Ours counts every chunk with a choice (``vllm bench serve``'s
rule), GuideLLM's the chunks with text: the same chunks here. Both take the output
length from the server's ``usage`` (``text_chunks_*`` and ``output_tokens_*``: 64 and 64). The
folder's ``config.json`` has no ``bos_token_id`` (the tokenizer has none), so GuideLLM's 256-token
text prompts are 256 tokens at the router, as our 256 token ids are (``prompt_tokens_*``). The
prompts differ only in content: ours random characters sent as ids, GuideLLM's Faker sentences
sent as text, each led by a unique marker, so neither gets prefix-cache hits.

Printed, for each of ``ttft_mean``, ``ttft_p50``, ``tpot_mean``, ``itl_mean`` and
``output_tokens_per_s``: ``<figure>_ours``, ``<figure>_guidellm`` and ``<figure>_diff_percent``
(GuideLLM relative to ours), each the median of the rounds' figures (every round's are printed
too, as ``round_<i>_<figure>_<tool>``); then ``agreement_within_5pct`` (1 when all five are within
5%). Rounds that alternate the order spread a machine's changing load over both tools.
The definitions, and which GuideLLM figure is set beside which of ours:

* TTFT: both from the request's start to the first token's chunk (every one has text here), but
  the starts differ. Ours
  is taken before the HTTP client gets a connection (``vllm bench serve``'s way); GuideLLM's when
  the request headers start being written (an ``httpx`` trace hook), after any TCP connect.
  Our client reads each stream to the end of its body and reuses its pooled connections;
  GuideLLM stops at ``data: [DONE]``, so ``httpx`` closes each of its connections (one TIME-WAIT
  socket per request) and its next request connects anew, outside its TTFT clock. Our TTFT can
  still include a connect when the pool grows, and it includes writing the request, which
  GuideLLM's leaves out. GuideLLM's p50 is the lower middle value (no interpolation), ours
  interpolates: 0.02 ms apart here.
* TPOT: ours is ``vllm bench serve``'s, ``(E2E − TTFT) / (output tokens − 1)``. GuideLLM's
  "time per output token" is another quantity, ``(last token − request start) / output tokens``:
  it includes the TTFT (≈ TTFT / 64 more per token here). Its "inter token latency",
  ``(last token − first token) / (output tokens − 1)`` per request, is our TPOT's definition (up
  to the moment between the last token and ``[DONE]``), so ``tpot_mean_guidellm`` is GuideLLM's
  inter-token latency. GuideLLM's "time per output token" is printed as
  ``tpot_incl_ttft_mean_guidellm``, beside ours computed by its definition from our per-request
  records (``tpot_incl_ttft_mean_ours``; ``tpot_incl_ttft_diff_percent``).
* ITL: ours is the mean of every gap between token chunks; GuideLLM's is the per-request
  ``(last − first) / (output tokens − 1)`` averaged with weights ``output tokens − 1``: the same
  number when every chunk is one token, as here. (Not otherwise: GuideLLM divides by tokens from
  ``usage``, we count gaps between chunks; and its percentiles are of per-request means.)
* Output throughput: ours is the completed output tokens ÷ the run (first send to last end);
  GuideLLM's is the duration-weighted mean of its output-token rate from the first request's
  start to the last one's end, which is also tokens ÷ that span.

Besides: ``ttft_server_mean_*``, the router's own TTFT during each tool's run (its
``pdrouter_time_to_first_token_seconds`` histogram, sum ÷ count: from the request's arrival at the
front door to its first token), the referee between a client's clock and what the server did;
``ttft_client_overhead_ms_*``, each tool's TTFT minus it. ``cpu_busy_cores_*``: this machine's busy
cores (``/proc/stat``) during each tool's measured window; ``cluster_cpu_cores_*`` and
``load_tool_cpu_cores_*``: the router's and workers' part, and the tool's own processes'.

What runs on a 2-core machine shared with other work showed (100 requests at 4 req/s, 256 in / 64
out, and three ``--quick`` runs): TPOT, ITL and output throughput agree within 0.3%, GuideLLM's
time per output token and ours by its definition within 0.6%. TTFT agrees only to about 5%: GuideLLM's
mean and p50 came out between −5% and +4% of ours in the 100-request runs with one GuideLLM
worker, +5% and +3% with ten, between −11% and +8% in the 20-request ones (where one or two
slow requests move a mean). Two effects of opposite sign, which do not cancel exactly: (1) the clock
start above: our client overhead (TTFT − the router's TTFT) was 5–7 ms, GuideLLM's 2.5–4.5 ms;
(2) GuideLLM is the heavier load generator: 0.5–0.6 of a core at 4 req/s (a main process and
spawned worker processes polling queues) against 0.11 for ours, on two cores that the router,
two simulated workers, Redis and other work share, so the router's own TTFT was 1–3 ms higher
during GuideLLM's runs. A first token passes through several Python processes (front door,
prefill and decode workers, gRPC), each of which may wait for a core, so TTFT shows CPU
contention first; the decode steps are paced by the simulator and do not. Sending text instead
of ids, and GuideLLM's request body (no ``temperature``, ``continuous_usage_stats``), made no
difference in interleaved probes. ``--guidellm-workers`` (default 1, GuideLLM's
``GUIDELLM__MAX_WORKER_PROCESSES``; its own default, 10, cost a further ~0.1 core and ~2 ms of
router TTFT here) keeps its footprint small, which is enough at this rate. No figure is adjusted.

GuideLLM is not a dependency of this project: install it in a separate virtual environment
(``python -m venv /tmp/xtool && /tmp/xtool/bin/pip install guidellm``) and pass ``--guidellm``.
Its start-up (imports, tokenizer, synthetic data, spawning workers) takes 15–20 s on this machine,
so a round of 100 requests a tool takes about 2.3 minutes here (three rounds: 7 minutes), and
``--quick`` (two rounds of 20) more than 30 s: about 20 s of start-up and 5 s of requests a run.

    python benchmarks/crosscheck_guidellm.py [--quick] [--json] [--guidellm PATH] [--requests N]
        [--rounds N] [--rate R] [--input-len N] [--output-len N] [--guidellm-workers N] [--keep DIR]
"""

from __future__ import annotations

import asyncio
import bisect
import contextlib
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
from _load import cpu_seconds
from _report import Report, base_parser
from sim_fleet import children, cluster, machine_busy_s

from pdrouter.bench.client import CompletionsClient
from pdrouter.bench.workload import RequestSpec
from pdrouter.core.model_spec import get_model_preset
from pdrouter.engine.model_folder import write_config_folder

MODEL = "llama-3-8b"
DEFAULT_GUIDELLM = "/tmp/xtool/bin/guidellm"
FIGURES = ("ttft_mean", "ttft_p50", "tpot_mean", "itl_mean", "output_tokens_per_s")


def write_model(folder: Path) -> Path:
    """The llama-3-8b config (no BOS) and a character-level ``tokenizer.json`` every id of which is text."""
    from tokenizers import Tokenizer, decoders
    from tokenizers.models import BPE

    spec = get_model_preset(MODEL)
    write_config_folder(spec, folder)
    text_ids = {9, 10, *range(32, 127)}
    vocab = {(chr(i) if i in text_ids else f" t{i}"): i for i in range(spec.vocab_size)}
    tokenizer = Tokenizer(BPE(vocab=vocab, merges=[]))  # no merges: one token per character
    tokenizer.decoder = decoders.Fuse()  # decoding concatenates the tokens' text
    tokenizer.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": spec.max_context,
         "clean_up_tokenization_spaces": False}) + "\n")
    config = json.loads((folder / "config.json").read_text())
    config["bos_token_id"] = None  # the router would prepend it to text prompts only
    (folder / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    return folder


def server_ttft(metrics_url: str) -> tuple[float, float]:
    """(sum of seconds, count) of the router's TTFT histogram at the OpenAI front door."""
    text = httpx.get(metrics_url, timeout=10.0).text
    found = {"sum": 0.0, "count": 0.0}
    for line in text.splitlines():
        for key in found:
            if line.startswith(f'pdrouter_time_to_first_token_seconds_{key}{{frontdoor="http"}}'):
                found[key] = float(line.split()[-1])
    return found["sum"], found["count"]


def tree(pid: int) -> list[int]:
    """``pid`` and all its descendants (those alive now)."""
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        with contextlib.suppress(OSError):
            todo += children(p)
    return out


@dataclass
class Sample:
    at: float
    """Wall time (``time.time()``, the clock of GuideLLM's document)."""
    machine_s: float
    """Busy CPU seconds of the whole machine since boot."""
    cluster_s: float
    """CPU seconds of the router and the workers."""
    tool_s: dict[int, float]
    """CPU seconds of each process of the load tool running then."""


@dataclass
class CpuSampler:
    """Samples the machine's, the cluster's and the running tool's CPU four times a second (a thread)."""

    cluster: list[int]
    tool: int | None = None
    """The load tool's process, while one runs (its descendants are counted too)."""
    samples: list[Sample] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)

    @staticmethod
    def _cpu(pids: list[int]) -> dict[int, float]:
        out = {}
        for pid in pids:
            with contextlib.suppress(OSError):  # a process that has exited
                out[pid] = cpu_seconds(pid)
        return out

    def _run(self) -> None:
        while not self._stop.is_set():
            tool = self._cpu(tree(self.tool)) if self.tool is not None else {}
            self.samples.append(Sample(time.time(), machine_busy_s(), sum(self._cpu(self.cluster).values()), tool))
            self._stop.wait(0.25)

    def start(self) -> None:
        threading.Thread(target=self._run, daemon=True).start()

    def stop(self) -> None:
        self._stop.set()

    def cores(self, start: float, end: float) -> tuple[float, float, float]:
        """Busy cores of the machine, of the cluster and of the load tool between two wall times (nan:
        too few samples). The tool's are those of its processes alive at the window's end."""
        times = [s.at for s in self.samples]
        lo, hi = bisect.bisect_left(times, start), bisect.bisect_right(times, end) - 1
        if hi <= lo:
            return math.nan, math.nan, math.nan
        a, b = self.samples[lo], self.samples[hi]
        span = b.at - a.at
        tool = sum(cpu - a.tool_s.get(pid, 0.0) for pid, cpu in b.tool_s.items())
        return (b.machine_s - a.machine_s) / span, (b.cluster_s - a.cluster_s) / span, tool / span


def run_tool(argv: list[str], sampler: CpuSampler, **popen: Any) -> tuple[int, str]:
    """Run a load tool to its end with ``sampler`` watching its processes: (exit code, its stdout)."""
    proc = subprocess.Popen(argv, text=True, **popen)
    sampler.tool = proc.pid
    try:
        stdout, _ = proc.communicate(timeout=900)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise
    finally:
        sampler.tool = None
    return proc.returncode, stdout or ""


async def warm_up(url: str, prompt_len: int, output_len: int) -> None:
    """A few requests so that neither tool meets a cold cluster (first connections, first steps)."""
    client = CompletionsClient(url, "model")
    try:
        for i in range(4):
            spec = RequestSpec(i, tuple(32 + (7 * i + j) % 95 for j in range(prompt_len)), output_len)
            await client.send(spec, 0.0, time.perf_counter())
    finally:
        await client.close()


def run_ours(args: Any, url: str, work: Path, sampler: CpuSampler, seed: int = 0) -> tuple[dict[str, Any], list[str],
                                                                                          float]:
    """``pdrouter bench run`` on the constant-rate trace, its prompts drawn with ``seed``: (its run
    document, its argv, its end's wall time)."""
    work.mkdir(parents=True, exist_ok=True)
    trace = work / "constant.jsonl"
    trace.write_text("".join(json.dumps({"input_len": args.input_len, "output_len": args.output_len,
                                         "timestamp": round(i / args.rate, 6)}) + "\n"
                             for i in range(args.requests)))
    argv = [sys.executable, "-m", "pdrouter", "bench", "run", "--url", url, "--model", "model",
            "--workload", "jsonl", "--dataset", str(trace), "--num-requests", str(args.requests),
            "--seed", str(seed), "--no-metrics", "--no-progress", "--json", "--out", str(work / "ours")]
    code, stdout = run_tool(argv, sampler, stdout=subprocess.PIPE)
    if code != 0:
        raise RuntimeError(f"pdrouter bench run exited {code}:\n{stdout}")
    path = Path(json.loads(stdout)["file"])
    return json.loads(path.read_text()), argv, path.stat().st_mtime  # written as the run ended


def run_guidellm(args: Any, base: str, folder: Path, work: Path, sampler: CpuSampler,
                 seed: int = 42) -> tuple[dict[str, Any], list[str]]:
    """GuideLLM's constant profile with the same workload, its prompts drawn with ``seed``: (its
    benchmark, its argv)."""
    work.mkdir(parents=True, exist_ok=True)
    out = work / "guidellm.json"
    argv = [args.guidellm, "run",
            "--backend", f"kind=openai_http,target={base},model=model,request_format=/v1/completions",
            "--profile", f"kind=constant,rate={args.rate:g}",
            "--constraint", f"kind=max_requests,count={args.requests}",
            "--tokenizer", f"kind=hf_auto,model={folder}",
            "--data", f"kind=synthetic_text,prompt_tokens={args.input_len},output_tokens={args.output_len}",
            "--seed", f"kind=static,value={seed}", "--output", f"kind=json,path={out}", "--disable-console"]
    env = {**os.environ, "GUIDELLM__MAX_WORKER_PROCESSES": str(args.guidellm_workers)}
    log = work / "guidellm.log"
    with log.open("w") as sink:
        code, _ = run_tool(argv, sampler, stdout=sink, stderr=subprocess.STDOUT, cwd=work, env=env)
    if code != 0 or not out.is_file():
        tail = "".join(log.read_text().splitlines(keepends=True)[-30:])
        raise RuntimeError(f"guidellm exited {code}:\n{tail}")
    return json.loads(out.read_text())["benchmarks"][0], argv


def ours_figures(document: dict[str, Any]) -> dict[str, float]:
    s = document["summary"]
    done = [r for r in document["requests"] if r["ok"]]
    incl = [(r["ttft_s"] + sum(r["itl_s"])) / r["output_tokens"] for r in done if r["output_tokens"]]
    return {"ttft_mean": s["ttft"]["mean"] * 1e3, "ttft_p50": s["ttft"]["p50"] * 1e3,
            "tpot_mean": s["tpot"]["mean"] * 1e3, "itl_mean": s["itl"]["mean"] * 1e3,
            "output_tokens_per_s": s["output_tokens_per_s"],
            "tpot_incl_ttft_mean": sum(incl) / len(incl) * 1e3 if incl else float("nan"),
            "completed": s["completed"], "failed": s["failed"],
            "prompt_tokens": sum(r["input_tokens"] for r in done) / max(len(done), 1),
            "output_tokens": sum(r["output_tokens"] for r in done) / max(len(done), 1),
            "text_chunks": sum(len(r["itl_s"]) + 1 for r in done) / max(len(done), 1)}


def guidellm_figures(benchmark: dict[str, Any]) -> dict[str, float]:
    m = benchmark["metrics"]

    def ok(name: str) -> dict[str, Any]:
        return dict(m[name]["successful"])

    totals = m["request_totals"]
    done = benchmark["requests"]["successful"]
    chunks = sum(r["info"]["timings"]["token_iterations"] for r in done) / max(len(done), 1)
    return {"ttft_mean": ok("time_to_first_token_ms")["mean"], "ttft_p50": ok("time_to_first_token_ms")["median"],
            "tpot_mean": ok("inter_token_latency_ms")["mean"], "itl_mean": ok("inter_token_latency_ms")["mean"],
            "output_tokens_per_s": ok("output_tokens_per_second")["mean"],
            "tpot_incl_ttft_mean": ok("time_per_output_token_ms")["mean"],
            "completed": totals["successful"], "failed": totals["errored"] + totals["incomplete"],
            "prompt_tokens": ok("prompt_token_count")["mean"], "output_tokens": ok("output_token_count")["mean"],
            "text_chunks": chunks}


def diff_percent(ours: float, theirs: float) -> float:
    return (theirs - ours) / ours * 100.0 if ours else float("nan")


@dataclass
class Turn:
    """One tool's run in one round: its figures, the router's own mean TTFT meanwhile (ms), and the
    machine's, the cluster's and the tool's busy cores."""

    tool: str
    round: int
    figures: dict[str, float]
    server_ttft_ms: float
    cores: tuple[float, float, float]
    argv: list[str]


def server_mean_ms(before: tuple[float, float], after: tuple[float, float]) -> float:
    count = after[1] - before[1]
    return (after[0] - before[0]) / count * 1e3 if count else float("nan")


def take_turn(tool: str, i: int, args: Any, base: str, folder: Path, work: Path, sampler: CpuSampler) -> Turn:
    """Round ``i``'s run of ``tool`` on the cluster at ``base``, with prompts of that round's own (a
    prompt another round sent would be served from the prefix cache)."""
    before = server_ttft(base + "/metrics")
    if tool == "ours":
        document, argv, end = run_ours(args, base + "/v1", work / f"round-{i}", sampler, seed=1000 + i)
        figures = ours_figures(document)
        cores = sampler.cores(end - document["summary"]["duration_s"], end)
    else:
        benchmark, argv = run_guidellm(args, base, folder, work / f"round-{i}", sampler, seed=2000 + i)
        figures = guidellm_figures(benchmark)
        timings = benchmark["scheduler_metrics"]
        cores = sampler.cores(timings["measure_start_time"], timings["measure_end_time"])
    return Turn(tool, i, figures, server_mean_ms(before, server_ttft(base + "/metrics")), cores, argv)


def median_of(turns: list[Turn], tool: str, key: str) -> float:
    values = [v for t in turns if t.tool == tool and not math.isnan(v := t.figures[key])]
    return statistics.median(values) if values else float("nan")


def main() -> int:
    parser = base_parser(__doc__ or "")
    parser.add_argument("--guidellm", default=DEFAULT_GUIDELLM, help="the guidellm executable")
    parser.add_argument("--requests", type=int, default=100, help="requests per tool and round")
    parser.add_argument("--rounds", type=int, default=5,
                        help="rounds, each a run of both tools in turn (the order alternates)")
    parser.add_argument("--rate", type=float, default=4.0, help="constant arrival rate, requests/s")
    parser.add_argument("--input-len", type=int, default=256, help="prompt tokens")
    parser.add_argument("--output-len", type=int, default=64, help="output tokens (ignore_eos)")
    parser.add_argument("--guidellm-workers", type=int, default=1,
                        help="GuideLLM's worker processes (GUIDELLM__MAX_WORKER_PROCESSES; its default is 10)")
    parser.add_argument("--keep", type=Path, default=None, help="keep the model folder, both runs and logs here")
    args = parser.parse_args()
    if args.quick:
        args.requests, args.rounds = 20, 2
    if not (shutil.which(args.guidellm) or os.access(args.guidellm, os.X_OK)):
        print(f"crosscheck_guidellm: no guidellm at {args.guidellm}; install it in a separate venv "
              f"(python -m venv /tmp/xtool && /tmp/xtool/bin/pip install guidellm) and pass --guidellm PATH",
              file=sys.stderr)
        return 2
    if args.requests < 2 or not args.rate > 0 or args.input_len < 1 or args.output_len < 2 or args.rounds < 1:
        print("crosscheck_guidellm: need --requests >= 2, --rounds >= 1, --rate > 0, --input-len >= 1, "
              "--output-len >= 2", file=sys.stderr)
        return 2
    try:
        import tokenizers  # noqa: F401  (the dev extra's transformers brings it)
    except ImportError:
        print("crosscheck_guidellm: the tokenizers package is missing (pip install tokenizers)", file=sys.stderr)
        return 2
    report = Report()
    report.add("load_average_start", os.getloadavg()[0])
    turns: list[Turn] = []
    with tempfile.TemporaryDirectory(prefix="crosscheck-guidellm-") as tmp:
        work = args.keep or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        folder = write_model(work / "model")
        with cluster(folder, 1, 1, 1.0) as (host, port, router, workers):
            base = f"http://{host}:{port}"
            asyncio.run(warm_up(base + "/v1", args.input_len, args.output_len))
            sampler = CpuSampler([router, *workers])
            sampler.start()
            for i in range(args.rounds):
                for tool in ("ours", "guidellm") if i % 2 == 0 else ("guidellm", "ours"):
                    turns.append(take_turn(tool, i, args, base, folder, work, sampler))
                    t = turns[-1]
                    print(f"crosscheck_guidellm: round {i + 1}/{args.rounds} {tool}: TTFT p50 "
                          f"{t.figures['ttft_p50']:.2f} ms (the router's mean {t.server_ttft_ms:.2f}), TPOT mean "
                          f"{t.figures['tpot_mean']:.3f} ms, {t.figures['output_tokens_per_s']:.1f} tok/s",
                          file=sys.stderr, flush=True)
            sampler.stop()
    print("ours:     " + " ".join(next(t.argv for t in turns if t.tool == "ours")), file=sys.stderr)
    print("guidellm: " + " ".join(next(t.argv for t in turns if t.tool == "guidellm")), file=sys.stderr)
    report.add("requests_per_tool_and_round", args.requests, "requests")
    report.add("rounds", args.rounds)
    report.add("rate", args.rate, "req/s")
    for tool in ("ours", "guidellm"):
        mine = [t for t in turns if t.tool == tool]
        report.add(f"completed_{tool}", int(sum(t.figures["completed"] for t in mine)), "requests")
        report.add(f"failed_{tool}", int(sum(t.figures["failed"] for t in mine)), "requests")
        for key, unit in (("prompt_tokens", "tokens"), ("output_tokens", "tokens"), ("text_chunks", "chunks")):
            report.add(f"{key}_{tool}", median_of(turns, tool, key), unit)
    units = {"output_tokens_per_s": "tok/s"}
    for i in range(args.rounds):  # every round's figures, so a reader sees the spread the medians hide
        for t in (t for t in turns if t.round == i):
            for name in FIGURES:
                report.add(f"round_{i + 1}_{name}_{t.tool}", t.figures[name], units.get(name, "ms"))
            report.add(f"round_{i + 1}_ttft_server_mean_{t.tool}", t.server_ttft_ms, "ms")
    agree = True
    for name in FIGURES:  # the medians of the per-round figures
        ours, theirs = median_of(turns, "ours", name), median_of(turns, "guidellm", name)
        d = diff_percent(ours, theirs)
        agree = agree and abs(d) <= 5.0
        report.add(f"{name}_ours", ours, units.get(name, "ms"))
        report.add(f"{name}_guidellm", theirs, units.get(name, "ms"))
        report.add(f"{name}_diff_percent", d, "%")
    for name in ("tpot_incl_ttft_mean",):
        ours, theirs = median_of(turns, "ours", name), median_of(turns, "guidellm", name)
        report.add(f"{name}_ours", ours, "ms")
        report.add(f"{name}_guidellm", theirs, "ms")
        report.add("tpot_incl_ttft_diff_percent", diff_percent(ours, theirs), "%")
    for tool in ("ours", "guidellm"):
        mine = [t for t in turns if t.tool == tool]
        report.add(f"ttft_server_mean_{tool}", statistics.median(t.server_ttft_ms for t in mine), "ms")
        report.add(f"ttft_client_overhead_ms_{tool}",
                   statistics.median(t.figures["ttft_mean"] - t.server_ttft_ms for t in mine), "ms")
        for j, what in enumerate(("cpu_busy_cores", "cluster_cpu_cores", "load_tool_cpu_cores")):
            report.add(f"{what}_{tool}", statistics.median(t.cores[j] for t in mine), "cores")
    report.add("agreement_within_5pct", int(agree))
    report.add("load_average_end", os.getloadavg()[0])
    report.emit(args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
