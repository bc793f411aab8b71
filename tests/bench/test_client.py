"""The load generator's client against a real HTTP server that streams chosen chunks."""

from __future__ import annotations

import asyncio
import json

from pdrouter.bench.client import CompletionsClient
from pdrouter.bench.workload import RequestSpec

GAP_S = 0.3
"""The server's pause after its first chunk: the first gap holds it, the time to first token does not."""


def _event(text: str, finish: str | None = None) -> bytes:
    body = {"id": "c", "object": "text_completion", "choices": [{"index": 0, "text": text, "finish_reason": finish}]}
    return b"data: " + json.dumps(body).encode() + b"\n\n"


async def _serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    head = await reader.readuntil(b"\r\n\r\n")
    length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n")
                  if line.lower().startswith(b"content-length"))
    await reader.readexactly(length)
    writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n")

    def chunk(data: bytes) -> None:
        writer.write(b"%x\r\n%s\r\n" % (len(data), data))

    chunk(_event(""))  # the first byte of a two-byte character: a token, no text yet
    await writer.drain()
    await asyncio.sleep(GAP_S)
    chunk(_event("é"))
    chunk(_event("!", "length"))
    usage = {"id": "c", "object": "text_completion", "choices": [],
             "usage": {"prompt_tokens": 3, "completion_tokens": 3, "total_tokens": 6}}
    chunk(b"data: " + json.dumps(usage).encode() + b"\n\n" + b"data: [DONE]\n\n")
    chunk(b"")
    await writer.drain()
    writer.close()


async def test_a_chunk_with_empty_text_is_the_first_token() -> None:
    """As ``vllm bench serve`` times it: a chunk with a choice is a token step, its text empty or not."""
    server = await asyncio.start_server(_serve, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    client = CompletionsClient(f"http://127.0.0.1:{port}/v1", "m")
    try:
        record = await client.send(RequestSpec(0, (1, 2, 3), 3), 0.0, 0.0)
    finally:
        await client.close()
        server.close()
    assert record.ok, record.detail
    assert record.output_tokens == 3
    assert len(record.itl_s) == 2  # three token chunks
    assert record.ttft_s is not None and record.e2e_s is not None
    assert record.itl_s[0] >= GAP_S > record.ttft_s  # the first token came before the pause, its text after
