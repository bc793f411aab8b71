"""The HTTP door on the wire: a keep-alive connection carrying HEAD, POST and GET requests in turn."""

from __future__ import annotations

import asyncio
import contextlib
import json

import uvicorn
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from pdrouter.core.tokenizer import ByteTokenizer
from pdrouter.router.frontdoor.http_api import HttpFrontdoor
from pdrouter.router.frontdoor.http_cycle import CorkedTransport, FastCycle
from pdrouter.router.frontdoor.http_server import DISCONNECT_EXTENSION, READ_SIZE
from pdrouter.router.metrics import RouterMetrics
from pdrouter.testing import http as testing_http
from pdrouter.testing.echo import EchoDispatcher

WAIT_S = 10.0  # hang guard, not a latency bound


def serving(door: HttpFrontdoor) -> contextlib.AbstractAsyncContextManager[tuple[uvicorn.Server, int]]:
    """The router's uvicorn server for ``door`` on a free port, until the block ends."""
    return testing_http.serving(door.app, WAIT_S)


async def test_responses_through_the_server_arrive_whole_and_in_order() -> None:
    door = HttpFrontdoor(EchoDispatcher(), {"echo": ByteTokenizer(512)}, metrics=RouterMetrics())
    async with serving(door) as (server, port):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        body = b'{"model": "echo", "prompt": "hi", "max_tokens": 2}'
        post = (b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                b"content-length: %d\r\n\r\n%s" % (len(body), body))
        for request in (b"HEAD /health HTTP/1.1\r\nhost: x\r\n\r\n", post, b"GET /health HTTP/1.1\r\nhost: x\r\n\r\n"):
            writer.write(request)
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), WAIT_S)
            assert head.startswith(b"HTTP/1.1 200 OK\r\n")
            length = int(head.lower().split(b"content-length: ", 1)[1].split(b"\r\n", 1)[0])
            if request.startswith(b"HEAD"):
                assert length == len(b'{"status":"ok"}')
                continue
            payload = json.loads(await asyncio.wait_for(reader.readexactly(length), WAIT_S))
            assert payload.get("status") == "ok" or payload["choices"][0]["text"] == "hi"
        [connection] = server.server_state.connections
        assert isinstance(connection, HttpToolsProtocol)
        assert getattr(connection.transport, "max_size", None) == READ_SIZE  # small reads: no mmap per request
        writer.close()
        await writer.wait_closed()


class _Recorder:
    """A transport that records what reaches it (the corking is pure logic)."""

    def __init__(self) -> None:
        self.writes: list[bytes] = []
        self.closed = self.aborted = False

    def write(self, data: bytes) -> None:
        self.writes.append(data)

    def is_closing(self) -> bool:
        return self.closed or self.aborted

    def close(self) -> None:
        self.closed = True

    def abort(self) -> None:
        self.aborted = True

    def get_extra_info(self, name: str) -> str:
        return f"extra:{name}"


async def test_a_response_head_waits_for_its_body_and_bodies_are_never_held() -> None:
    raw = _Recorder()
    corked = CorkedTransport(raw)  # type: ignore[arg-type]
    corked.write(b"HTTP/1.1 200 OK\r\n\r\n")
    corked.write(b"")
    assert raw.writes == []  # the head waits...
    corked.writelines([b"body", b"!"])
    assert raw.writes == [b"HTTP/1.1 200 OK\r\n\r\nbody", b"!"]  # ...for its body; bodies go at once
    corked.write(b"HTTP/1.1 200 OK\r\n\r\n")
    await asyncio.sleep(0)  # no body in that iteration: the head goes alone
    assert raw.writes[-1] == b"HTTP/1.1 200 OK\r\n\r\n"
    corked.write(b"HTTP/1.1 204 No Content\r\n\r\n")
    corked.close()  # flushes first
    assert raw.writes[-1] == b"HTTP/1.1 204 No Content\r\n\r\n" and raw.closed
    assert corked.get_extra_info("peername") == "extra:peername"
    dropped = _Recorder()
    corked = CorkedTransport(dropped)  # type: ignore[arg-type]
    corked.write(b"HTTP/1.1 500 Internal Server Error\r\n\r\n")
    corked.abort()
    await asyncio.sleep(0)
    assert dropped.writes == [] and dropped.aborted


async def test_a_unary_response_leaves_in_one_write() -> None:
    door = HttpFrontdoor(EchoDispatcher(), {"echo": ByteTokenizer(512)}, metrics=RouterMetrics())
    async with serving(door) as (server, port):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"GET /health HTTP/1.1\r\nhost: x\r\n\r\n")
        await asyncio.wait_for(reader.readuntil(b'{"status":"ok"}'), WAIT_S)
        [connection] = server.server_state.connections
        transport = connection.transport
        assert isinstance(transport, CorkedTransport)
        seen: list[bytes] = []
        real_write = transport._transport.write
        transport._transport.write = lambda data: (seen.append(data), real_write(data))[1]
        body = b'{"model": "echo", "prompt": "hi", "max_tokens": 2}'
        writer.write(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                     b"content-length: %d\r\n\r\n%s" % (len(body), body))
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), WAIT_S)
        assert head.startswith(b"HTTP/1.1 200 OK\r\n")
        assert len(seen) == 1 and seen[0].startswith(b"HTTP/1.1 200 OK\r\n") and seen[0].endswith(b"}")
        writer.close()
        await writer.wait_closed()


async def test_a_client_gone_is_noticed_with_or_without_the_servers_disconnect_callback() -> None:
    """Under uvicorn the connection calls back (no watcher task per request); any other ASGI
    server's ``http.disconnect`` message is watched for. Either way the request is cancelled."""
    fake = EchoDispatcher()
    door = HttpFrontdoor(fake, {"echo": ByteTokenizer(512)}, metrics=RouterMetrics())
    body = b'{"model": "echo", "prompt": "#stall0:plain", "max_tokens": 5}'
    # A plain ASGI server: the body, then (once the request started) the disconnect message.
    started, closed = fake.events("plain")
    gone = asyncio.Event()
    sent: list[dict[str, object]] = []

    async def receive() -> dict[str, object]:
        if not sent:
            sent.append({})
            return {"type": "http.request", "body": body, "more_body": False}
        await gone.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict[str, object]) -> None:
        sent.append(message)

    scope = {"type": "http", "method": "POST", "path": "/v1/completions", "root_path": "", "headers": []}
    call = asyncio.ensure_future(door.app(scope, receive, send))  # type: ignore[arg-type]
    while not started.is_set():
        await asyncio.sleep(0.005)
    gone.set()
    await asyncio.wait_for(call, WAIT_S)
    assert closed.is_set() and sent == [{}]  # cancelled, nothing answered
    # The router's server: a closed socket cancels the request, whether it arrived whole (read
    # without uvicorn's parser) or in parts (parsed by it; the scope offers the callback).
    async with serving(door) as (server, port):
        for split in (False, True):
            label = b"split" if split else b"whole"
            started, closed = fake.events(label.decode())
            _reader, writer = await asyncio.open_connection("127.0.0.1", port)
            request = _post(body.replace(b"plain", label))
            if split:
                writer.write(request[:40])
                await writer.drain()
                await asyncio.sleep(0.05)
                writer.write(request[40:])
            else:
                writer.write(request)
            while not started.is_set():
                await asyncio.sleep(0.005)
            [connection] = server.server_state.connections
            assert isinstance(connection, HttpToolsProtocol)
            if split:
                assert DISCONNECT_EXTENSION in connection.scope["extensions"]
            assert not [t for t in asyncio.all_tasks() if "_watch_disconnect" in repr(t.get_coro())]
            writer.close()
            for _ in range(int(WAIT_S / 0.01)):
                if closed.is_set():
                    break
                await asyncio.sleep(0.01)
            assert closed.is_set()
            for _ in range(int(WAIT_S / 0.01)):
                if not server.server_state.connections:
                    break
                await asyncio.sleep(0.01)


def _post(body: bytes, path: bytes = b"/v1/completions", extra: bytes = b"", version: bytes = b"1.1") -> bytes:
    return (b"POST %s HTTP/%s\r\nhost: x\r\ncontent-type: application/json\r\n%scontent-length: %d\r\n\r\n%s"
            % (path, version, extra, len(body), body))


async def _response(reader: asyncio.StreamReader) -> tuple[bytes, bytes]:
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), WAIT_S)
    lower = head.lower()
    if b"transfer-encoding: chunked" in lower:
        body = b""
        while True:
            size = int((await asyncio.wait_for(reader.readuntil(b"\r\n"), WAIT_S)).split(b";")[0], 16)
            chunk = await asyncio.wait_for(reader.readexactly(size + 2), WAIT_S)
            if size == 0:
                return head, body
            body += chunk[:-2]
    length = int(lower.split(b"content-length: ", 1)[1].split(b"\r\n", 1)[0])
    return head, await asyncio.wait_for(reader.readexactly(length), WAIT_S)


async def test_generation_posts_take_the_routers_own_cycle_with_uvicorns_connection_rules() -> None:
    door = HttpFrontdoor(EchoDispatcher(), {"echo": ByteTokenizer(512)}, metrics=RouterMetrics())
    unary = b'{"model": "echo", "prompt": "hi", "max_tokens": 2}'
    streamed = b'{"model": "echo", "prompt": "hey", "max_tokens": 3, "stream": true}'
    chat = b'{"model": "echo", "messages": [{"role": "user", "content": "yo"}], "max_tokens": 1}'
    async with serving(door) as (server, port):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        # Keep-alive: unary, streamed (chunked SSE), chat, a plain GET in between, all on one connection.
        writer.write(_post(unary))
        head, body = await _response(reader)
        [connection] = server.server_state.connections
        assert isinstance(connection, HttpToolsProtocol) and isinstance(connection.cycle, FastCycle)
        assert head.startswith(b"HTTP/1.1 200 OK\r\n") and b"date: " in head and b"x-request-id: req-" in head
        assert json.loads(body)["choices"][0]["text"] == "hi"
        writer.write(_post(streamed))
        head, body = await _response(reader)
        assert b"transfer-encoding: chunked" in head and b"text/event-stream" in head
        assert body.endswith(b"data: [DONE]\n\n") and b'"text":"hey"' not in body and b'"text":"h"' in body
        writer.write(b"GET /health HTTP/1.1\r\nhost: x\r\n\r\n")
        assert (await _response(reader))[1] == b'{"status":"ok"}'
        writer.write(_post(chat, b"/v1/chat/completions"))
        assert json.loads((await _response(reader))[1])["choices"][0]["message"]["content"] == "y"
        # Pipelined: two requests in one write are answered in order.
        writer.write(_post(unary) + _post(unary.replace(b'"hi"', b'"ho"')))
        texts = [json.loads((await _response(reader))[1])["choices"][0]["text"] for _ in range(2)]
        assert texts == ["hi", "ho"]
        # Bad input on the fast path: the OpenAI error body, and the connection still serves.
        writer.write(_post(b"{not json"))
        head, body = await _response(reader)
        assert head.startswith(b"HTTP/1.1 400 ") and json.loads(body)["error"]["type"] == "invalid_request_error"
        writer.write(_post(unary))
        assert json.loads((await _response(reader))[1])["choices"][0]["text"] == "hi"
        # Connection: close is honoured after the response.
        writer.write(_post(unary, extra=b"connection: close\r\n"))
        head, _ = await _response(reader)
        assert b"connection: close" in head.lower()
        assert await asyncio.wait_for(reader.read(), WAIT_S) == b""
        writer.close()
        # HTTP/1.0 closes too; a body over the limit is refused (400) and the connection closed.
        for request in (_post(unary, version=b"1.0"),
                        _post(b"{" + b" " * (door.config.max_body_bytes + 10) + b"}")):
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(request)
            head, body = await _response(reader)
            assert head.startswith((b"HTTP/1.1 200 ", b"HTTP/1.1 400 "))
            assert await asyncio.wait_for(reader.read(), WAIT_S) == b""
            writer.close()


async def test_a_clients_request_id_is_a_label_echoed_back() -> None:
    """``X-Request-Id``: echoed in the response, whichever way the request arrives; the request is
    keyed by a fresh id of the router's (the dispatcher sees it, the label beside it). Without
    one, the response carries the router's id; a malformed one is a 400 naming the header."""
    echo = EchoDispatcher()
    door = HttpFrontdoor(echo, {"echo": ByteTokenizer(512)}, metrics=RouterMetrics())
    body = b'{"model": "echo", "prompt": "hi", "max_tokens": 2}'

    async def post(extra: bytes, split: bool = False) -> tuple[int, dict[bytes, bytes]]:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        data = (b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n%s"
                b"content-length: %d\r\n\r\n%s" % (extra, len(body), body))
        for part in ((data[:-5], data[-5:]) if split else (data,)):
            writer.write(part)
            await writer.drain()
            await asyncio.sleep(0.05)
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), WAIT_S)
        writer.close()
        lines = head.rstrip(b"\r\n").split(b"\r\n")
        headers = {k.lower(): v for k, _, v in (line.partition(b": ") for line in lines[1:])}
        return int(lines[0].split(b" ")[1]), headers

    async with serving(door) as (_, port):
        for split in (False, True):
            status, headers = await post(b"X-Request-Id: client-7\r\n", split)
            assert (status, headers[b"x-request-id"]) == (200, b"client-7")
        status, headers = await post(b"")
        assert status == 200 and headers[b"x-request-id"].startswith(b"req-")
        status, _ = await post(b"X-Request-Id: " + b"x" * 200 + b"\r\n")
        assert status == 400
    seen = echo.requests
    assert [r.label for r in seen] == ["client-7", "client-7", None]
    assert len({r.request_id for r in seen}) == 3 and all(r.request_id.startswith("req-") for r in seen)
