"""``whole_request``: which requests skip uvicorn's parser (pure logic; the wire tests serve them)."""

from __future__ import annotations

import pytest

from pdrouter.router.http_server import whole_request

ROUTES = {b"/v1/completions": "completions", b"/v1/chat/completions": "chat"}
BODY = b'{"model":"m","prompt":"hi"}'


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
