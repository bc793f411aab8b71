"""The load generator's own CPU per streamed token: ``pdrouter bench``'s client against an instant server.

``pdrouter bench`` shares the machine with the servers it measures, so every microsecond its client
spends reading a token is taken from them (and a client that falls behind delays the tokens it
times). This measures that cost alone. ``_instant_worker.py`` serves ``POST /v1/completions`` as an
OpenAI-compatible server streams it, with no model behind it: one ``data:`` event per token, then
``data: [DONE]``, over chunked HTTP/1.1 keep-alive, written 16 events at a time (``--burst N``; with
``--gap-ms G``, G milliseconds between writes: ``--burst 1 --gap-ms 10`` reads one token at a time, as
a stream from a simulated GPU at time scale 1 arrives, where the cost per read weighs most). A child
process runs ``pdrouter.bench.client.CompletionsClient`` (the
client ``pdrouter bench`` sends every request with), ``--requests`` requests at ``--concurrency``,
on the event loop ``pdrouter bench`` runs it on (``pdrouter.core.aio.run_on_event_loop``), and reports
its own CPU time (user + system, all threads) and the tokens it timed.

Figures: ``client_cpu_per_token`` (the client's CPU ÷ tokens, the median of the rounds) and
``client_cpu_per_request``. ``--vs REV``: the client of commit ``REV`` too (its ``pdrouter`` package
exported with ``git archive`` and put first on the child's ``PYTHONPATH``), rounds alternating
between the two trees with the order swapped each round; ``vs_client_cpu_per_token`` is ``REV``'s,
``client_ratio`` ``REV``'s ÷ this tree's (the median of the rounds' ratios, with ``_min`` and
``_max``): how many times less CPU a token costs now.

    python benchmarks/bench_client_cpu.py [--quick] [--json] [--vs REV] [--tokens N] [--requests N]
                                          [--concurrency N] [--rounds N] [--burst N] [--gap-ms G]
"""

from __future__ import annotations

import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _report import Report, base_parser
from router_peers import free_port
from tracing_overhead import export_tree

HOST = "127.0.0.1"
HERE = Path(__file__).resolve().parent
BURST = 16
"""Events the server writes at a time (a server stepping a batch sends several tokens together)."""

_DRIVER = """
import asyncio, json, sys, time
from pdrouter.bench.client import CompletionsClient
from pdrouter.bench.workload import RequestSpec

url, requests, concurrency, tokens = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])

async def main():
    client = CompletionsClient(url, "m")
    async def batch(n):
        pending = list(range(n))
        records = []
        async def caller():
            while pending:
                i = pending.pop()
                records.append(await client.send(RequestSpec(i, tuple(range(64)), tokens), 0.0, 0.0))
        await asyncio.gather(*(caller() for _ in range(concurrency)))
        return records
    await batch(concurrency)  # connections opened and code warm before the clock
    cpu = time.process_time()
    records = await batch(requests)
    cpu = time.process_time() - cpu
    await client.close()
    errors = sorted({f"{r.error}: {r.detail}" for r in records if r.error})
    print(json.dumps({"cpu_s": cpu, "tokens": sum(r.output_tokens for r in records),
                      "timed": sum(len(r.itl_s) + (r.ttft_s is not None) for r in records), "errors": errors}))

try:
    from pdrouter.core.aio import run_on_event_loop  # the loop pdrouter bench runs its client on
except ImportError:  # an older tree: its pdrouter bench ran on asyncio's own loop
    run_on_event_loop = asyncio.run
run_on_event_loop(main())
"""


def start_server(tokens: int, burst: int = BURST, gap_ms: float = 0.0) -> tuple[subprocess.Popen[bytes], str]:
    """``_instant_worker.py`` streaming ``tokens`` tokens an answer, ``burst`` a write, ``gap_ms`` between writes;
    it and its base URL, once it listens."""
    port = free_port()
    server = subprocess.Popen([sys.executable, str(HERE / "_instant_worker.py"), "--port", str(port),
                               "--tokens", str(tokens), "--burst", str(burst), "--gap-ms", f"{gap_ms:g}"])
    deadline = time.monotonic() + 30
    while True:
        try:
            socket.create_connection((HOST, port), timeout=1).close()
            return server, f"http://{HOST}:{port}/v1"
        except OSError:
            if server.poll() is not None or time.monotonic() > deadline:
                server.kill()
                raise SystemExit("the instant server did not start") from None
            time.sleep(0.1)


def drive(tree: Path | None, url: str, requests: int, concurrency: int, tokens: int) -> dict[str, object]:
    """One round of a tree's client in a process of its own: its CPU seconds and tokens."""
    env = dict(os.environ)
    if tree is not None:  # PYTHONSAFEPATH: the working directory (this checkout) must not come first
        env.update(PYTHONPATH=str(tree), PYTHONSAFEPATH="1")
    done = subprocess.run([sys.executable, "-c", _DRIVER, url, str(requests), str(concurrency), str(tokens)],
                          env=env, capture_output=True, text=True, timeout=600)
    if done.returncode != 0:
        raise SystemExit(f"the client of {tree or 'this tree'} failed:\n{done.stderr.strip()[-2000:]}")
    result: dict[str, object] = json.loads(done.stdout.strip().splitlines()[-1])
    if result["errors"]:
        raise SystemExit(f"the client of {tree or 'this tree'} recorded errors: {result['errors']}")
    if result["tokens"] != requests * tokens or result["timed"] != requests * tokens:
        raise SystemExit(f"expected {requests * tokens} tokens, the client counted {result['tokens']} "
                         f"and timed {result['timed']}")
    return result


def main() -> None:
    parser = base_parser(__doc__ or "")
    parser.add_argument("--vs", default=None, metavar="REV", help="also measure this commit's client, in turn")
    parser.add_argument("--tokens", type=int, default=256, help="tokens streamed per request")
    parser.add_argument("--requests", type=int, default=None, help="requests per round (default 200; --quick 64)")
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=None, help="rounds (default 5; --quick 2)")
    parser.add_argument("--burst", type=int, default=BURST,
                        help=f"events the server writes at a time (default {BURST})")
    parser.add_argument("--gap-ms", type=float, default=0.0,
                        help="milliseconds between the server's writes (default 0)")
    args = parser.parse_args()
    requests = args.requests or (64 if args.quick else 200)
    rounds = args.rounds or (2 if args.quick else 5)
    if min(args.tokens, requests, args.concurrency, rounds, args.burst) < 1 or args.gap_ms < 0:
        parser.error("--tokens, --requests, --concurrency, --rounds and --burst must be at least 1, --gap-ms 0 or more")
    report = Report()
    report.add("tokens_per_request", args.tokens, "tokens")
    report.add("concurrency", args.concurrency, "requests")
    report.add("burst", args.burst, "events/write")
    report.add("gap", args.gap_ms, "ms")
    with tempfile.TemporaryDirectory(prefix="bench-client-cpu-") as tmp:
        trees: list[tuple[str, Path | None]] = [("now", None)]
        if args.vs:
            trees.append(("vs", export_tree(args.vs, Path(tmp) / "vs")))
        server, url = start_server(args.tokens, args.burst, args.gap_ms)
        try:
            per_token: dict[str, list[float]] = {label: [] for label, _ in trees}
            for r in range(rounds):
                for label, tree in trees if r % 2 == 0 else list(reversed(trees)):
                    result = drive(tree, url, requests, args.concurrency, args.tokens)
                    per_token[label].append(float(result["cpu_s"]) / float(result["tokens"]))  # type: ignore[arg-type]
        finally:
            server.terminate()
            server.wait(10)
    mine = per_token["now"]
    report.add("client_cpu_per_token", statistics.median(mine) * 1e6, "us/token")
    report.add("client_cpu_per_request", statistics.median(mine) * args.tokens * 1e6, "us/req")
    if args.vs:
        theirs = per_token["vs"]
        ratios = [b / a for a, b in zip(mine, theirs, strict=True)]
        report.add("vs_client_cpu_per_token", statistics.median(theirs) * 1e6, "us/token")
        report.add("client_ratio", statistics.median(ratios), "x")
        report.add("client_ratio_min", min(ratios), "x")
        report.add("client_ratio_max", max(ratios), "x")
    report.emit(args.json)


if __name__ == "__main__":
    main()
