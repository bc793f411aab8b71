"""An instant OpenAI-style worker for router benchmarks: answers every generation at once, no model.

It serves what SGLang's and vLLM's routers ask of a worker: ``POST /v1/completions``,
``/v1/chat/completions`` and ``/generate`` (whole or as server-sent events), and the probes they make
at start and while running (``/health``, ``/health_generate``, ``/v1/models``, ``/get_server_info``,
``/server_info``, ``/get_model_info``, ``/model_info``, ``/get_load``, ``/metrics``, ``/version``,
``/flush_cache``, ``/tokenize``, ``/v1/completions/render``). Roles: ``regular``; ``prefill`` answers one
token and, when asked with vLLM's ``kv_transfer_params.do_remote_decode``, returns the parameters a
decode worker would need; ``decode`` generates as ``regular``. SGLang's bootstrap fields are accepted
and ignored.

HTTP/1.1 with keep-alive over asyncio, parsed by ``httptools`` (a dependency already): one process,
one event loop, a few tens of microseconds of CPU a request, so that what a router adds stands out.

A streamed answer goes in one write, or (``--burst N``) N events at a time with the event loop let
run between writes, as from a server stepping a batch: what a client reading the stream pays per read.
``--gap-ms G`` waits G milliseconds between those writes instead, as a server's steps take time: each
read then finds one write (``--burst 1``: one token a read, as a stream at a simulated GPU's pace).

    python benchmarks/_instant_worker.py --port 18201 [--role regular|prefill|decode] [--tokens 16] [--burst N]
                                         [--gap-ms G]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import signal
import time
from collections.abc import Callable
from typing import Any

import httptools

MODEL = "instant-model"
_ids = itertools.count()


def _json(obj: object) -> bytes:
    return json.dumps(obj, separators=(",", ":")).encode()


class Worker:
    """The answers, by path and role."""

    def __init__(self, role: str, tokens: int, port: int, bootstrap_port: int | None) -> None:
        self.role, self.tokens, self.port = role, tokens, port
        self.inflight = 0
        created = int(time.time())
        self.created = created
        info = {"served_model_name": MODEL, "tp_size": 1, "dp_size": 1, "pp_size": 1,
                "disaggregation_mode": "null" if role == "regular" else role,
                "disaggregation_bootstrap_port": bootstrap_port, "max_total_num_tokens": 1_000_000,
                "max_running_requests": 4096, "context_length": 32768, "is_embedding": False,
                "version": "instant-0", "status": "ready",
                "internal_states": [{"last_gen_throughput": 0.0, "load": 0}]}
        # No model_path: a router that sees one tries to load that tokenizer from a hub.
        model_info = {"is_generation": True, "model_type": "llama", "architectures": ["LlamaForCausalLM"],
                      "has_image_understanding": False, "has_audio_understanding": False,
                      "weight_version": "default", "preferred_sampling_params": None}
        models = {"object": "list", "data": [{"id": MODEL, "object": "model", "created": created,
                                              "owned_by": "bench", "root": MODEL, "max_model_len": 32768}]}
        self.static = {"/v1/models": _json(models), "/get_server_info": _json(info), "/server_info": _json(info),
                       "/get_model_info": _json(model_info), "/model_info": _json(model_info),
                       "/version": _json({"version": "instant-0"}), "/health": b"", "/health_generate": b"",
                       "/flush_cache": b"", "/liveness": b"", "/readiness": b""}

    def answer(self, method: str, path: str, body: bytes) -> tuple[int, str, bytes | list[bytes]]:
        """(status, content type, body or SSE events) for one request."""
        if path in self.static:
            return 200, "application/json", self.static[path]
        if path == "/get_load":
            return 200, "application/json", _json([{"dp_rank": 0, "num_reqs": self.inflight,
                                                    "num_waiting_reqs": 0, "num_tokens": self.inflight * 100}])
        if path == "/metrics":
            return 200, "text/plain", f"instant_inflight {self.inflight}\n".encode()
        if method != "POST":
            return 404, "application/json", _json({"error": f"no route {method} {path}"})
        try:
            req = json.loads(body) if body else {}
        except ValueError:
            return 400, "application/json", _json({"error": "the body is not JSON"})
        if not isinstance(req, dict):
            return 400, "application/json", _json({"error": "the body is not a JSON object"})
        if path in ("/tokenize", "/v1/completions/render", "/v1/chat/completions/render"):
            text = req.get("prompt") or req.get("text") or ""
            ids = list(range(max(1, len(str(text)) // 4)))
            return 200, "application/json", _json({"tokens": ids, "count": len(ids), "prompt_token_ids": ids,
                                                   "max_model_len": 32768})
        if path not in ("/v1/completions", "/v1/chat/completions", "/generate"):
            return 404, "application/json", _json({"error": f"no route {method} {path}"})
        return self._generate(path, req)

    def _generate(self, path: str, req: dict[str, Any]) -> tuple[int, str, bytes | list[bytes]]:
        n = 1 if self.role == "prefill" else self.tokens
        rid = req.get("rid") or req.get("request_id")
        rid = rid if isinstance(rid, str) else f"instant-{self.port}-{next(_ids)}"
        prompt = req.get("prompt", req.get("text", ""))
        prompt_tokens = len(prompt) if isinstance(prompt, list) else max(1, len(str(prompt)) // 4)
        kv = req.get("kv_transfer_params")
        kv_out = None
        if isinstance(kv, dict) and kv.get("do_remote_decode"):
            kv_out = {"do_remote_prefill": True, "do_remote_decode": False,
                      "remote_engine_id": f"instant-{self.port}", "remote_block_ids": [0],
                      "remote_host": "127.0.0.1", "remote_port": self.port, "remote_request_id": rid, "tp_size": 1}
        usage = {"prompt_tokens": prompt_tokens, "completion_tokens": n, "total_tokens": prompt_tokens + n}
        model = req.get("model", MODEL)
        if not req.get("stream"):
            if path == "/generate":
                out: dict[str, Any] = {"text": "a" * n, "meta_info": {"id": rid, "prompt_tokens": prompt_tokens,
                                                                        "completion_tokens": n,
                                                                        "finish_reason": {"type": "length"}}}
            elif path == "/v1/chat/completions":
                out = {"id": f"chatcmpl-{rid}", "object": "chat.completion", "created": self.created, "model": model,
                       "choices": [{"index": 0, "message": {"role": "assistant", "content": "a" * n},
                                    "finish_reason": "length"}], "usage": usage}
            else:
                out = {"id": f"cmpl-{rid}", "object": "text_completion", "created": self.created, "model": model,
                       "choices": [{"index": 0, "text": "a" * n, "logprobs": None, "finish_reason": "length"}],
                       "usage": usage}
            if kv_out is not None:
                out["kv_transfer_params"] = kv_out
            return 200, "application/json", _json(out)
        events = []
        for i in range(n):
            last = i == n - 1
            if path == "/generate":
                chunk: dict[str, Any] = {"text": "a" * (i + 1), "meta_info": {
                    "id": rid, "completion_tokens": i + 1, "finish_reason": {"type": "length"} if last else None}}
            elif path == "/v1/chat/completions":
                chunk = {"id": f"chatcmpl-{rid}", "object": "chat.completion.chunk", "created": self.created,
                         "model": model, "choices": [{"index": 0, "delta": {"content": "a"},
                                                      "finish_reason": "length" if last else None}]}
            else:
                chunk = {"id": f"cmpl-{rid}", "object": "text_completion", "created": self.created, "model": model,
                         "choices": [{"index": 0, "text": "a", "logprobs": None,
                                      "finish_reason": "length" if last else None}]}
            if last and kv_out is not None:
                chunk["kv_transfer_params"] = kv_out
            events.append(b"data: " + _json(chunk) + b"\n\n")
        events.append(b"data: [DONE]\n\n")
        return 200, "text/event-stream", events


class Connection(asyncio.Protocol):
    """One client connection: parse requests as they come, answer each in order."""

    def __init__(self, worker: Worker, burst: int = 0, gap_s: float = 0.0) -> None:
        self.worker = worker
        self.burst = burst
        self.gap_s = gap_s
        self.parser = httptools.HttpRequestParser(self)
        self.transport: asyncio.Transport | None = None
        self.url = b""
        self.body: list[bytes] = []

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError:
            if self.transport is not None:
                self.transport.write(b"HTTP/1.1 400 Bad Request\r\ncontent-length: 0\r\nconnection: close\r\n\r\n")
                self.transport.close()

    def on_url(self, url: bytes) -> None:
        self.url += url

    def on_message_begin(self) -> None:
        self.url, self.body = b"", []

    def on_body(self, body: bytes) -> None:
        self.body.append(body)

    def on_message_complete(self) -> None:
        transport = self.transport
        if transport is None:
            return
        path = httptools.parse_url(self.url).path.decode()
        method = self.parser.get_method().decode()
        self.worker.inflight += 1
        try:
            status, kind, body = self.worker.answer(method, path, b"".join(self.body))
        finally:
            self.worker.inflight -= 1
        reason = {200: "OK", 400: "Bad Request", 404: "Not Found"}[status]
        if isinstance(body, bytes):
            transport.write(f"HTTP/1.1 {status} {reason}\r\ncontent-type: {kind}\r\n"
                            f"content-length: {len(body)}\r\n\r\n".encode() + body)
        else:
            parts = [f"HTTP/1.1 200 OK\r\ncontent-type: {kind}\r\ncache-control: no-cache\r\n"
                     "transfer-encoding: chunked\r\n\r\n".encode()]
            parts += [f"{len(event):x}\r\n".encode() + event + b"\r\n" for event in body]
            parts.append(b"0\r\n\r\n")
            if self.burst:
                asyncio.get_running_loop().create_task(self._write_bursts(transport, parts))
                return
            transport.write(b"".join(parts))
        if not self.parser.should_keep_alive():
            transport.close()

    async def _write_bursts(self, transport: asyncio.Transport, parts: list[bytes]) -> None:
        """The head and ``burst`` events a write, the loop let run (``gap_s``) between writes (a client does not
        pipeline)."""
        keep_alive = self.parser.should_keep_alive()
        transport.write(parts[0])
        for start in range(1, len(parts), self.burst):
            await asyncio.sleep(self.gap_s)
            transport.write(b"".join(parts[start:start + self.burst]))
        if not keep_alive:
            transport.close()


async def serve_until_stopped(protocol: Callable[[], asyncio.Protocol], port: int) -> None:
    """Serve ``protocol`` on 127.0.0.1:``port`` until SIGTERM or SIGINT."""
    loop = asyncio.get_running_loop()
    server = await loop.create_server(protocol, "127.0.0.1", port, backlog=1024)
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    async with server:
        await stop.wait()


async def serve(port: int, role: str, tokens: int, bootstrap_port: int | None, burst: int = 0,
                gap_s: float = 0.0) -> None:
    worker = Worker(role, tokens, port, bootstrap_port)
    await serve_until_stopped(lambda: Connection(worker, burst, gap_s), port)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--role", choices=["regular", "prefill", "decode"], default="regular")
    parser.add_argument("--tokens", type=int, default=16, help="tokens in every answer (prefill: 1)")
    parser.add_argument("--bootstrap-port", type=int, default=None, help="reported to SGLang's PD router")
    parser.add_argument("--burst", type=int, default=0,
                        help="write a streamed answer this many events at a time (0: all in one write)")
    parser.add_argument("--gap-ms", type=float, default=0.0,
                        help="with --burst: milliseconds between a stream's writes (default 0)")
    args = parser.parse_args()
    if args.burst < 0 or args.gap_ms < 0:
        parser.error("--burst and --gap-ms must be 0 or more")
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(serve(args.port, args.role, args.tokens, args.bootstrap_port, args.burst, args.gap_ms / 1000))


if __name__ == "__main__":
    main()
