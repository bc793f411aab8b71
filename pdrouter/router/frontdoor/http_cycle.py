"""The HTTP/1.1 server's request cycle for the generation POSTs (``http_server``'s entry points 1 and 2):
a request read whole from one buffer (:func:`whole_request_head`), the :class:`FastCycle` that runs
its handler and writes its response, and the transport that sends a response's head with its first
body bytes (:class:`CorkedTransport`). ``http_server``'s docstring says what the cycle promises.

Apart from ``http_server`` (the uvicorn protocol subclass and the seam's protocols, which stay
Python) so that ``scripts/compile_engine.py --router`` can compile this code, which runs for every
request and every streamed write.
"""

from __future__ import annotations

import asyncio
import http
import logging
import re
from collections.abc import Awaitable, Callable, Mapping, MutableMapping, Sequence
from typing import Any, NamedTuple, TypeVar, cast

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

log = logging.getLogger("pdrouter.router.frontdoor.http_server")  # the server's logs, wherever the code lives

Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[MutableMapping[str, Any], Receive, Send], Awaitable[None]]


class RequestHead(NamedTuple):
    """What a handler gets of its request's head (each value None when the header is absent)."""

    authorization: bytes | None
    content_type: bytes | None
    request_id: bytes | None
    """The client's ``X-Request-Id``: a label to echo back, never a key of anything."""
    traceparent: bytes | None = None
    tracestate: bytes | None = None
    """The W3C trace context (None when absent, or sent more than once)."""


NO_HEAD = RequestHead(None, None, None)

Handler = Callable[[Receive, Send, RequestHead], Awaitable[None]]
"""``handler(receive, send, head)``: the endpoint's ASGI work for one request (scope already
decided); ``head``: the request's :class:`RequestHead`."""


_STATUS_LINES: dict[int, bytes] = {}

T = TypeVar("T")

_HEADER_LINES = re.compile(rb"(?:[!#$%&'*+.^_`|~0-9A-Za-z-]+:[ \t]*"
                           rb"(?:[\x21-\x7e\x80-\xff](?:[\x20-\x7e\x80-\xff\t]*[\x21-\x7e\x80-\xff])?)?"
                           rb"[ \t]*\r\n)*")
"""Header lines as RFC 9110 / 9112 allow them (token name, no space before the colon, visible
value characters, no obsolete line folding), each ending in CRLF."""
_PASS_ON = re.compile(rb"\n(?:transfer-encoding|expect|upgrade):")
"""Headers that send a request to uvicorn's parser. One search, not ``in`` per name: ``bytes in bytes``
raises and clears a TypeError inside on CPython 3.11 before it searches."""
_AUTHORIZATION = b"\nauthorization:"
_CONTENT_TYPE = b"\ncontent-type:"
_REQUEST_ID = b"\nx-request-id:"
_TRACEPARENT = b"\ntraceparent:"
_TRACESTATE = b"\ntracestate:"


def whole_request(data: bytes, routes: Mapping[bytes, T]) -> tuple[T, bool, bytes] | None:
    """``(route, keep_alive, body)`` when ``data`` is exactly one plain ``POST`` to one of ``routes``.

    Plain: ``HTTP/1.1``, the path exactly a key of ``routes`` (no query string), well-formed header
    lines, one ``Content-Length`` (of at most 18 digits) equal to the body that follows, no
    ``Transfer-Encoding``, ``Expect`` or ``Upgrade``, at most one ``Connection``, ``Authorization``,
    ``Content-Type`` and ``X-Request-Id`` header. Anything else, including a request that has not
    wholly arrived or one with another pipelined behind it, is None: the general parser takes it
    (and answers what is malformed). A request read here never reaches that parser, which stays
    between two messages.
    """
    whole = whole_request_head(data, routes)
    return None if whole is None else whole[:3]


_SEVERAL = object()
_MAX_LENGTH_DIGITS = 18
"""A longer ``Content-Length`` is left to the parser, which answers 400 (no request body is that large)."""
_CR, _LF = ord("\r"), ord("\n")


def _header(lower: bytes, block: bytes, name: bytes) -> bytes | object | None:
    """The value of header ``name`` (``b"\nname:"``, lower case) in a head ``block`` (``lower`` is
    b"\n" + ``block`` lower-cased), its case kept; None when absent, ``_SEVERAL`` when repeated."""
    at = lower.find(name)
    if at < 0:
        return None
    if lower.find(name, at + 1) >= 0:
        return _SEVERAL
    # ``lower`` is ``block`` lower-cased after one b"\n": the same offsets, less one (a key keeps its case).
    return block[at + len(name) - 1:lower.find(b"\r", at) - 1].strip(b" \t")


def whole_request_head(data: bytes, routes: Mapping[bytes, T]
                       ) -> tuple[T, bool, bytes, bytes, RequestHead] | None:
    """:func:`whole_request`, with the request's path and its :class:`RequestHead`:
    ``(route, keep_alive, body, path, head)``."""
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
    if _PASS_ON.search(lower) is not None:
        return None
    at = lower.find(b"\ncontent-length:")
    if at < 0 or lower.find(b"\ncontent-length:", at + 1) >= 0:
        return None
    value = lower[at + 16:lower.find(b"\r", at)].strip()
    if not value.isdigit() or len(value) > _MAX_LENGTH_DIGITS:
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
    authorization = _header(lower, block, _AUTHORIZATION)
    content_type = _header(lower, block, _CONTENT_TYPE)
    request_id = _header(lower, block, _REQUEST_ID)
    if authorization is _SEVERAL or content_type is _SEVERAL or request_id is _SEVERAL:
        return None
    head = RequestHead(cast("bytes | None", authorization), cast("bytes | None", content_type),
                       cast("bytes | None", request_id), _one_value(lower, block, _TRACEPARENT),
                       _one_value(lower, block, _TRACESTATE))
    return route, keep_alive, body, target, head


def _one_value(lower: bytes, block: bytes, name: bytes) -> bytes | None:
    """The value of header ``name`` when sent once, else None."""
    value = _header(lower, block, name)
    return None if value is _SEVERAL else cast("bytes | None", value)


def as_values(value: bytes | None) -> tuple[bytes, ...]:
    """A header's value, or its absence, as the values of every header of that name."""
    return () if value is None else (value,)


def first_value(values: Sequence[bytes]) -> bytes | None:
    """The first of a header's values, None without one."""
    return values[0] if values else None


def trace_values(headers: Sequence[tuple[bytes, bytes]]) -> tuple[bytes | None, bytes | None]:
    """``(traceparent, tracestate)`` of a head's trace headers, each None when absent or repeated."""
    if not headers:
        return None, None
    parent = [v for n, v in headers if n == b"traceparent"]
    state = [v for n, v in headers if n == b"tracestate"]
    return (parent[0] if len(parent) == 1 else None), (state[0] if len(state) == 1 else None)


def status_line(status: int) -> bytes:
    line = _STATUS_LINES.get(status)
    if line is None:
        try:
            phrase = http.HTTPStatus(status).phrase
        except ValueError:
            phrase = ""
        line = _STATUS_LINES[status] = f"HTTP/1.1 {status} {phrase}\r\n".encode("latin-1")
    return line


class FastCycle:
    """One generation request on a connection served by :class:`HttpProtocol` (entry points 1 and 2).

    Exposes the attributes uvicorn's protocol reads and writes on its current cycle (``body``,
    ``more_body``, ``message_event``, ``response_complete``, ``disconnected``, ``keep_alive``).
    ``message_event`` is the cycle itself (uvicorn calls its ``set()`` for body bytes, the end of the
    body, a loss), not an object of its own that would tie the cycle, and its body, into a reference
    cycle; a cycle whose client is gone drops its body at once.
    """

    __slots__ = ("_body_limit", "_closed", "_head", "_started", "_taken", "body", "chunked",
                 "disconnected", "handler", "keep_alive", "more_body", "protocol", "request_head",
                 "response_complete", "response_started")

    def __init__(self, protocol: HttpToolsProtocol, handler: Handler, keep_alive: bool, body_limit: int,
                 body: bytes | None = None, head: RequestHead = NO_HEAD) -> None:
        """``body``: the whole request body, when it has all arrived (the request starts at once);
        None: uvicorn's parser callbacks bring it. ``head``: what the handler gets of the head."""
        self.protocol = protocol
        self.handler = handler
        self.request_head = head
        self.keep_alive = keep_alive
        self.body: bytes | bytearray = bytearray() if body is None else body
        self.more_body = body is None
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

    @property
    def message_event(self) -> FastCycle:
        return self

    def set(self) -> None:
        """uvicorn's ``message_event.set()``."""
        self.progress()

    # -- from uvicorn's parser callbacks and connection_lost ------------------------------------
    def progress(self) -> None:
        if self.disconnected:
            self.body = bytearray()  # nobody will read it
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
        # Held in uvicorn's own set of request tasks (as its cycle does), the set its graceful
        # shutdown waits on: a task held anywhere else would be cut off by a shutdown.
        task = self.protocol.loop.create_task(self._run())
        self.protocol.tasks.add(task)
        task.add_done_callback(self.protocol.tasks.discard)

    async def _run(self) -> None:
        try:
            await self.handler(self.receive, self.send, self.request_head)
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
    async def receive(self) -> Message:
        if not self._taken and not self.disconnected:
            self._taken = True  # the body, whole (or, past the endpoint's limit, what came of it)
            body, self.body = bytes(self.body), bytearray()
            return {"type": "http.request", "body": body, "more_body": self.more_body}
        if not self.disconnected and not self.response_complete:
            self._closed = asyncio.get_running_loop().create_future()
            await self._closed
        return {"type": "http.disconnect"}

    async def send(self, message: Message) -> None:
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
                # Bytes by their values: ``b"\r" in value`` first tries the operand as an int, and on
                # CPython 3.11 raises and clears a TypeError inside before it searches.
                if _CR in value or _LF in value or _CR in name or _LF in name:
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
            data = _chunk(body) if body else b""
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

    def can_send_now(self) -> bool:
        """Whether :meth:`send_now` may write: a chunked response under way, its head out, the client there,
        its writes not paused."""
        return (self.chunked and self.response_started and not self.response_complete and not self._head
                and not self.disconnected and not self.protocol.flow.write_paused)

    def send_now(self, body: bytes) -> None:
        """A body chunk with more to come, outside the handler's ``send`` (a ``TokenSink``'s): written at
        once, as ``send`` would write it; only when :meth:`can_send_now`."""
        self._write(_chunk(body))

    def _write(self, data: bytes) -> None:
        transport = self.protocol.transport
        if not transport.is_closing():
            getattr(transport, "write_now", transport.write)(data)  # a head with its body: no corking


def _chunk(body: bytes) -> bytes:
    """``body`` in HTTP/1.1's chunked transfer coding."""
    return b"%x\r\n%s\r\n" % (len(body), body)


_RESPONSE_HEAD = b"HTTP/1.1 "


class CorkedTransport:
    """A transport that holds a response's head back until its first body bytes, then writes both.

    uvicorn writes a response's status line and headers, then its body, each at once: two
    system calls (and two wake-ups of the client) for every unary response. Here the head waits,
    and the body that follows in the same event-loop iteration leaves with it in one ``send``; a
    head with no body in that iteration leaves on its own at the next one. Body bytes are never
    held back. Everything but writing and closing is the wrapped transport's.
    """

    __slots__ = ("_loop", "_out", "_transport")

    def __init__(self, transport: asyncio.Transport) -> None:
        self._transport = transport
        self._out: list[bytes] = []
        self._loop = asyncio.get_running_loop()

    def write(self, data: bytes) -> None:
        if not data:
            return
        if self._out:
            self._out.append(data)
            self._flush()
        elif data.startswith(_RESPONSE_HEAD):
            self._out.append(data)
            self._loop.call_soon(self._flush)
        else:
            self._transport.write(data)

    def writelines(self, lines: list[bytes]) -> None:
        for data in lines:
            self.write(data)

    def _flush(self) -> None:
        out, self._out = self._out, []
        if out and not self._transport.is_closing():
            self._transport.write(out[0] if len(out) == 1 else b"".join(out))

    def write_now(self, data: bytes) -> None:
        """Write ``data`` (a whole response, or the rest of one) at once, after anything held."""
        if self._out:
            self._out.append(data)
            self._flush()
        else:
            self._transport.write(data)

    def is_closing(self) -> bool:
        # Asked at every response (here and by uvicorn): a method of its own spares the miss that
        # ``__getattr__`` would answer only after raising an AttributeError inside the lookup.
        return self._transport.is_closing()

    def close(self) -> None:
        self._flush()
        self._transport.close()

    def abort(self) -> None:
        self._out = []
        self._transport.abort()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)
