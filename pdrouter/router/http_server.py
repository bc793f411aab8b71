"""The generation POSTs' own HTTP/1.1 request cycle, in place of uvicorn's for those two routes.

uvicorn's request cycle (scope building, a task through its ASGI runner, header checks on every
response, two writes per response) is general, and at one request at a time, when every wake-up
finds the caches cold, it costs about as much as the router's own work. For ``POST
/v1/completions`` and ``POST /v1/chat/completions`` (no query string, no ``Expect``, nothing
pipelined ahead), the router's protocol (``pdrouter.router.frontdoor.http_api._HttpProtocol``) hands the
request to a :class:`FastCycle` instead: the same ASGI ``receive`` / ``send`` contract for the
endpoint, kept to what it uses, and the response's head leaves with its first body bytes. A request
that arrives whole in one read and is plain (:func:`whole_request`), the common case for a client
on a keep-alive connection, skips uvicorn's parser and its per-header callbacks as well.

It keeps uvicorn's connection semantics: keep-alive (``Connection: close`` and HTTP/1.0 close
after the response), requests pipelined behind it (queued by uvicorn, started when this response
completes), flow control, a lost connection (no more writes; the disconnect callbacks run),
graceful shutdown (the task is one of the server's; the connection closes after the response).
Every other request takes uvicorn's own cycle.
"""

from __future__ import annotations

import asyncio
import http
import logging
import re
from collections.abc import Awaitable, Callable, Mapping
from typing import Any, TypeVar

log = logging.getLogger(__name__)

Handler = Callable[[Any, Any], Awaitable[None]]
"""``handler(receive, send)``: the endpoint's ASGI work for one request (scope already decided)."""

_STATUS_LINES: dict[int, bytes] = {}

T = TypeVar("T")

_HEADER_LINES = re.compile(rb"(?:[!#$%&'*+.^_`|~0-9A-Za-z-]+:[ \t]*"
                           rb"(?:[\x21-\x7e\x80-\xff](?:[\x20-\x7e\x80-\xff\t]*[\x21-\x7e\x80-\xff])?)?"
                           rb"[ \t]*\r\n)*")
"""Header lines as RFC 9110 / 9112 allow them (token name, no space before the colon, visible
value characters, no obsolete line folding), each ending in CRLF."""
_PASS_ON = (b"\ntransfer-encoding:", b"\nexpect:", b"\nupgrade:")


def whole_request(data: bytes, routes: Mapping[bytes, T]) -> tuple[T, bool, bytes] | None:
    """``(route, keep_alive, body)`` when ``data`` is exactly one plain ``POST`` to one of ``routes``.

    Plain: ``HTTP/1.1``, the path exactly a key of ``routes`` (no query string), well-formed header
    lines, one ``Content-Length`` equal to the body that follows, no ``Transfer-Encoding``,
    ``Expect`` or ``Upgrade``, at most one ``Connection`` header. Anything else, including a request
    that has not wholly arrived or one with another pipelined behind it, is None: the general
    parser takes it (and answers what is malformed). A request read here never reaches that
    parser, which stays between two messages.
    """
    line_end = data.find(b"\r\n")
    if line_end < 0 or not data.startswith(b"POST /"):
        return None
    target, _, version = data[5:line_end].partition(b" ")
    route = routes.get(target)
    if route is None or version != b"HTTP/1.1":
        return None
    head_end = data.find(b"\r\n\r\n", line_end)
    if head_end < 0:
        return None
    block = data[line_end + 2:head_end + 2]
    if _HEADER_LINES.fullmatch(block) is None:
        return None
    lower = b"\n" + block.lower()
    if any(name in lower for name in _PASS_ON):
        return None
    at = lower.find(b"\ncontent-length:")
    if at < 0 or lower.find(b"\ncontent-length:", at + 1) >= 0:
        return None
    value = lower[at + 16:lower.find(b"\r", at)].strip()
    if not value.isdigit():
        return None
    body = data[head_end + 4:]
    if len(body) != int(value):
        return None
    keep_alive = True
    at = lower.find(b"\nconnection:")
    if at >= 0:
        if lower.find(b"\nconnection:", at + 1) >= 0:
            return None
        options = {option.strip() for option in lower[at + 12:lower.find(b"\r", at)].split(b",")}
        if b"upgrade" in options:
            return None
        keep_alive = b"close" not in options
    return route, keep_alive, body


def status_line(status: int) -> bytes:
    line = _STATUS_LINES.get(status)
    if line is None:
        try:
            phrase = http.HTTPStatus(status).phrase
        except ValueError:
            phrase = ""
        line = _STATUS_LINES[status] = f"HTTP/1.1 {status} {phrase}\r\n".encode("latin-1")
    return line


class _Event:
    """What uvicorn's parser callbacks call ``set()`` on: body bytes, the end of the body, a loss."""

    __slots__ = ("_cycle",)

    def __init__(self, cycle: FastCycle) -> None:
        self._cycle = cycle

    def set(self) -> None:
        self._cycle.progress()


class FastCycle:
    """One generation request on a connection served by the router's protocol.

    Exposes the attributes uvicorn's protocol reads and writes on its current cycle (``body``,
    ``more_body``, ``message_event``, ``response_complete``, ``disconnected``, ``keep_alive``).
    """

    __slots__ = ("_body_limit", "_closed", "_head", "_started", "_taken", "body", "chunked", "disconnected",
                 "handler", "keep_alive", "message_event", "more_body", "protocol", "response_complete",
                 "response_started")

    def __init__(self, protocol: Any, handler: Handler, keep_alive: bool, body_limit: int,
                 body: bytes | None = None) -> None:
        """``body``: the whole request body, when it has all arrived (the request starts at once);
        None: uvicorn's parser callbacks bring it."""
        self.protocol = protocol
        self.handler = handler
        self.keep_alive = keep_alive
        self.body: bytes | bytearray = bytearray() if body is None else body
        self.more_body = body is None
        self.message_event = _Event(self)
        self.response_started = False
        self.response_complete = False
        self.disconnected = False
        self.chunked = False
        self._head = b""
        self._body_limit = body_limit
        self._started = False
        self._taken = False
        self._closed: asyncio.Future[None] | None = None
        if body is not None:
            self.progress()

    # -- from uvicorn's parser callbacks and connection_lost ------------------------------------
    def progress(self) -> None:
        if self.disconnected:
            if self._closed is not None and not self._closed.done():
                self._closed.set_result(None)
            return
        if self._started:
            return
        if self.more_body and len(self.body) <= self._body_limit:
            self.protocol.flow.resume_reading()  # the endpoint takes the body whole: keep reading
            return
        if self.more_body:
            self.keep_alive = False  # answered before the body ended: the connection cannot be reused
        self._started = True
        task = asyncio.get_running_loop().create_task(self._run())
        self.protocol.tasks.add(task)
        task.add_done_callback(self.protocol.tasks.discard)

    async def _run(self) -> None:
        try:
            await self.handler(self.receive, self.send)
        except BaseException as exc:
            if not isinstance(exc, asyncio.CancelledError):
                log.error("generation request failed", exc_info=exc)
            if not self.response_started and not self.disconnected:
                self._write(status_line(500) + b"content-type: text/plain; charset=utf-8\r\n"
                            b"content-length: 21\r\nconnection: close\r\n\r\nInternal Server Error")
            self.keep_alive = False
            if not self.response_complete:
                self.response_complete = True
                self.protocol.transport.close()
            if isinstance(exc, asyncio.CancelledError):
                raise
        else:
            if not self.response_complete and not self.disconnected:
                # The endpoint returned without finishing its response: end the connection.
                self.response_complete = True
                self.protocol.transport.close()

    # -- the ASGI channels ------------------------------------------------------------------------
    async def receive(self) -> dict[str, Any]:
        if not self._taken and not self.disconnected:
            self._taken = True  # the body, whole (or, past the endpoint's limit, what came of it)
            body, self.body = bytes(self.body), bytearray()
            return {"type": "http.request", "body": body, "more_body": self.more_body}
        if not self.disconnected and not self.response_complete:
            self._closed = asyncio.get_running_loop().create_future()
            await self._closed
        return {"type": "http.disconnect"}

    async def send(self, message: dict[str, Any]) -> None:
        flow = self.protocol.flow
        if flow.write_paused and not self.disconnected:
            await flow.drain()
        if self.disconnected:
            return
        if not self.response_started:
            if message["type"] != "http.response.start":
                raise RuntimeError(f"expected http.response.start, got {message['type']!r}")
            self.response_started = True
            parts = [status_line(message["status"])]
            length = None
            for name, value in (*self.protocol.server_state.default_headers, *message.get("headers", ())):
                if b"\r" in value or b"\n" in value or b"\r" in name or b"\n" in name:
                    raise RuntimeError("invalid HTTP header")
                if name.lower() == b"content-length":
                    length = int(value)
                parts += (name, b": ", value, b"\r\n")
            if length is None:
                self.chunked = True
                parts.append(b"transfer-encoding: chunked\r\n")
            if not self.keep_alive:
                parts.append(b"connection: close\r\n")
            parts.append(b"\r\n")
            self._head = b"".join(parts)  # leaves with the first body bytes
            return
        if self.response_complete:
            raise RuntimeError(f"unexpected {message['type']!r} after the response completed")
        if message["type"] != "http.response.body":
            raise RuntimeError(f"expected http.response.body, got {message['type']!r}")
        body = message.get("body", b"")
        more = message.get("more_body", False)
        if self.chunked:
            data = b"%x\r\n%s\r\n" % (len(body), body) if body else b""
            if not more:
                data += b"0\r\n\r\n"
        else:
            data = body
        if self._head:
            data, self._head = self._head + data, b""
        if data:
            self._write(data)
        if not more:
            self.response_complete = True
            if self._closed is not None and not self._closed.done():
                self._closed.set_result(None)
            if not self.keep_alive:
                self.protocol.transport.close()
            self.protocol.on_response_complete()

    def _write(self, data: bytes) -> None:
        transport = self.protocol.transport
        if not transport.is_closing():
            getattr(transport, "write_now", transport.write)(data)  # a head with its body: no corking
