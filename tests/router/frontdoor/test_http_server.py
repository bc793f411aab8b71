"""The router's HTTP server (``pdrouter.router.frontdoor.http_server``): which requests skip uvicorn's parser
(pure logic), and each entry point of a request over a socket to a server on a free port.

The entry points (see the module's docstring): a plain generation POST that arrives whole in one
read (no parser); one whose bytes arrive in pieces (httptools' callbacks, then the server's own
cycle); anything else (uvicorn's cycle into the ASGI app, Starlette for the other routes). The
same request answers byte for byte alike through each, but for its ids, timestamps and ``date``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
from collections.abc import Iterator
from types import SimpleNamespace

import pytest
import uvicorn
from uvicorn.protocols.http.httptools_impl import RequestResponseCycle

from pdrouter.core.tokenizer import ByteTokenizer
from pdrouter.router.frontdoor.http_api import HttpFrontdoor
from pdrouter.router.frontdoor.http_cycle import FastCycle, whole_request
from pdrouter.router.frontdoor.http_server import HttpProtocol
from pdrouter.router.metrics import RouterMetrics
from pdrouter.testing import http as testing_http
from pdrouter.testing.echo import EchoDispatcher

ROUTES = {b"/v1/completions": "completions", b"/v1/chat/completions": "chat"}
BODY = b'{"model":"m","prompt":"hi"}'
WAIT_S = 10.0  # hang guard, not a latency bound


# -- whole_request: pure logic ------------------------------------------------------------------


def request(body: bytes = BODY, line: bytes = b"POST /v1/completions HTTP/1.1", headers: bytes | None = None) -> bytes:
    if headers is None:
        headers = b"Host: x\r\nContent-Type: application/json\r\nContent-Length: %d\r\n" % len(body)
    return line + b"\r\n" + headers + b"\r\n" + body


def test_a_plain_request_is_read_whole() -> None:
    assert whole_request(request(), ROUTES) == ("completions", True, BODY)
    chat = request(line=b"POST /v1/chat/completions HTTP/1.1")
    assert whole_request(chat, ROUTES) == ("chat", True, BODY)
    empty = request(b"", headers=b"content-length: 0\r\n")
    assert whole_request(empty, ROUTES) == ("completions", True, b"")  # the endpoint answers 400


@pytest.mark.parametrize("connection, keep_alive", [
    (b"close", False), (b"Close", False), (b"keep-alive", True), (b"keep-alive, close", False), (b"", True)])
def test_connection_header(connection: bytes, keep_alive: bool) -> None:
    headers = b"host: x\r\nconnection: %s\r\ncontent-length: %d\r\n" % (connection, len(BODY))
    assert whole_request(request(headers=headers), ROUTES) == ("completions", keep_alive, BODY)


@pytest.mark.parametrize("data", [
    request(line=b"POST /v1/completions?x=1 HTTP/1.1"),  # a query string
    request(line=b"POST /v1/models HTTP/1.1"),  # another route
    request(line=b"GET /v1/completions HTTP/1.1"),
    request(line=b"POST /v1/completions HTTP/1.0"),
    request(line=b"POST  /v1/completions HTTP/1.1"),
    request(headers=b"host: x\r\ntransfer-encoding: chunked\r\ncontent-length: %d\r\n" % len(BODY)),
    request(headers=b"host: x\r\nExpect: 100-continue\r\ncontent-length: %d\r\n" % len(BODY)),
    request(headers=b"host: x\r\nconnection: upgrade\r\nupgrade: h2c\r\ncontent-length: %d\r\n" % len(BODY)),
    request(headers=b"host: x\r\nconnection: upgrade\r\ncontent-length: %d\r\n" % len(BODY)),
    request(headers=b"connection: close\r\nconnection: close\r\ncontent-length: %d\r\n" % len(BODY)),
    request(headers=b"host: x\r\n"),  # no content-length
    request(headers=b"content-length: %d\r\ncontent-length: %d\r\n" % (len(BODY), len(BODY))),
    request(headers=b"content-length: +%d\r\n" % len(BODY)),
    request(headers=b"content-length: 0x1b\r\n"),
    request(headers=b"content-length : %d\r\n" % len(BODY)),  # space before the colon
    request(headers=b"host: x\r\n y\r\ncontent-length: %d\r\n" % len(BODY)),  # obsolete line folding
    request(headers=b"bad header\r\ncontent-length: %d\r\n" % len(BODY)),
    request(headers=b"x: a\x00b\r\ncontent-length: %d\r\n" % len(BODY)),  # a control character
    request(headers=b"content-length: %d\r\n" % (len(BODY) + 1)),  # the body has not all arrived
    request()[:-3],
    request() + request(),  # another request pipelined behind it
    request()[:30],  # the head has not all arrived
    b"POST",
])
def test_anything_else_goes_to_the_parser(data: bytes) -> None:
    assert whole_request(data, ROUTES) is None


# -- the entry points, over a socket ------------------------------------------------------------

UNARY = b'{"model": "echo", "prompt": "hi", "max_tokens": 2}'
STREAMED = b'{"model": "echo", "prompt": "hey", "max_tokens": 3, "stream": true}'
CHAT = b'{"model": "echo", "messages": [{"role": "user", "content": "yo"}], "max_tokens": 1}'


def post(body: bytes, target: bytes = b"/v1/completions", extra: bytes = b"") -> bytes:
    return (b"POST %s HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n%scontent-length: %d\r\n\r\n%s"
            % (target, extra, len(body), body))


class Parsed:
    """Counts the messages httptools' parser began (none for a request read whole)."""

    def __init__(self) -> None:
        self.messages = 0


@pytest.fixture
def parsed(monkeypatch: pytest.MonkeyPatch) -> Iterator[Parsed]:
    counter = Parsed()
    begin = HttpProtocol.on_message_begin

    def on_message_begin(protocol: HttpProtocol) -> None:
        counter.messages += 1
        begin(protocol)

    monkeypatch.setattr(HttpProtocol, "on_message_begin", on_message_begin)
    yield counter


def serving() -> contextlib.AbstractAsyncContextManager[tuple[uvicorn.Server, int]]:
    """The router's server for an HTTP door over the echo model, on a free port."""
    door = HttpFrontdoor(EchoDispatcher(), {"echo": ByteTokenizer(512)}, metrics=RouterMetrics())
    return testing_http.serving(door.app, WAIT_S)


async def read_response(reader: asyncio.StreamReader) -> bytes:
    """One response as it came: head and body (chunked framing included)."""
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), WAIT_S)
    lower = head.lower()
    if b"transfer-encoding: chunked" in lower:
        return head + await asyncio.wait_for(reader.readuntil(b"\r\n0\r\n\r\n"), WAIT_S)
    length = int(lower.split(b"content-length: ", 1)[1].split(b"\r\n", 1)[0])
    return head + await asyncio.wait_for(reader.readexactly(length), WAIT_S)


def normalized(response: bytes) -> bytes:
    """``response`` with what differs between two answers to one request (ids, times) masked."""
    response = re.sub(rb"date: [^\r]*\r\n", b"date: D\r\n", response)
    response = re.sub(rb"req-[0-9a-f]+", b"req-ID", response)
    response = re.sub(rb'"((?:chat)?cmpl)-[0-9a-f]+"', rb'"\1-ID"', response)
    return re.sub(rb'"created":\d+', b'"created":T', response)


def split(response: bytes) -> tuple[bytes, dict[bytes, bytes], bytes]:
    """(status line, headers by lower-case name, body with any chunked framing removed)."""
    head, _, body = response.partition(b"\r\n\r\n")
    status, *lines = head.split(b"\r\n")
    headers = {name.lower(): value for name, _, value in (line.partition(b": ") for line in lines)}
    if headers.get(b"transfer-encoding") == b"chunked":
        chunks, rest = [], body
        while True:
            size_line, _, rest = rest.partition(b"\r\n")
            size = int(size_line, 16)
            if size == 0:
                break
            chunks.append(rest[:size])
            rest = rest[size + 2:]
        body = b"".join(chunks)
    return status, headers, body


def assert_unary_completion(response: bytes, text: str) -> None:
    status, headers, body = split(response)
    assert status == b"HTTP/1.1 200 OK"
    assert headers[b"content-type"] == b"application/json"
    assert int(headers[b"content-length"]) == len(body)
    assert b"date" in headers and b"server" not in headers and b"connection" not in headers
    payload = json.loads(body)
    assert headers[b"x-request-id"].startswith(b"req-")
    assert payload["id"] == "cmpl-" + headers[b"x-request-id"].decode()[len("req-"):]
    assert payload["object"] == "text_completion" and payload["model"] == "echo"
    assert payload["choices"][0]["text"] == text and payload["choices"][0]["finish_reason"] == "length"
    assert payload["usage"]["completion_tokens"] == len(text)


def assert_streamed_completion(response: bytes) -> None:
    status, headers, body = split(response)
    assert status == b"HTTP/1.1 200 OK"
    assert headers[b"content-type"] == b"text/event-stream" and headers[b"cache-control"] == b"no-cache"
    assert headers[b"transfer-encoding"] == b"chunked" and b"content-length" not in headers
    events = [json.loads(line[len(b"data: "):]) for line in body.split(b"\n\n") if line and line != b"data: [DONE]"]
    assert [e["choices"][0]["text"] for e in events] == ["h", "e", "y"]
    assert events[-1]["choices"][0]["finish_reason"] == "length" and body.endswith(b"data: [DONE]\n\n")


async def exchange(server: uvicorn.Server, port: int, *parts: bytes) -> tuple[bytes, type]:
    """Send ``parts`` on a new connection, each after the first only once the server has begun
    parsing what came before (so the request arrives in pieces); the response, and the type of
    the cycle that answered it."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    client = writer.get_extra_info("sockname")[:2]
    try:
        for i, part in enumerate(parts):
            if i:
                await parsing(server, client)
            writer.write(part)
            await writer.drain()
        response = await read_response(reader)
        return response, type(connection_of(server, client).cycle)
    finally:
        writer.close()
        await writer.wait_closed()


def connection_of(server: uvicorn.Server, client: tuple[str, int]) -> HttpProtocol:
    """The server's side of the connection from ``client`` (its address)."""
    for connection in server.server_state.connections:
        if isinstance(connection, HttpProtocol) and connection.client == client:
            return connection
    raise AssertionError(f"no connection from {client}")


async def parsing(server: uvicorn.Server, client: tuple[str, int]) -> None:
    """Wait until httptools' parser has begun a message on the connection from ``client``."""
    for _ in range(int(WAIT_S / 0.005)):
        connection = next((c for c in server.server_state.connections if c.client == client), None)
        if connection is not None and getattr(connection, "_in_message", False):
            return
        await asyncio.sleep(0.005)
    raise AssertionError("the server did not read the first part")


async def test_entry_1_a_request_whole_in_one_read_skips_the_parser(parsed: Parsed) -> None:
    async with serving() as (server, port):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        client = writer.get_extra_info("sockname")[:2]
        writer.write(post(UNARY))  # keep-alive: each request arrives whole in one read
        assert_unary_completion(await read_response(reader), "hi")
        assert isinstance(connection_of(server, client).cycle, FastCycle)
        writer.write(post(STREAMED))
        assert_streamed_completion(await read_response(reader))
        writer.write(post(CHAT, b"/v1/chat/completions"))
        _, headers, body = split(await read_response(reader))
        payload = json.loads(body)
        assert payload["object"] == "chat.completion" and payload["choices"][0]["message"]["content"] == "y"
        assert payload["id"] == "chatcmpl-" + headers[b"x-request-id"].decode()[len("req-"):]
        writer.write(post(UNARY, extra=b"connection: close\r\n"))
        status, headers, _ = split(await read_response(reader))
        assert status == b"HTTP/1.1 200 OK" and headers[b"connection"] == b"close"
        assert await asyncio.wait_for(reader.read(), WAIT_S) == b""  # closed after the response
        writer.close()
        await writer.wait_closed()
    assert parsed.messages == 0


@pytest.mark.parametrize("cut", [b"POST /v1/compl", b"content-type:", b"\r\n\r\n{"], ids=["line", "headers", "body"])
async def test_entry_2_a_request_in_pieces_is_parsed_then_served_by_the_servers_cycle(
        parsed: Parsed, cut: bytes) -> None:
    async with serving() as (server, port):
        for body in (UNARY, STREAMED):
            data = post(body)
            at = data.index(cut) + len(cut)
            response, cycle = await exchange(server, port, data[:at], data[at:])
            if body == UNARY:
                assert_unary_completion(response, "hi")
            else:
                assert_streamed_completion(response)
            assert cycle is FastCycle and parsed.messages == 1
            parsed.messages = 0


async def test_entry_3_anything_else_takes_uvicorns_cycle_into_the_app(parsed: Parsed) -> None:
    async with serving() as (server, port):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        client = writer.get_extra_info("sockname")[:2]
        # A generation POST with a query string: uvicorn's cycle, then the endpoint.
        writer.write(post(UNARY, b"/v1/completions?x=1"))
        assert_unary_completion(await read_response(reader), "hi")
        assert isinstance(connection_of(server, client).cycle, RequestResponseCycle)
        writer.write(post(STREAMED, b"/v1/completions?x=1"))
        assert_streamed_completion(await read_response(reader))
        # Expect: 100-continue: uvicorn's interim response, then the answer.
        writer.write(post(UNARY, extra=b"expect: 100-continue\r\n"))
        assert await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), WAIT_S) == b"HTTP/1.1 100 Continue\r\n\r\n"
        assert_unary_completion(await read_response(reader), "hi")
        # The other routes: Starlette.
        writer.write(b"GET /v1/models HTTP/1.1\r\nhost: x\r\n\r\n")
        status, headers, body = split(await read_response(reader))
        assert status == b"HTTP/1.1 200 OK" and headers[b"content-type"] == b"application/json"
        assert [m["id"] for m in json.loads(body)["data"]] == ["echo"]
        writer.write(b"GET /v1/completions HTTP/1.1\r\nhost: x\r\n\r\n")
        status, headers, body = split(await read_response(reader))
        assert status == b"HTTP/1.1 405 Method Not Allowed" and headers[b"allow"] == b"POST"
        assert json.loads(body)["error"]["code"] == "method_not_allowed"
        writer.write(b"GET /nowhere HTTP/1.1\r\nhost: x\r\n\r\n")
        status, _, body = split(await read_response(reader))
        assert status == b"HTTP/1.1 404 Not Found" and json.loads(body)["error"]["code"] == "not_found"
        assert isinstance(connection_of(server, client).cycle, RequestResponseCycle)
        writer.close()
        await writer.wait_closed()
    assert parsed.messages == 6


@pytest.mark.parametrize("body, target", [(UNARY, b"/v1/completions"), (STREAMED, b"/v1/completions"),
                                          (CHAT, b"/v1/chat/completions"), (b"{not json", b"/v1/completions")],
                         ids=["unary", "streamed", "chat", "bad-json"])
async def test_each_entry_point_answers_the_same_bytes(parsed: Parsed, body: bytes, target: bytes) -> None:
    async with serving() as (server, port):
        data = post(body, target)
        at = data.index(b"\r\n") + 2
        answers, messages = [], []
        for parts in ((data,), (data[:at], data[at:]), (post(body, target + b"?"),)):
            answers.append(await exchange(server, port, *parts))
            messages.append(parsed.messages)
    assert [cycle for _, cycle in answers] == [FastCycle, FastCycle, RequestResponseCycle]
    assert messages == [0, 1, 2]  # the first one never reached the parser
    whole, pieces, general = (normalized(response) for response, _ in answers)
    assert whole == pieces == general
    assert whole.startswith(b"HTTP/1.1 400 " if body == b"{not json" else b"HTTP/1.1 200 OK\r\n")


@pytest.mark.parametrize("name, value", [(b"x-a", b"1\r\nset-cookie: y"), (b"x-a", b"1\n"), (b"x\r", b"1"),
                                         (b"x\nb", b"1")])
def test_a_response_header_with_cr_or_lf_is_refused(name: bytes, value: bytes) -> None:
    protocol = SimpleNamespace(flow=SimpleNamespace(write_paused=False, resume_reading=lambda: None),
                               server_state=SimpleNamespace(default_headers=[]))

    async def start(headers: list[tuple[bytes, bytes]]) -> FastCycle:
        cycle = FastCycle(protocol, handler=None, keep_alive=True, body_limit=1 << 20)  # type: ignore[arg-type]
        await cycle.send({"type": "http.response.start", "status": 200, "headers": headers})
        return cycle

    assert asyncio.run(start([(b"x-a", b"1 2\t3")])).response_started
    with pytest.raises(RuntimeError, match="invalid HTTP header"):
        asyncio.run(start([(name, value)]))
