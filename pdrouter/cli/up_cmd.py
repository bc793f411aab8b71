"""``pdrouter up``: an embedded Redis, workers and a router on a small model, in one command.

It makes the model if the folder is missing, starts every part as a child process, prints the
endpoints and a sample request, and stops everything on Ctrl-C (``--once`` instead sends the
sample request itself, prints the answer and stops).
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import signal
import sys
import threading
import urllib.request
from pathlib import Path

from pdrouter.cli.local_cluster import ManagedProcess, cores_each, worker_args
from pdrouter.cli.worker_cmd import TORCH_THREADS_ENV
from pdrouter.core.errors import ConfigError, UnavailableError

DEFAULT_MODEL_DIR = Path(".pdrouter") / "models" / "tiny"


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("up", help="run a local cluster: embedded Redis + workers + router on a small model",
                       description="Bring up an embedded Redis, prefill/decode (or colocated) workers and a "
                                   "router on a small model; Ctrl-C stops everything.")
    p.add_argument("--mode", choices=["disaggregated", "colocated"], default="disaggregated")
    p.add_argument("--model", type=Path, default=DEFAULT_MODEL_DIR,
                   help=f"model folder; created with --preset if missing (default {DEFAULT_MODEL_DIR})")
    p.add_argument("--preset", default="tiny", help="preset for a missing model folder (tiny | small)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--http-port", type=int, default=8000)
    p.add_argument("--grpc-port", type=int, default=50051)
    p.add_argument("--prefill", type=int, default=1, help="prefill workers (disaggregated)")
    p.add_argument("--decode", type=int, default=1, help="decode workers (disaggregated)")
    p.add_argument("--workers", type=int, default=1, help="colocated workers (colocated)")
    p.add_argument("--num-blocks", type=int, default=512, help="KV blocks per worker")
    p.add_argument("--kv-backend", choices=["tcp", "gloo"], default="tcp")
    p.add_argument("--once", action="store_true", help="answer one sample request, print it, and stop")
    p.add_argument("--log-dir", type=Path, default=None, help="write each child's output to a file here")
    p.set_defaults(func=run)


def sample_request(host: str, port: int, model: str) -> dict[str, object]:
    body = json.dumps({"model": model, "prompt": "The capital of France is", "max_tokens": 16,
                       "temperature": 0}).encode()
    req = urllib.request.Request(f"http://{host}:{port}/v1/completions", data=body,
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as resp:
        return dict(json.loads(resp.read()))


def run(args: argparse.Namespace) -> int:
    from pdrouter.engine.model_io import make_model
    from pdrouter.state.embedded_redis import EmbeddedRedis

    counts = [args.prefill, args.decode] if args.mode == "disaggregated" else [args.workers]
    if any(n < 1 for n in counts) or args.num_blocks < 1:
        raise ConfigError("worker counts and --num-blocks must be >= 1")
    if not (args.model / "config.json").is_file():
        print(f"creating the {args.preset} model in {args.model}", flush=True)
        make_model(args.preset, args.seed, args.model)
    model_name = args.model.name
    env = {"PDROUTER_KV_TOKEN": os.environ.get("PDROUTER_KV_TOKEN") or secrets.token_hex(16)}
    if args.log_dir:
        args.log_dir.mkdir(parents=True, exist_ok=True)
    procs: list[ManagedProcess] = []
    stop = threading.Event()
    previous = {sig: signal.signal(sig, lambda *_: stop.set()) for sig in (signal.SIGINT, signal.SIGTERM)}

    def spawn(name: str, argv: list[str]) -> ManagedProcess:
        log = args.log_dir / f"{name}.log" if args.log_dir else None
        proc = ManagedProcess(name, argv, env=env, log_file=log)
        procs.append(proc)
        return proc

    with EmbeddedRedis() as redis_server:
        try:
            print(f"redis      {redis_server.url}", flush=True)
            roles = ([("prefill", args.prefill), ("decode", args.decode)] if args.mode == "disaggregated"
                     else [("worker", args.workers)])
            # The workers split the cores, the router counting as one (unless the environment says).
            threads = None if os.environ.get(TORCH_THREADS_ENV) else cores_each(1 + sum(n for _, n in roles))
            workers = [spawn(f"{role}-{i}", worker_args(role, args.model, redis_url=redis_server.url,
                                                        num_blocks=args.num_blocks, kv_backend=args.kv_backend,
                                                        torch_threads=threads,
                                                        extra=("--worker-id", f"{role}-{i}")))
                       for role, n in roles for i in range(n)]
            for w in workers:
                print(f"{w.name:<10} {w.wait_ready()}", flush=True)
            router = spawn("router", ["router", "--model", str(args.model), "--redis", redis_server.url,
                                      "--mode", args.mode, "--host", args.host, "--http-port", str(args.http_port),
                                      "--grpc-port", str(args.grpc_port), "--log-level", "WARNING"])
            http = router.wait_ready()
            host, _, port = http.rpartition(":")
            print(f"router     http://{http}/v1  (OpenAI API)   grpc {router.grpc_address}", flush=True)
            print(f"metrics    http://{http}/metrics", flush=True)
            if args.once:
                answer = sample_request(host, int(port), model_name)
                print(json.dumps(answer, indent=2), flush=True)
                return 0
            print(f"\ntry:\n  curl -s http://{http}/v1/completions -H 'Content-Type: application/json' \\\n"
                  f"    -d '{{\"model\": \"{model_name}\", \"prompt\": \"Hello\", \"max_tokens\": 16}}'\n"
                  "\nCtrl-C stops everything.", flush=True)
            while not stop.wait(0.5):
                dead = [p for p in procs if not p.alive]
                if dead:
                    tails = "\n".join(f"--- {p.name}\n" + "\n".join(list(p.tail)[-20:]) for p in dead)
                    raise UnavailableError(f"{', '.join(p.name for p in dead)} exited:\n{tails}")
            return 0
        finally:
            print("stopping...", file=sys.stderr, flush=True)
            for proc in reversed(procs):
                proc.stop()
            for sig, handler in previous.items():
                signal.signal(sig, handler)
