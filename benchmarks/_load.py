"""Load-generator pieces the router benchmarks share: front-door clients and a process's CPU time."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import time
from collections.abc import Iterator
from pathlib import Path

import grpc

from pdrouter.wire.grpc_util import CHANNEL_OPTIONS
from pdrouter.wire.v1 import common_pb2, router_pb2, router_pb2_grpc


def cpu_times(pid: int) -> tuple[float, float]:
    """User and system CPU seconds of process ``pid`` (all its threads) so far (clock ticks: 10 ms)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    tick = os.sysconf("SC_CLK_TCK")
    return int(fields[11]) / tick, int(fields[12]) / tick


def cpu_seconds(pid: int) -> float:
    """CPU seconds of process ``pid`` (all its threads, those gone included) so far, to the nanosecond.

    Reads the process's CPU-time clock (Linux: ``clock_getcpuclockid`` is ``~pid << 3 | 2``, the
    scheduler's clock); ``/proc/<pid>/stat`` counts in 10 ms ticks, coarse next to the ~250 µs
    per request measured over a few hundred milliseconds. Elsewhere, the ticks.
    """
    try:
        return time.clock_gettime(((~pid) << 3) | 2)
    except (OSError, OverflowError, AttributeError):
        return sum(cpu_times(pid))


class HttpCompletions:
    """``POST /v1/completions`` over one keep-alive connection per slot (a minimal HTTP/1.1 client).

    Minimal on purpose: the load generator's own CPU stays small next to the server's. ``prompts``,
    when given, gives each request's prompt (text or ids) in place of ``ids``, e.g. shared prefixes
    with unique suffixes.
    """

    def __init__(self, host: str, port: int, model: str, ids: list[int], max_tokens: int, stream: bool,
                 prompts: Iterator[str | list[int]] | None = None,
                 connections: dict[int, tuple[asyncio.StreamReader, asyncio.StreamWriter]] | None = None) -> None:
        """``connections``: the slots' connections, to share with other clients of the same server."""
        self._host, self._port = host, port
        self._fields = {"model": model, "prompt": ids, "max_tokens": max_tokens, "temperature": 0,
                        "ignore_eos": True, "stream": stream}
        self._prompts = prompts
        self._request = self._encode(ids)
        self._conns = connections if connections is not None else {}
        self.events = 0
        """Chunks of streamed bodies received so far (each one a write of the server's)."""

    def _encode(self, prompt: str | list[int]) -> bytes:
        body = json.dumps({**self._fields, "prompt": prompt}).encode()
        return (f"POST /v1/completions HTTP/1.1\r\nhost: {self._host}:{self._port}\r\n"
                f"content-type: application/json\r\ncontent-length: {len(body)}\r\n\r\n").encode() + body

    async def once(self, slot: int) -> tuple[float, float]:
        """One request on connection ``slot``: (seconds to the last byte, seconds to the first token)."""
        conn = self._conns.get(slot)
        if conn is None or conn[0].at_eof():  # new, or closed by the server's keep-alive timeout
            conn = self._conns[slot] = await asyncio.open_connection(self._host, self._port)
        reader, writer = conn
        request = self._request if self._prompts is None else self._encode(next(self._prompts))
        start = time.perf_counter()
        writer.write(request)
        head = await reader.readuntil(b"\r\n\r\n")
        first = time.perf_counter() - start
        if not head.startswith(b"HTTP/1.1 200"):
            raise RuntimeError(f"the front door answered {head!r}")
        headers = head.lower()
        if b"transfer-encoding: chunked" not in headers:
            length = int(headers.split(b"content-length:", 1)[1].split(b"\r\n", 1)[0])
            body = await reader.readexactly(length)
            if b'"finish_reason"' not in body:
                raise RuntimeError(f"unexpected completion {body!r}")
            return time.perf_counter() - start, first
        first, last = 0.0, b""
        while True:
            size = int((await reader.readuntil(b"\r\n")).split(b";", 1)[0], 16)
            if size == 0:
                await reader.readuntil(b"\r\n")
                break
            last = await reader.readexactly(size + 2)
            self.events += 1
            if not first and b"data:" in last:
                first = time.perf_counter() - start
        if b"[DONE]" not in last:
            raise RuntimeError(f"the stream did not end with [DONE]: {last!r}")
        return time.perf_counter() - start, first

    async def close(self) -> None:
        for _, writer in self._conns.values():
            writer.close()
            with contextlib.suppress(OSError):
                await writer.wait_closed()


class RouterGenerate:
    """``pdrouter.v1.Router.Generate`` with the prompt's token ids, on one channel (``texts``, when
    given: each request's prompt text instead)."""

    def __init__(self, address: str, model: str, ids: list[int], max_tokens: int,
                 texts: Iterator[str] | None = None) -> None:
        self._channel = grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS)
        self._stub = router_pb2_grpc.RouterStub(self._channel)
        self._request = router_pb2.GenerateRequest(
            model=model, token_ids=router_pb2.TokenIds(ids=ids),
            sampling=common_pb2.SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))
        self._texts = texts
        self._max_tokens = max_tokens
        self.messages = 0
        """Responses received so far."""

    async def once(self, slot: int) -> tuple[float, float]:
        """One request: (seconds to the stream's end, seconds to its first message)."""
        request = self._request
        if self._texts is not None:
            request = router_pb2.GenerateRequest(model=request.model, text=next(self._texts), sampling=request.sampling)
        start = time.perf_counter()
        first, tokens = 0.0, 0
        async for msg in self._stub.Generate(request):
            if not first:
                first = time.perf_counter() - start
            tokens += len(msg.token_ids)
            self.messages += 1
        if tokens != self._max_tokens:
            raise RuntimeError(f"Generate returned {tokens} tokens, expected {self._max_tokens}")
        return time.perf_counter() - start, first

    async def close(self) -> None:
        await self._channel.close()
