#!/usr/bin/env python3
"""Client probes of a running compose cluster, for scripts/compose_check.sh (run with the venv's python).

Each subcommand prints one line saying what it saw and exits 0, or prints one line starting
``FAIL:`` and exits 1:

    compose_probe.py completion  --http URL --key KEY     # the official openai client
    compose_probe.py chat-stream --http URL --key KEY     # a streamed chat completion (openai)
    compose_probe.py models      --http URL --key KEY     # /v1/models (openai)
    compose_probe.py grpc        --grpc HOST:PORT --key KEY   # pdrouter.v1.Router/Generate
    compose_probe.py metrics     --http URL --key KEY     # GET /metrics, Prometheus text
    compose_probe.py kv-received --http URL --key KEY     # per decode worker, the KV bytes it received
                                                          # (the router's /metrics, from heartbeats)
    compose_probe.py served      --http URL --key KEY [--count N]   # N completions, all 200 (retried
                                                          # while the cluster comes back)
    compose_probe.py load        --http URL --key KEY --stop-file F  # completions until F exists;
                                                          # every failure must be a clean HTTP error

The prompts are long enough (over the router's --local-prefill-tokens) that a prefill worker,
not the decode worker, computes them.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

MODEL = "tiny"
PROMPT = ("Compose check, request {i}: the quick brown fox jumps over the lazy dog while the five boxing "
          "wizards jump quickly and a wizard's job is to vex chumps quickly in fog.")


class ProbeError(Exception):
    """The probe saw something wrong (its message is the FAIL line)."""


def openai_client(args: argparse.Namespace, timeout: float = 60.0) -> Any:
    from openai import OpenAI

    return OpenAI(base_url=f"{args.http}/v1", api_key=args.key, timeout=timeout, max_retries=0)


def probe_completion(args: argparse.Namespace) -> str:
    reply = openai_client(args).completions.create(model=MODEL, prompt=PROMPT.format(i=0), max_tokens=16,
                                                   temperature=0)
    choice = reply.choices[0]
    usage = reply.usage
    if usage is None or usage.completion_tokens < 1 or not isinstance(choice.text, str):
        raise ProbeError(f"completion without tokens: {reply}")
    return (f"{usage.prompt_tokens} prompt + {usage.completion_tokens} completion tokens, "
            f"finish_reason {choice.finish_reason}")


def probe_chat_stream(args: argparse.Namespace) -> str:
    stream = openai_client(args).chat.completions.create(
        # 48 tokens: a router behind its workers sends the chunks already waiting as one, and 16 tiny-model
        # tokens came in 3 chunks on an idle machine; the check is that the answer streams at all.
        model=MODEL, messages=[{"role": "user", "content": PROMPT.format(i=1)}], max_tokens=48, stream=True,
        temperature=0)
    chunks = 0
    text = ""
    finish = None
    for chunk in stream:
        chunks += 1
        for choice in chunk.choices:
            text += choice.delta.content or ""
            finish = choice.finish_reason or finish
    if finish is None:
        raise ProbeError(f"stream ended after {chunks} chunks without a finish_reason")
    if chunks < 2:
        raise ProbeError(f"the whole answer came in one chunk (finish_reason {finish}): not streamed")
    return f"{chunks} chunks, {len(text)} characters, finish_reason {finish}"


def probe_models(args: argparse.Namespace) -> str:
    ids = [m.id for m in openai_client(args).models.list().data]
    if MODEL not in ids:
        raise ProbeError(f"/v1/models lists {ids}, not {MODEL}")
    return f"models {ids}"


def probe_grpc(args: argparse.Namespace) -> str:
    import grpc

    from pdrouter.wire.v1 import common_pb2, router_pb2, router_pb2_grpc

    request = router_pb2.GenerateRequest(model=MODEL, text=PROMPT.format(i=2),
                                         sampling=common_pb2.SamplingParams(max_tokens=16, temperature=0))
    with grpc.insecure_channel(args.grpc) as channel:
        stub = router_pb2_grpc.RouterStub(channel)
        try:
            replies = list(stub.Generate(request, timeout=60, metadata=[("authorization", f"Bearer {args.key}")]))
        except grpc.RpcError as exc:
            raise ProbeError(f"Generate: {exc.code().name}: {exc.details()}") from None
        # Without the key the door is shut.
        try:
            list(stub.Generate(request, timeout=30))
            raise ProbeError("Generate without an API key was served")
        except grpc.RpcError as exc:
            if exc.code() != grpc.StatusCode.UNAUTHENTICATED:
                raise ProbeError(f"Generate without a key: {exc.code().name}, not UNAUTHENTICATED") from None
    tokens = sum(len(r.token_ids) for r in replies)
    last = replies[-1] if replies else None
    if last is None or last.finish_reason == common_pb2.FINISH_REASON_UNSPECIFIED or tokens < 1:
        raise ProbeError(f"Generate streamed {len(replies)} messages, {tokens} tokens, no finish")
    return (f"{len(replies)} messages, {tokens} tokens, {common_pb2.FinishReason.Name(last.finish_reason)}; "
            f"without a key UNAUTHENTICATED")


def _metrics_text(args: argparse.Namespace) -> str:
    """The router's ``/metrics`` page, asked with the key."""
    import httpx

    reply = httpx.get(f"{args.http}/metrics", headers={"Authorization": f"Bearer {args.key}"}, timeout=30)
    if reply.status_code != 200:
        raise ProbeError(f"/metrics answered HTTP {reply.status_code}")
    return reply.text


def probe_metrics(args: argparse.Namespace) -> str:
    import httpx

    samples = [line for line in _metrics_text(args).splitlines() if line and not line.startswith("#")]
    finished = sum(float(line.rsplit(" ", 1)[1]) for line in samples if line.startswith("pdrouter_requests_total{"))
    workers = sorted({line.split('worker="', 1)[1].split('"', 1)[0] for line in samples
                      if line.startswith("pdrouter_worker_info{")})
    if finished < 1 or not workers:
        raise ProbeError(f"/metrics: {finished:g} finished requests, workers {workers}")
    unauthorized = httpx.get(f"{args.http}/metrics", timeout=30).status_code
    if unauthorized != 401:
        raise ProbeError(f"/metrics without a key answered HTTP {unauthorized}, not 401")
    return f"{len(samples)} samples, pdrouter_requests_total {finished:g}, workers {workers}; without a key 401"


def probe_kv_received(args: argparse.Namespace) -> str:
    """``<worker> <bytes>`` for every decode worker the router reports, one a line (KV bytes received into
    its blocks since it started: ``pdrouter_worker_kv_transfer_bytes``, as of its last heartbeat)."""
    from prometheus_client.parser import text_string_to_metric_families

    received = {s.labels["worker"]: s.value for family in text_string_to_metric_families(_metrics_text(args))
                for s in family.samples if s.name == "pdrouter_worker_kv_transfer_bytes"
                and s.labels.get("role") == "decode" and s.labels.get("direction") == "received"}
    if not received:
        raise ProbeError("/metrics reports no decode worker's received KV bytes")
    return "\n".join(f"{worker} {value:.0f}" for worker, value in sorted(received.items()))


# -- load --------------------------------------------------------------------------------------


async def one_request(client: Any, i: int, timeout: float, max_tokens: int) -> str:
    """The outcome of one completion: ``ok``, ``http <status>`` (a clean error with an error body),
    ``unclean <what>`` or ``hung``."""
    import httpx

    body = {"model": MODEL, "prompt": PROMPT.format(i=i), "max_tokens": max_tokens, "temperature": 0}
    try:
        reply = await asyncio.wait_for(client.post("/v1/completions", json=body), timeout)
    except TimeoutError:
        return "hung"
    except httpx.HTTPError as exc:
        return f"unclean {type(exc).__name__}"
    if reply.status_code == 200:
        return "ok"
    try:
        error = reply.json()["error"]
        assert error["message"]
    except (ValueError, KeyError, TypeError, AssertionError):
        return f"unclean HTTP {reply.status_code} without an error body"
    return f"http {reply.status_code}"


async def load(args: argparse.Namespace) -> str:
    import httpx

    outcomes: Counter[str] = Counter()
    last_ok = 0.0
    counter = iter(range(1_000_000))
    stop = Path(args.stop_file)
    deadline = time.monotonic() + args.max_s
    headers = {"Authorization": f"Bearer {args.key}"}

    async def worker(client: httpx.AsyncClient) -> None:
        nonlocal last_ok
        while not stop.exists() and time.monotonic() < deadline:
            outcome = await one_request(client, next(counter) + 1000, args.timeout, args.max_tokens)
            outcomes[outcome] += 1
            if outcome == "ok":
                last_ok = time.monotonic()
            else:
                await asyncio.sleep(0.2)

    async with httpx.AsyncClient(base_url=args.http, headers=headers, timeout=args.timeout + 5) as client:
        started = time.monotonic()
        await asyncio.gather(*(worker(client) for _ in range(args.concurrency)))
        ended = time.monotonic()
    summary = ", ".join(f"{n} {k}" for k, n in sorted(outcomes.items()))
    bad = {k: n for k, n in outcomes.items() if k.startswith(("unclean", "hung"))}
    if bad:
        raise ProbeError(f"{summary}: requests that hung or failed uncleanly")
    if outcomes["ok"] == 0 or ended - last_ok > args.timeout + 2:
        raise ProbeError(f"{summary}: nothing served at the end of the load")
    if time.monotonic() >= deadline:
        raise ProbeError(f"{summary}: the load ran for its {args.max_s:g} s limit without being stopped")
    return f"{summary} in {ended - started:.0f} s"


def probe_load(args: argparse.Namespace) -> str:
    return asyncio.run(load(args))


async def served(args: argparse.Namespace) -> str:
    """``--count`` completions (``--concurrency`` at a time), all 200; 429/5xx retried until ``--retry-s``."""
    import httpx

    headers = {"Authorization": f"Bearer {args.key}"}
    deadline = time.monotonic() + args.retry_s
    retried: Counter[str] = Counter()
    semaphore = asyncio.Semaphore(args.concurrency)

    async def complete(client: httpx.AsyncClient, i: int) -> None:
        async with semaphore:
            while True:
                outcome = await one_request(client, i, args.timeout, args.max_tokens)
                if outcome == "ok":
                    return
                if time.monotonic() > deadline:
                    raise ProbeError(f"request {i}: {outcome} (still after {args.retry_s:g} s)")
                retried[outcome] += 1
                await asyncio.sleep(0.5)

    async with httpx.AsyncClient(base_url=args.http, headers=headers, timeout=args.timeout + 5) as client:
        await asyncio.gather(*(complete(client, args.first + i) for i in range(args.count)))
    extra = f" (retried: {', '.join(f'{n} {k}' for k, n in sorted(retried.items()))})" if retried else ""
    return f"{args.count} of {args.count} served{extra}"


def probe_served(args: argparse.Namespace) -> str:
    return asyncio.run(served(args))


PROBES = {"completion": probe_completion, "chat-stream": probe_chat_stream, "models": probe_models,
          "grpc": probe_grpc, "metrics": probe_metrics, "load": probe_load, "served": probe_served,
          "kv-received": probe_kv_received}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("probe", choices=sorted(PROBES))
    parser.add_argument("--http", default="http://127.0.0.1:8000", help="the router's HTTP base URL")
    parser.add_argument("--grpc", default="127.0.0.1:50051", help="the router's gRPC address")
    parser.add_argument("--key", required=True, help="an API key of the router")
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--timeout", type=float, default=60.0, help="seconds one request may take")
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--stop-file", default="", help="load: stop once this file exists")
    parser.add_argument("--max-s", type=float, default=300.0, help="load: fail when not stopped by then")
    parser.add_argument("--count", type=int, default=8, help="served: requests")
    parser.add_argument("--first", type=int, default=0, help="served: number of the first prompt")
    parser.add_argument("--retry-s", type=float, default=0.0, help="served: retry failures for this long")
    args = parser.parse_args(argv)
    try:
        print(PROBES[args.probe](args))
    except ProbeError as exc:
        print(f"FAIL: {exc}")
        return 1
    except Exception as exc:  # a client error is the probe's failure, in one line
        print(f"FAIL: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
