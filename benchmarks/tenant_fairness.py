"""Fair queuing under a flood: three tenants on one simulated pool, with FIFO beside it, in one run.

One simulated disaggregated pool (``--backend sim`` on Llama-3-8B's geometry, H100s, ``--time-scale``
S: modeled time runs S times slower than the wall clock): ``--prefill`` prefill workers (one fleet
process) and ``--decode`` decode workers whose KV pools hold about a hundred requests each. Requests
have ``--prompt`` random token ids (never a prefix hit) and ``--output`` tokens. The pool is
decode-bound: prefill workers have room to spare, so requests wait for decode KV, in the admission
queue, which is where fairness is decided.

Two routers on the same workers and Redis: ``fair``, with a tenants file (tenant ``a`` weight 2,
``b`` and ``c`` weight 1, ``p`` weight 1 in the ``interactive`` class), and ``fifo``, without one
(every request one flow: the queue in arrival order, as before tenants). Phases, one after another:

1. ``capacity``: a closed loop of the decode pools' requests at once (and 20 % more) through ``fifo``:
   completions per second;
2. ``solo_b``, ``solo_c``: ``b`` alone, then ``c`` alone, Poisson arrivals at their fair share
   (weight ÷ Σ weights of ``a``, ``b``, ``c``, times the capacity), through ``fair``;
3. ``fair``: the same ``b`` and ``c`` while ``a`` floods at ``--flood`` × the capacity, and ``p``
   sends bursts of ``--burst`` requests at once, through ``fair``;
4. ``fifo``: the same load through ``fifo`` (``p``'s bursts with no priority there);
5. ``backlog``: ``a``, ``b`` and ``c`` all flooding (each at the whole capacity), through ``fair``:
   each one's admitted share against its weight.

Per phase and tenant: requests sent, answered 200, refused (429), TTFT p50 / p99 of those answered
(``b`` and ``c`` stream; ``a`` does not), and the admitted share: completions started in the phase's
measured window (after ``--warmup`` s) over all of them. Then the ratios its targets are stated in:
``ratio_ttft_p99_{b,c}`` (fair ÷ solo; ≤ 1.5), ``share_error_*`` (|share − weight share| ÷ weight
share; ≤ 0.10), ``priority_ttft_p99_over_b`` (``p``'s bursts beside ``b``'s single requests) and the
same ratios under FIFO for contrast.

    python benchmarks/tenant_fairness.py [--quick] [--json] [--time-scale S] [--phase-s T]
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import secrets
import statistics
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from _report import Report, base_parser

from pdrouter.cli.local_cluster import ManagedProcess, worker_args
from pdrouter.core.capacity import plan_capacity
from pdrouter.core.gpu import get_gpu_preset
from pdrouter.core.model_spec import get_model_preset
from pdrouter.engine.model_folder import write_config_folder
from pdrouter.state.embedded_redis import EmbeddedRedis
from pdrouter.wire.security import INTERNAL_TOKEN_ENV

MODEL = "llama-3-8b"
WEIGHTS = {"a": 2.0, "b": 1.0, "c": 1.0}
KEYS = {t: f"{t}-key-{'z' * 24}" for t in ("a", "b", "c", "p")}
TENANTS = """
tenants:
  a: {weight: 2}
  b: {weight: 1}
  c: {weight: 1}
  p: {weight: 1, priority: interactive}
"""


@dataclass
class Outcome:
    """One request: when it was sent (monotonic), its status, its time to first token (s; streamed ones)."""

    tenant: str
    sent: float
    status: int
    ttft: float = 0.0


@dataclass
class Phase:
    name: str
    outcomes: list[Outcome] = field(default_factory=list)
    window: tuple[float, float] = (0.0, 0.0)

    def of(self, tenant: str) -> list[Outcome]:
        return [o for o in self.outcomes if o.tenant == tenant]

    def measured(self, tenant: str) -> list[Outcome]:
        lo, hi = self.window
        return [o for o in self.of(tenant) if lo <= o.sent < hi]


class Client:
    """Raw HTTP/1.1 requests (one connection each), cheap enough to flood the router from this process."""

    def __init__(self, host: str, port: int, prompt_tokens: int, output: int, rng: random.Random) -> None:
        self.host, self.port = host, port
        self.rng = rng
        # Text of the byte tokenizer: one token a character, with the BOS ``prompt_tokens`` in all.
        self._tail = "".join(rng.choice("abcdefghijklmnopqrstuvwxyz ") for _ in range(prompt_tokens - 9))
        self._output = output

    def _request(self, tenant: str, stream: bool) -> bytes:
        # A fresh start: no prompt shares a prefix block with another.
        prompt = f"{self.rng.getrandbits(32):08x}{self._tail}"
        body = (f'{{"model":"{MODEL}","prompt":"{prompt}","max_tokens":{self._output},"ignore_eos":true,'
                f'"stream":{"true" if stream else "false"}}}').encode()
        return (f"POST /v1/completions HTTP/1.1\r\nhost: {self.host}\r\nauthorization: Bearer {KEYS[tenant]}\r\n"
                f"content-type: application/json\r\nconnection: close\r\ncontent-length: {len(body)}\r\n\r\n"
                ).encode() + body

    async def send(self, tenant: str, stream: bool, phase: Phase) -> None:
        sent = time.monotonic()
        start = time.perf_counter()
        outcome = Outcome(tenant, sent, 0)
        phase.outcomes.append(outcome)
        try:
            reader, writer = await asyncio.open_connection(self.host, self.port)
        except OSError:
            outcome.status = -1
            return
        try:
            writer.write(self._request(tenant, stream))
            head = await reader.readuntil(b"\r\n\r\n")
            outcome.status = int(head.split(b" ", 2)[1])
            if outcome.status != 200:
                return
            if not stream:
                await reader.read()
                return
            while True:  # chunked SSE: the first data event is the first token
                size = int((await reader.readuntil(b"\r\n")).split(b";", 1)[0], 16)
                if size == 0:
                    break
                chunk = await reader.readexactly(size + 2)
                if not outcome.ttft and b"data: {" in chunk:
                    outcome.ttft = time.perf_counter() - start
        except (OSError, asyncio.IncompleteReadError, ValueError):
            outcome.status = -1
        finally:
            writer.close()
            with contextlib.suppress(OSError):
                await writer.wait_closed()


async def poisson(client: Client, tenant: str, rate: float, until: float, phase: Phase, stream: bool,
                  burst: int = 1, tasks: set[asyncio.Task[None]] | None = None) -> None:
    """Open-loop arrivals of ``tenant`` at ``rate`` per second (``burst`` requests each) until ``until``."""
    held = tasks if tasks is not None else set()
    rng = random.Random(hash(tenant) & 0xFFFF)
    next_at = time.monotonic() + rng.expovariate(rate)
    while next_at < until:
        await asyncio.sleep(max(0.0, next_at - time.monotonic()))
        for _ in range(burst):
            task = asyncio.create_task(client.send(tenant, stream, phase))
            held.add(task)
            task.add_done_callback(held.discard)
        next_at += rng.expovariate(rate)
    if tasks is None and held:
        await asyncio.wait(held)


async def closed_loop(client: Client, tenant: str, concurrency: int, until: float, phase: Phase) -> None:
    async def slot() -> None:
        while time.monotonic() < until:
            await client.send(tenant, False, phase)

    await asyncio.gather(*(slot() for _ in range(concurrency)))


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))]


@dataclass
class Pool:
    procs: list[ManagedProcess]
    fair: Client
    fifo: Client


@contextlib.contextmanager
def pool(args: object, tmp: Path) -> Iterator[Pool]:
    a = args
    model = write_config_folder(get_model_preset(MODEL), tmp / MODEL)
    (tmp / "tenants.yaml").write_text(TENANTS)
    (tmp / "keys-fair").write_text("".join(f"{key} {tenant}\n" for tenant, key in KEYS.items()))
    (tmp / "keys-fifo").write_text("".join(f"{key}\n" for key in KEYS.values()))
    token = {INTERNAL_TOKEN_ENV: secrets.token_hex(16), "PDROUTER_KV_TOKEN": secrets.token_hex(16),
             "PDROUTER_KV_TOKEN_FILE": ""}
    procs: list[ManagedProcess] = []
    with EmbeddedRedis() as redis:
        try:
            sim = ["--gpu", "h100", "--time-scale", str(a.time_scale)]  # type: ignore[attr-defined]
            prefill = ManagedProcess("prefill", worker_args(
                "prefill", model, redis_url=redis.url, sim=[*sim, "--utilization", "0.5"], count=a.prefill,  # type: ignore[attr-defined]
                extra=("--worker-id", "prefill")), env=token)
            procs.append(prefill)
            for i in range(a.decode):  # type: ignore[attr-defined]
                procs.append(ManagedProcess(f"decode-{i}", worker_args(
                    "decode", model, redis_url=redis.url, sim=[*sim, "--utilization", str(a.decode_utilization)],  # type: ignore[attr-defined]
                    extra=("--worker-id", f"decode-{i}")), env=token))
            prefill.wait_ready_all(a.prefill, 120.0)  # type: ignore[attr-defined]
            for proc in procs[1:]:
                proc.wait_ready(120.0)
            routers = []
            for name, extra in (("fair", ["--tenants", str(tmp / "tenants.yaml")]), ("fifo", [])):
                router = ManagedProcess(f"router-{name}", [
                    "router", "--model", str(model), "--redis", redis.url, "--http-port", "0", "--grpc-port", "0",
                    "--api-key-file", str(tmp / f"keys-{name}"), "--local-prefill-tokens", "0",
                    "--queue-timeout-s", "10", "--queue-limit", str(a.queue_limit),  # type: ignore[attr-defined]
                    "--log-level", "ERROR", *extra], env=token)
                procs.append(router)
                routers.append(router)
            for router in routers:
                router.wait_ready(120.0)
            clients = []
            for router in routers:
                assert router.address is not None
                host, port = router.address.rsplit(":", 1)
                clients.append(Client(host, int(port), a.prompt, a.output, random.Random(7)))  # type: ignore[attr-defined]
            time.sleep(1.5)  # every router's pool has every worker
            yield Pool(procs, clients[0], clients[1])
        finally:
            for proc in reversed(procs):
                proc.stop()


async def run(args: object, report: Report) -> None:
    a = args
    phase_s: float = a.phase_s  # type: ignore[attr-defined]
    warmup: float = a.warmup  # type: ignore[attr-defined]
    with tempfile.TemporaryDirectory() as tmp, pool(args, Path(tmp)) as p:
        # 1. the pool's capacity: completions per second of a closed loop that keeps it full
        cap_phase = Phase("capacity")
        until = time.monotonic() + phase_s
        cap_phase.window = (time.monotonic() + warmup, until)
        await closed_loop(p.fifo, "a", a.concurrency, until, cap_phase)  # type: ignore[attr-defined]
        done = [o for o in cap_phase.measured("a") if o.status == 200]
        capacity = len(done) / (until - cap_phase.window[0])
        if not done:
            raise SystemExit(f"no request completed in the capacity phase's {phase_s - warmup:g} s: raise --phase-s")
        report.add("fairness_capacity_rps", round(capacity, 2), "requests/s")
        share = {t: w / sum(WEIGHTS.values()) for t, w in WEIGHTS.items()}
        rates = {t: capacity * share[t] for t in ("b", "c")}

        async def phase(name: str, client: Client, loads: list[tuple[str, float, bool, int]]) -> Phase:
            ph = Phase(name)
            start = time.monotonic()
            until = start + phase_s
            ph.window = (start + warmup, until)
            tasks: set[asyncio.Task[None]] = set()
            await asyncio.gather(*(poisson(client, t, rate, until, ph, stream, burst, tasks)
                                   for t, rate, stream, burst in loads))
            if tasks:
                await asyncio.wait(tasks)
            return ph

        solo = {t: await phase(f"solo_{t}", p.fair, [(t, rates[t], True, 1)]) for t in ("b", "c")}
        flood = ("a", a.flood * capacity, False, 1)  # type: ignore[attr-defined]
        burst = ("p", a.burst_rate, True, a.burst)  # type: ignore[attr-defined]
        fair = await phase("fair", p.fair, [flood, ("b", rates["b"], True, 1), ("c", rates["c"], True, 1), burst])
        fifo = await phase("fifo", p.fifo, [flood, ("b", rates["b"], True, 1), ("c", rates["c"], True, 1), burst])
        backlog = await phase("backlog", p.fair, [(t, capacity, False, 1) for t in WEIGHTS])

    def ttfts(ph: Phase, tenant: str) -> list[float]:
        return [o.ttft for o in ph.measured(tenant) if o.status == 200 and o.ttft]

    for ph in (*solo.values(), fair, fifo, backlog):
        for tenant in ("a", "b", "c", "p"):
            mine = ph.measured(tenant)
            if not mine:
                continue
            ok = [o for o in mine if o.status == 200]
            report.add(f"{ph.name}_{tenant}_sent", len(mine), "requests")
            report.add(f"{ph.name}_{tenant}_ok", len(ok), "requests")
            report.add(f"{ph.name}_{tenant}_refused", sum(o.status == 429 for o in mine), "requests")
            t = ttfts(ph, tenant)
            if t:
                report.add(f"{ph.name}_{tenant}_ttft_p50_ms", round(statistics.median(t) * 1e3, 1), "ms")
                report.add(f"{ph.name}_{tenant}_ttft_p99_ms", round(pct(t, 0.99) * 1e3, 1), "ms")
        admitted = {t: sum(o.status == 200 for o in ph.measured(t)) for t in WEIGHTS}
        total = sum(admitted.values())
        if ph.name in ("fair", "fifo", "backlog") and total:
            for t in WEIGHTS:
                report.add(f"{ph.name}_{t}_share", round(admitted[t] / total, 3))
                report.add(f"{ph.name}_{t}_share_error", round(abs(admitted[t] / total - share[t]) / share[t], 3))
    for t in ("b", "c"):
        solo_p99 = pct(ttfts(solo[t], t), 0.99)
        report.add(f"ratio_ttft_p99_{t}", round(pct(ttfts(fair, t), 0.99) / solo_p99, 2), "× solo (≤ 1.5)")
        served = ttfts(fifo, t)
        report.add(f"fifo_ratio_ttft_p99_{t}", round(pct(served, 0.99) / solo_p99, 2) if served else "none served",
                   "× solo")
    for ph in (fair, fifo):
        p_ttft, b_ttft = ttfts(ph, "p"), ttfts(ph, "b")
        report.add(f"{'' if ph is fair else 'fifo_'}priority_ttft_p99_over_b",
                   round(pct(p_ttft, 0.99) / pct(b_ttft, 0.99), 2) if p_ttft and b_ttft else "none served",
                   f"(bursts of {a.burst} beside single requests)")  # type: ignore[attr-defined]


def main() -> None:
    parser = base_parser(__doc__ or "")
    parser.add_argument("--time-scale", type=float, default=10.0)
    parser.add_argument("--phase-s", type=float, default=60.0, help="seconds per phase")
    parser.add_argument("--warmup", type=float, default=20.0, help="seconds of each phase not measured")
    parser.add_argument("--prefill", type=int, default=8, help="prefill workers (one fleet process)")
    parser.add_argument("--decode", type=int, default=1, help="decode workers")
    parser.add_argument("--prompt", type=int, default=2048, help="prompt tokens")
    parser.add_argument("--output", type=int, default=64, help="output tokens")
    parser.add_argument("--flood", type=float, default=10.0, help="tenant a's rate, × the capacity")
    parser.add_argument("--burst", type=int, default=6, help="requests of each of p's bursts")
    parser.add_argument("--burst-rate", type=float, default=0.2, help="p's bursts per second")
    parser.add_argument("--queue-limit", type=int, default=32,
                        help="each router's admission queue (--queue-limit): a flood past it is refused at once")
    parser.add_argument("--decode-utilization", type=float, default=0.5,
                        help="the decode workers' share of an H100 (sizes their KV pools: ~90 requests at 0.5)")
    parser.add_argument("--concurrency", type=int, default=0,
                        help="the capacity phase's closed loop (0: the decode pools' requests at once, and 20 %% more)")
    args = parser.parse_args()
    if args.quick:  # a smoke run: every phase, too short for steady state
        args.time_scale, args.phase_s, args.warmup, args.prefill, args.prompt, args.output = 3.0, 2.0, 0.5, 2, 512, 16
        args.decode_utilization = 0.25
    if not args.concurrency:
        spec = get_model_preset(MODEL)
        blocks = plan_capacity(spec, get_gpu_preset("h100"), utilization=args.decode_utilization).num_blocks
        per_request = -(-(args.prompt + args.output) // 16)
        args.concurrency = int(1.2 * args.decode * (blocks // per_request)) + 1
    report = Report()
    asyncio.run(run(args, report))
    if args.quick:
        report.add("note", "quick run: phases too short for p99 figures to mean much")
    report.emit(args.json)


if __name__ == "__main__":
    main()
