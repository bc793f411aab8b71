"""The token path end to end: a request taken whole answers exactly as one streamed token by token.

Real torch worker processes (so the text is the model's), real Redis, a real router; colocated,
disaggregated with the prompt computed on the prefill worker, and disaggregated with the decode
worker computing it. For the same greedy request:

* the OpenAI door unary (``whole``: the worker sends the tokens in one chunk; ``Serve`` the first
  one, with the prefill report, before them) and streamed, completions and chat, and the gRPC door
  (streamed, as before) all give the
  reference engine's text, finish_reason and usage: a max_tokens case, a stop string that cuts the
  output between tokens (unary and streamed: the text before it, usage counting the tokens up to
  the one that completed it), kept with ``include_stop_str_in_output``, and one that never appears;
* the router's own dispatcher with ``whole`` set gets the output in one delta (colocated) or at
  most two (``Serve``), the same tokens, reason and usage as without it; the gRPC door still
  streams message by message.
"""

from __future__ import annotations

import asyncio
import json
import socket
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import httpx
import pytest

from pdrouter.core.ids import RequestId
from pdrouter.core.sampling import SamplingParams
from pdrouter.core.tokenizer import load_tokenizer
from pdrouter.core.workers import WorkerRole
from pdrouter.engine.config import EngineConfig
from pdrouter.engine.torch_engine import TorchEngine
from pdrouter.router.dispatch import DispatchConfig
from pdrouter.router.request import RouterRequest, TokenDelta
from pdrouter.router.server import RouterProcess
from pdrouter.wire.v1 import common_pb2, router_pb2, router_pb2_grpc
from pdrouter.wire.worker_client import TokenStream

from .conftest import Cluster
from .test_router_e2e import wait_workers

PROMPT = "The quick brown fox"
MAX_TOKENS = 24
_FINISH = {common_pb2.FINISH_REASON_STOP: "stop", common_pb2.FINISH_REASON_LENGTH: "length"}


@dataclass(frozen=True)
class Answer:
    """What a client sees of one completion."""

    text: str
    finish_reason: str
    usage: tuple[int, int, int]
    """(prompt, completion, cached) tokens."""


def reference_ids(model: Path, prompt_ids: list[int], max_tokens: int) -> list[int]:
    engine = TorchEngine(EngineConfig(model_dir=model, num_blocks=128))
    return engine.generate([prompt_ids], SamplingParams(max_tokens=max_tokens, temperature=0.0))[0]


def cut_at(model: Path, ids: list[int], stop: str, include: bool) -> tuple[str, int] | None:
    """The text up to the first ``stop`` and the tokens it took to complete it (None: it never does)."""
    decoder = load_tokenizer(model).stream_decoder()
    text = ""
    for k, token in enumerate(ids):
        text += decoder.push([token])
        at = text.find(stop)
        if at != -1:
            return text[:at + len(stop)] if include else text[:at], k + 1
    return None


def a_stop_string(text: str) -> str:
    """Two characters from inside ``text`` (no U+FFFD, first seen after its start): a cut mid-output."""
    for i in range(1, len(text) - 2):
        stop = text[i:i + 2]
        if "\ufffd" not in stop and text.find(stop) == i:
            return stop
    raise AssertionError(f"no stop string to pick in {text!r}")


def _usage(usage: dict[str, Any]) -> tuple[int, int, int]:
    return usage["prompt_tokens"], usage["completion_tokens"], usage["prompt_tokens_details"]["cached_tokens"]


async def http_unary(client: httpx.AsyncClient, path: str, body: dict[str, Any]) -> Answer:
    reply = await client.post(path, json={**body, "stream": False})
    assert reply.status_code == 200, reply.text
    data = reply.json()
    choice = data["choices"][0]
    text = choice["message"]["content"] if "message" in choice else choice["text"]
    return Answer(text, choice["finish_reason"], _usage(data["usage"]))


async def http_stream(client: httpx.AsyncClient, path: str, body: dict[str, Any]) -> tuple[Answer, int]:
    """The streamed answer, and how many events carried text."""
    parts: list[str] = []
    finish, usage, events = "", None, 0
    async with client.stream("POST", path, json={**body, "stream": True,
                                                 "stream_options": {"include_usage": True}}) as reply:
        assert reply.status_code == 200
        async for line in reply.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            assert "error" not in chunk, chunk
            if chunk.get("usage"):
                usage = _usage(chunk["usage"])
            for choice in chunk["choices"]:
                piece = choice["delta"].get("content") or "" if "delta" in choice else choice["text"]
                events += bool(piece)
                parts.append(piece)
                finish = choice["finish_reason"] or finish
    assert usage is not None
    return Answer("".join(parts), finish, usage), events


async def grpc_generate(address: str, prompt: str, max_tokens: int) -> tuple[Answer, list[int], int]:
    """The gRPC door's answer, its tokens and how many messages brought them."""
    async with grpc.aio.insecure_channel(address) as channel:
        stub = router_pb2_grpc.RouterStub(channel)
        texts: list[str] = []
        ids: list[int] = []
        messages = 0
        last = None
        async for msg in stub.Generate(router_pb2.GenerateRequest(
                model="tiny", text=prompt, sampling=common_pb2.SamplingParams(max_tokens=max_tokens))):
            texts.append(msg.text)
            ids.extend(msg.token_ids)
            messages += 1
            last = msg
    assert last is not None
    usage = (last.usage.prompt_tokens, last.usage.completion_tokens, last.usage.cached_tokens)
    return Answer("".join(texts), _FINISH[last.finish_reason], usage), ids, messages


async def dispatched(router: RouterProcess, prompt_ids: list[int], whole: bool) -> list[TokenDelta]:
    assert router.dispatcher is not None
    request = RouterRequest(RequestId(f"direct-{whole}"), "tiny", tuple(prompt_ids),
                            SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0), whole=whole)
    return [delta async for delta in router.dispatcher.generate(request)]


MODES = {
    "colocated": ("colocated", ["worker"], 32),
    "prefill-worker": ("disaggregated", ["prefill", "decode"], 0),
    "decode-local": ("disaggregated", ["prefill", "decode"], 10_000),
}
"""Mode name: router mode, workers, ``local_prefill_tokens``."""


@pytest.mark.parametrize("mode", list(MODES))
async def test_whole_answers_equal_streamed_ones(cluster: Cluster, mode: str, monkeypatch: pytest.MonkeyPatch) -> None:
    router_mode, roles, local_prefill_tokens = MODES[mode]
    # The chunks a streamed HTTP response's sink took (``TokenSink``): written outside the stream.
    sunk: list[int] = []
    offered = TokenStream._offered

    def counted(stream: TokenStream, body: bytes) -> bool:
        took = offered(stream, body)
        sunk.append(took)
        return took

    monkeypatch.setattr(TokenStream, "_offered", counted)
    for role in roles:
        cluster.spawn(role)
    router = await cluster.router(router_mode, dispatch=DispatchConfig(mode=router_mode,  # type: ignore[arg-type]
                                                                     local_prefill_tokens=local_prefill_tokens))
    await wait_workers(router, {WorkerRole.COLOCATED: 1} if router_mode == "colocated"
                       else {WorkerRole.PREFILL: 1, WorkerRole.DECODE: 1})
    tokenizer = load_tokenizer(cluster.model)
    prompt_ids = tokenizer.encode(PROMPT)
    expected_ids = reference_ids(cluster.model, prompt_ids, MAX_TOKENS)
    assert len(expected_ids) == MAX_TOKENS  # the tiny model's greedy output runs to max_tokens
    full_text = tokenizer.decode(expected_ids)
    stop = a_stop_string(full_text)

    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{router.http_port}", timeout=60) as client:
        base = {"model": "tiny", "prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0}
        await http_unary(client, "/v1/completions", base)  # warm: every later request finds the same cache
        whole = await http_unary(client, "/v1/completions", base)
        cached = whole.usage[2]
        assert whole == Answer(full_text, "length", (len(prompt_ids), MAX_TOKENS, cached))
        streamed, events = await http_stream(client, "/v1/completions", base)
        assert streamed == whole
        assert events > 1  # it streamed (a router behind its worker may merge tokens, not all of them)
        assert sum(sunk) > 0  # later chunks went from the worker's call straight to the response

        # Stop strings: matched on the text, token by token, unary and streamed alike.
        cases = [(stop, False), (stop, True), ("\x00never\x00", False)]
        for stop_string, include in cases:
            body = {**base, "stop": [stop_string], "include_stop_str_in_output": include}
            cut = cut_at(cluster.model, expected_ids, stop_string, include)
            expected = (Answer(full_text, "length", (len(prompt_ids), MAX_TOKENS, cached)) if cut is None
                        else Answer(cut[0], "stop", (len(prompt_ids), cut[1], 0)))
            unary = await http_unary(client, "/v1/completions", body)
            streamed, _ = await http_stream(client, "/v1/completions", body)
            assert unary == streamed == expected, (stop_string, include)
            if cut is not None:
                assert 1 < cut[1] < MAX_TOKENS  # the stop string cut the output between tokens

        # Chat: the unary answer (whole) is the streamed one.
        chat = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 16, "temperature": 0}
        await http_unary(client, "/v1/chat/completions", chat)
        chat_whole = await http_unary(client, "/v1/chat/completions", chat)
        chat_streamed, _ = await http_stream(client, "/v1/chat/completions", chat)
        assert chat_whole == chat_streamed and chat_whole.usage[1] == 16

    # The gRPC door streams, message by message, the same answer.
    answer, ids, messages = await grpc_generate(router.grpc_address, PROMPT, MAX_TOKENS)
    assert ids == expected_ids
    assert answer == whole
    assert messages > 1

    # The dispatcher: whole is one delta (Serve: at most two, the first token with its report, then
    # the rest), the same tokens and end.
    one_by_one = await dispatched(router, prompt_ids, whole=False)
    at_once = await dispatched(router, prompt_ids, whole=True)
    assert len(at_once) <= (1 if router_mode == "colocated" else 2) < len(one_by_one)
    assert [t for d in at_once for t in d.token_ids] == [t for d in one_by_one for t in d.token_ids] == expected_ids
    assert at_once[-1].finish_reason == one_by_one[-1].finish_reason
    assert at_once[-1].usage == one_by_one[-1].usage


async def test_a_streamed_answer_to_a_client_that_stops_reading_loses_nothing(
        cluster: Cluster, monkeypatch: pytest.MonkeyPatch) -> None:
    """A client that stops reading a long stream: the router's writes to it pause, the chunks that come
    meanwhile wait in the stream (its ``TokenSink`` refuses them), and once the client reads again it
    gets the whole answer, as the same request answered unary."""
    from pdrouter.router.frontdoor.http_cycle import FastCycle

    paused: list[bool] = []
    can_send_now = FastCycle.can_send_now

    def watched(cycle: FastCycle) -> bool:
        transport = cycle.protocol.transport
        if not paused:  # small buffers on the router's side too: its writes pause within a few chunks
            transport.get_extra_info("socket").setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
            transport.set_write_buffer_limits(high=4096)
            paused.append(False)
        if cycle.protocol.flow.write_paused:
            paused.append(True)
        return can_send_now(cycle)

    monkeypatch.setattr(FastCycle, "can_send_now", watched)
    cluster.spawn("worker")
    router = await cluster.router("colocated", dispatch=DispatchConfig(mode="colocated"))
    await wait_workers(router, {WorkerRole.COLOCATED: 1})
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 900, "temperature": 0, "ignore_eos": True}
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{router.http_port}", timeout=60) as client:
        whole = await http_unary(client, "/v1/completions", body)
    assert whole.usage[1] == 900

    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.setblocking(False)
    await asyncio.get_running_loop().sock_connect(sock, ("127.0.0.1", router.http_port))
    reader, writer = await asyncio.open_connection(sock=sock)
    payload = json.dumps({**body, "stream": True, "stream_options": {"include_usage": True}}).encode()
    writer.write(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                 b"content-length: %d\r\nconnection: close\r\n\r\n%s" % (len(payload), payload))
    await writer.drain()
    await asyncio.sleep(3)  # not reading: the router's transport fills and its writes pause
    raw = await asyncio.wait_for(reader.read(-1), 60)
    writer.close()
    head, _, rest = raw.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200")
    events = b""
    while rest:  # chunked transfer coding
        size, _, rest = rest.partition(b"\r\n")
        n = int(size, 16)
        events, rest = events + rest[:n], rest[n + 2:]
        if n == 0:
            break
    text, finish, usage = [], "", None
    for line in events.decode().split("\n"):
        if line.startswith("data: {"):
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                usage = _usage(chunk["usage"])
            for choice in chunk["choices"]:
                text.append(choice["text"])
                finish = choice["finish_reason"] or finish
    assert True in paused  # the writes did pause while the client was not reading
    assert Answer("".join(text), finish, usage) == Answer(whole.text, "length", (whole.usage[0], 900, usage[2]))
