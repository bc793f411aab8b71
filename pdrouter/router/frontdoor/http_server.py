"""The router's HTTP/1.1 server: uvicorn's httptools protocol, with the two generation POSTs on a
request cycle of its own. Everything uvicorn- and httptools-specific lives here; the OpenAI API
(``pdrouter.router.frontdoor.http_api``) knows only the seam below.

Why: uvicorn's request cycle (scope building, a task through its ASGI runner, header checks on every
response, two writes per response, and with no disconnect callback a task per request watching
``receive``) is general, and at one request at a time, when every wake-up finds the caches cold,
it costs about as much as the router's own work: plain uvicorn and granian's embedded server both
spend measurably more CPU per request on the same door app (``benchmarks/frontdoor_bench.py``; the
figures are in ``docs/benchmarks.md``, "Choices in the router's code, measured").

The seam. What the door gives the server:

* an ASGI application (``make_server(app)``) that answers every request by itself, as under any
  ASGI server;
* on that application, optionally, :meth:`HeadCheck.check_head`: the decision on a request's head
  (its method, path, ``Authorization`` and ``Content-Type`` values), a :class:`Verdict`: serve it, or
  refuse it with a :class:`Refusal`; and whether it proved the client (an accepted key);
* on that application, optionally, :meth:`FastRoutes.fast_handlers`: per exact request path of a
  generation POST (``b"/v1/completions"``, ``b"/v1/chat/completions"``), a :data:`Handler`
  ``handler(receive, send, head)`` (the endpoint's ASGI work, its scope already decided) and the
  largest body it accepts. The server builds them once per connection, passing its
  :data:`OnDisconnect`;
* in the scopes of requests that reach the application, the server offers the same callback
  under :data:`DISCONNECT_EXTENSION`, so the endpoint needs no task watching ``receive``.

What the server promises an application with :meth:`HeadCheck.check_head`:

* every request's head is checked once it is complete and before any byte of its body is held
  (what came in the same read as the head is all there is), on every entry point below; a request
  pipelined behind a response in progress is checked by the application itself at its turn, its
  connection not read meanwhile. A refused request never reaches the application: it is answered
  with the refusal (an OpenAI-shaped JSON error, ``connection: close``) and its body is never read.

What the server promises a handler:

* ``head`` (:class:`RequestHead`) has the values of the request's ``Authorization``, ``Content-Type``
  and ``X-Request-Id`` headers, None for one it lacks (a request with several of one never reaches a
  handler: uvicorn's cycle takes it, and the application answers it), and of its W3C trace context
  (``traceparent``, ``tracestate``; None when absent or repeated);
* ``receive()`` gives the whole body in one ``http.request`` message (``more_body`` False) or, once
  the body has outgrown the handler's limit, what came of it with ``more_body`` True (the
  connection is then not kept); after that it waits, and gives ``http.disconnect`` once the
  client is gone or the response is complete;
* ``send()`` takes one ``http.response.start`` and then ``http.response.body`` messages; the head
  leaves with the first body bytes in one write, with the server's default headers (``date``),
  chunked framing when the handler gave no ``content-length``, and ``connection: close`` when
  the connection will not be kept;
* ``on_disconnect(callback)`` calls ``callback`` once if the connection is lost before it is
  forgotten (its return value forgets it);
* a handler that raises before its response started gets a plain 500 (``connection: close``);
  one that raises mid-response, or returns before its response is complete, has the connection
  closed;
* uvicorn's connection semantics: keep-alive (``Connection: close`` and HTTP/1.0 close after the
  response), requests pipelined behind it (queued by uvicorn, started when this response
  completes), flow control, a lost connection (no more writes; the disconnect callbacks run),
  graceful shutdown (the request's task is one of the server's; the connection closes after the
  response).

Entry points of a request (``tests/router/frontdoor/test_http_server.py`` serves each over a socket):

1. **Whole in one read**: :meth:`HttpProtocol.data_received` finds one plain generation POST
   (:func:`whole_request`: ``HTTP/1.1``, exact path, one ``Content-Length`` matching the body,
   nothing pipelined behind it) on a connection with no response in progress, the common case on
   a keep-alive connection, and starts a :class:`FastCycle` with its body: httptools' parser and
   its per-header callbacks are skipped.
2. **httptools callbacks**: any other read goes to uvicorn's parser; at
   :meth:`HttpProtocol.on_headers_complete` a ``POST`` to a generation path (no query string, no
   ``Expect``, no upgrade, nothing in progress ahead of it) gets a :class:`FastCycle` too, whose
   body then arrives through uvicorn's ``on_body`` / ``on_message_complete``.
3. **uvicorn's own cycle**: every other request (other routes and methods, a query string,
   ``Expect: 100-continue``, a request pipelined behind one in progress, a ``root_path``, a
   concurrency limit) takes uvicorn's ``RequestResponseCycle`` into the ASGI application (whose
   generation POSTs go straight to their endpoint and everything else through Starlette).

Limits (:class:`pdrouter.router.frontdoor.limits.HttpLimits`, one set per server, ``docs/limits.md``), the
same on every entry point: a deadline for each request head (from the connection's start, or from
a kept-alive connection's first byte of the next request) and for each body (from the end of its
head, longer for a large body arriving at the minimum rate), uvicorn's keep-alive idle timeout, a
cap on the head's size (431), on open connections and on requests in flight (503 with
``Retry-After``; a connection past the cap is answered before anything of it is read), and a budget
of connections that have not proved their client (no request with an accepted key yet; with an
application that checks no heads, no request yet): past it the oldest of them is closed, so that
clients that did prove themselves are never locked out by ones that did not. An error
answer is an OpenAI-shaped JSON body with ``connection: close``; the request in progress is
abandoned (its endpoint's ``receive()`` says ``http.disconnect``), the connection is half-closed,
and what the client still sends is dropped until it closes (at most ``LINGER_S``).
"""

from __future__ import annotations

import asyncio
import http
import json
import logging
import math
import re
import socket
import time
from collections.abc import Awaitable, Callable, Mapping, MutableMapping, Sequence
from typing import Any, ClassVar, NamedTuple, Protocol, TypeVar, cast, runtime_checkable

import uvicorn
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from pdrouter.core.tls import TlsFiles
from pdrouter.router.frontdoor.limits import HttpLimits

log = logging.getLogger(__name__)

PROBE_PATHS = frozenset({b"/health", b"/healthz"})
"""Paths the in-flight cap never refuses."""

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
OnDisconnect = Callable[[Callable[[], None]], Callable[[], None]]
"""``on_disconnect(callback)`` → ``forget()``: call ``callback`` if the client's connection is lost."""
DISCONNECT_EXTENSION = "pdrouter.disconnect"
"""The ASGI scope extension by which the server offers ``{"register": OnDisconnect}``."""
READ_SIZE = 64 * 1024
"""Bytes asked of each ``recv`` on an HTTP connection (asyncio's default is 256 KiB)."""


class Refusal(NamedTuple):
    """A request answered on its head alone: ``status``, an OpenAI error ``code`` and ``message``,
    and headers of its own (``WWW-Authenticate`` with a 401)."""

    status: int
    code: str
    message: str
    headers: tuple[tuple[bytes, bytes], ...] = ()


class Verdict(NamedTuple):
    """:meth:`HeadCheck.check_head`'s answer: ``refusal`` (None: serve the request), and ``proven``:
    the request proved its client (it carried an accepted key, or the application asks none)."""

    refusal: Refusal | None
    proven: bool


@runtime_checkable
class HeadCheck(Protocol):
    """An ASGI application that decides on each request's head, before the server reads its body."""

    def check_head(self, method: bytes, path: bytes, authorization: Sequence[bytes],
                   content_type: Sequence[bytes]) -> Verdict:
        """``path``: the request target up to any ``?``, as sent; ``authorization`` and
        ``content_type``: every value of the request's ``Authorization`` and ``Content-Type`` headers."""
        ...


@runtime_checkable
class FastRoutes(Protocol):
    """An ASGI application whose generation POSTs the server may hand to :class:`FastCycle`."""

    def fast_handlers(self, on_disconnect: OnDisconnect) -> Mapping[bytes, tuple[Handler, int]]:
        """Per exact request path: ``(handler, body_limit)``."""
        ...


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


def _one(value: bytes | None) -> tuple[bytes, ...]:
    return () if value is None else (value,)


def _first(values: Sequence[bytes]) -> bytes | None:
    return values[0] if values else None


def _trace_values(headers: Sequence[tuple[bytes, bytes]]) -> tuple[bytes | None, bytes | None]:
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


class _CorkedTransport:
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


_HEAD, _BODY, _BUSY, _IDLE = 0, 1, 2, 3
"""A connection's phase for the deadlines of :class:`HttpLimits`: reading a request head (its
deadline), reading a body (its deadline), serving (none of this server's), kept alive between
requests (uvicorn's ``timeout_keep_alive``)."""
LINGER_S = 1.0
"""How long a connection that was answered with an error and half-closed keeps reading (and
dropping) what its client still sends, so that the answer is not lost to a TCP reset."""
_DISCARD_READ_SIZE = 4096
_LOG_EVERY_S = 10.0
_last_logged: dict[str, float] = {}
_ERROR_TYPES = {400: "invalid_request_error", 401: "invalid_request_error", 408: "invalid_request_error",
                415: "invalid_request_error", 431: "invalid_request_error", 503: "server_error"}


def _log_limit(what: str, message: str, *args: object) -> None:
    """A warning about a limit reached, at most once per ``_LOG_EVERY_S`` per kind (floods stay quiet)."""
    now = time.monotonic()
    if now - _last_logged.get(what, -_LOG_EVERY_S) >= _LOG_EVERY_S:
        _last_logged[what] = now
        log.warning(message, *args)


def error_response(status: int, code: str, message: str, default_headers: Sequence[tuple[bytes, bytes]] = (),
                   retry_after_s: int | None = None, headers: Sequence[tuple[bytes, bytes]] = ()) -> bytes:
    """A whole ``connection: close`` error response with an OpenAI-shaped JSON body (``headers``: more headers)."""
    body = json.dumps({"error": {"message": message, "type": _ERROR_TYPES.get(status, "server_error"),
                                 "param": None, "code": code}}, separators=(",", ":")).encode()
    parts = [status_line(status)]
    for name, value in (*default_headers, *headers):
        parts += (name, b": ", value, b"\r\n")
    parts.append(b"content-type: application/json\r\ncontent-length: %d\r\n" % len(body))
    if retry_after_s is not None:
        parts.append(b"retry-after: %d\r\n" % retry_after_s)
    parts += (b"connection: close\r\n\r\n", body)
    return b"".join(parts)


class _Gate:
    """One server's counts: requests in flight (:attr:`HttpLimits.max_inflight`), connections open
    (:attr:`HttpLimits.max_connections`) and, oldest first, those that have not proved their client
    (:attr:`HttpLimits.max_unauthenticated_connections`)."""

    __slots__ = ("inflight", "open", "unproven")

    def __init__(self) -> None:
        self.inflight = 0
        self.open = 0
        self.unproven: dict[HttpProtocol, None] = {}

    def evict_oldest(self) -> bool:
        """Close the oldest connection that has not proved its client; False when there is none."""
        if not self.unproven:
            return False
        oldest = next(iter(self.unproven))
        oldest._evict()
        return True


class HttpProtocol(HttpToolsProtocol):
    """uvicorn's httptools HTTP/1.1 protocol with the entry points of the module docstring, reading
    at most :data:`READ_SIZE` bytes at a time, writing through a :class:`_CorkedTransport`, under
    the :class:`HttpLimits` of its server (``limits``; :func:`make_server` makes a subclass per
    server holding them and the server's in-flight count).

    asyncio's socket transport receives into a fresh buffer of its ``max_size`` (256 KiB) per
    read. An allocation that large is at glibc's mmap threshold, and depending on the process's
    allocation history each small read can then cost ``mmap`` + ``mremap`` + ``munmap`` and two
    page faults: tens of microseconds per request. A 64 KiB buffer comes from the heap.

    The deadlines share one lazily re-armed timer per connection (``_watch``): a request read
    whole in one read arms none, and a phase whose deadline is later than the armed one re-arms
    nothing (the timer, when it fires, looks at the phase of the moment).
    """

    limits: ClassVar[HttpLimits] = HttpLimits()
    gate: ClassVar[_Gate] = _Gate()
    _lost_callbacks: set[Callable[[], None]] | None = None
    _fast: Mapping[bytes, tuple[Handler, int]] | None = None
    _in_message = False  # the parser has begun a message it has not completed
    _phase = _HEAD
    _t0 = 0.0  # when the phase began (loop time)
    _due = math.inf  # when a head must be complete (phase _HEAD)
    _seen = 0  # bytes received in this phase (head bytes, or body bytes)
    _watch: asyncio.TimerHandle | None = None
    _linger: asyncio.TimerHandle | None = None
    _admitted = 0  # this connection's requests counted in the server's in-flight count
    _discarding = False  # answered and closing: everything read from now on is dropped
    _check: Callable[[bytes, bytes, Sequence[bytes], Sequence[bytes]], Verdict] | None = None
    _counted = False  # counted in the server's open connections
    _proven = False  # a request of this connection proved its client

    def data_received(self, data: bytes) -> None:
        if self._discarding:
            return
        if (self._fast is not None and not self._in_message and not self.pipeline
                and self.limit_concurrency is None and (self.cycle is None or self.cycle.response_complete)):
            whole = whole_request_head(data, self._fast)
            if whole is not None and len(data) - len(whole[2]) <= self.limits.max_header_bytes:
                # entry point 1: one plain generation request, whole
                (handler, body_limit), keep_alive, body, path, head = whole
                self._unset_keepalive_if_required()
                if not self._passes(b"POST", path, _one(head.authorization), _one(head.content_type)) \
                        or not self._admit():
                    return
                self._phase = _BUSY
                self.cycle = FastCycle(self, handler, keep_alive, body_limit, body,  # type: ignore[assignment]
                                       head)
                return
        if self._phase == _IDLE:  # the first bytes of a request on a kept-alive connection
            self._start(_HEAD)
        if self._phase == _HEAD:
            self._seen += len(data)
        super().data_received(data)
        if self._phase == _HEAD and self._seen > self.limits.max_header_bytes and not self._discarding:
            self._head_too_large()

    def on_body(self, body: bytes) -> None:
        if self._discarding:
            return
        self._seen += len(body)
        super().on_body(body)

    def on_message_complete(self) -> None:
        if self._discarding:
            return
        self._in_message = False
        if self._phase == _BODY:
            cycle = self.cycle
            self._phase = _IDLE if cycle is not None and cycle.response_complete else _BUSY
        super().on_message_complete()

    def on_headers_complete(self) -> None:
        if self._discarding:
            return
        limits = self.limits
        if len(self.url) + sum(len(name) + len(value) + 4 for name, value in self.headers) > limits.max_header_bytes:
            self._head_too_large()
            return
        queued = self.cycle is not None and not self.cycle.response_complete
        authorization: list[bytes] = []
        content_type: list[bytes] = []
        request_id: list[bytes] = []
        trace: list[tuple[bytes, bytes]] = []
        for name, value in self.headers:
            if name == b"authorization":
                authorization.append(value)
            elif name == b"content-type":
                content_type.append(value)
            elif name == b"x-request-id":
                request_id.append(value)
            elif name == b"traceparent" or name == b"tracestate":
                trace.append((name, value))
        # Pipelined behind a response in progress, a request is queued (its connection not read
        # meanwhile) and checked by the application at its turn: an answer now would cut into the
        # response being sent.
        if not queued and not self._passes(self.parser.get_method(), bytes(self.url).partition(b"?")[0],
                                           authorization, content_type):
            return
        if queued or bytes(self.url) in PROBE_PATHS:
            # Queued, or a liveness probe (an overloaded router is alive: a probe refused for load
            # would get it restarted): counted, not refused.
            self._admitted += 1
            self.gate.inflight += 1
        elif not self._admit():
            return
        self._start(_BODY)
        fast = self._fast_handler(queued)
        if fast is None or len(authorization) > 1 or len(content_type) > 1 or len(request_id) > 1:
            super().on_headers_complete()  # entry point 3: uvicorn's cycle (the application answers repeats)
            return
        handler, body_limit = fast  # entry point 2: parsed by httptools, served by a FastCycle
        keep_alive = self.parser.get_http_version() != "1.0" and self.parser.should_keep_alive()
        head = RequestHead(_first(authorization), _first(content_type), _first(request_id),
                           *_trace_values(trace))
        self.cycle = FastCycle(self, handler, keep_alive, body_limit, head=head)  # type: ignore[assignment]

    def _fast_handler(self, queued: bool) -> tuple[Handler, int] | None:
        """``(handler, body_limit)`` when the generation endpoint's own cycle applies (entry point 2), or None."""
        if self._fast is None or self.expect_100_continue or self.pipeline or self.limit_concurrency is not None:
            return None
        if queued:
            return None  # pipelined behind a response in progress: uvicorn queues it
        if self.parser.get_method() != b"POST" or self.parser.should_upgrade():
            return None
        return self._fast.get(bytes(self.url))

    def _passes(self, method: bytes, path: bytes, authorization: Sequence[bytes],
                content_type: Sequence[bytes]) -> bool:
        """Check a request's head (the application's :class:`HeadCheck`); True to serve it. A refused
        one is answered at once (its body never read) and its connection closes. A request that
        proves its client takes its connection out of the unproven ones."""
        check = self._check
        if check is None:
            proven = True
        else:
            refusal, proven = check(method, path, authorization, content_type)
            if refusal is not None:
                _log_limit(f"refused-{refusal.status}", "HTTP: refusing requests on their head: %d %s (logged "
                           "once every %g s)", refusal.status, refusal.code, _LOG_EVERY_S)
                self._answer(refusal.status, refusal.code, refusal.message, headers=refusal.headers)
                return False
        if proven and not self._proven:
            self._proven = True
            self.gate.unproven.pop(self, None)
        return True

    def on_message_begin(self) -> None:
        self._in_message = True
        super().on_message_begin()
        self.scope["extensions"] = {DISCONNECT_EXTENSION: {"register": self._on_disconnect}}

    def on_response_complete(self) -> None:
        if self._admitted:
            self._admitted -= 1
            self.gate.inflight -= 1
        if self._phase == _BUSY:
            self._phase = _IDLE
        super().on_response_complete()

    def _on_disconnect(self, callback: Callable[[], None]) -> Callable[[], None]:
        if self._lost_callbacks is None:
            self._lost_callbacks = set()
        callbacks = self._lost_callbacks
        callbacks.add(callback)
        return lambda: callbacks.discard(callback)

    def connection_lost(self, exc: Exception | None) -> None:
        self._discarding = True
        self._release()
        self._leave_gate()
        for timer in (self._watch, self._linger):
            if timer is not None:
                timer.cancel()
        self._watch = self._linger = None
        super().connection_lost(exc)
        # Bodies being read are dropped now, not when the collector gets to the protocol and its
        # cycles (which refer to each other).
        if self.cycle is not None:
            self.cycle.body = bytearray()
        for cycle, _ in self.pipeline:
            cycle.body = bytearray()
        self.pipeline.clear()
        callbacks, self._lost_callbacks = self._lost_callbacks, None
        for callback in callbacks or ():
            callback()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        limits, gate = self.limits, self.gate
        if len(gate.unproven) >= limits.max_unauthenticated_connections:
            gate.evict_oldest()
        if gate.open >= limits.max_connections and not gate.evict_oldest():
            self._refuse(cast(asyncio.Transport, transport))
            return
        gate.open += 1
        self._counted = True
        gate.unproven[self] = None
        if isinstance(getattr(transport, "max_size", None), int):  # asyncio's selector transports
            transport.max_size = READ_SIZE  # type: ignore[attr-defined]
        corked = _CorkedTransport(cast(asyncio.Transport, transport))  # a stream connection
        super().connection_made(cast(asyncio.Transport, corked))
        app = self.app
        if isinstance(app, FastRoutes) and not self.root_path:
            self._fast = app.fast_handlers(self._on_disconnect)
        if isinstance(app, HeadCheck):
            self._check = app.check_head
        self._start(_HEAD)

    def _leave_gate(self) -> None:
        if self._counted:
            self._counted = False
            self.gate.open -= 1
            self.gate.unproven.pop(self, None)

    def _evict(self) -> None:
        """Closed to make room (the oldest connection that has not proved its client)."""
        self._leave_gate()
        budget = self.limits.max_unauthenticated_connections
        _log_limit("unproven", "HTTP: closing the oldest connections that have not authenticated: %d of them "
                   "open (--http-max-unauthenticated-connections)", budget)
        if self._in_message or self._seen:
            self._answer(503, "overloaded", f"the server holds its limit of {budget} connections that have not "
                         f"authenticated, and this was the oldest; retry shortly",
                         retry_after_s=self.limits.retry_after_s)
        else:
            self._discarding = True
            self.transport.close()

    # -- limits ---------------------------------------------------------------------------------
    def _start(self, phase: int) -> None:
        """Enter ``_HEAD`` or ``_BODY`` now, with its deadline."""
        now = self.loop.time()
        self._phase, self._t0, self._seen = phase, now, 0
        if phase == _HEAD:
            self._due = due = now + self.limits.header_timeout_s
        else:
            due = now + self.limits.body_timeout_s
        self._arm(due)

    def _arm(self, when: float) -> None:
        watch = self._watch
        if watch is not None:
            if watch.when() <= when:
                return  # fires first, and re-arms for the phase of the moment
            watch.cancel()
        self._watch = self.loop.call_at(when, self._on_watch)

    def _on_watch(self) -> None:
        self._watch = None
        if self._discarding:
            return
        limits = self.limits
        if self._phase == _HEAD:
            due = self._due
        elif self._phase == _BODY:
            due = self._t0 + max(limits.body_timeout_s, self._seen / limits.body_min_rate_bps)
        else:
            return
        if self.loop.time() < due - 0.001:
            self._arm(due)
        elif self._phase == _HEAD:
            self._head_timed_out()
        else:
            self._body_timed_out()

    def _head_timed_out(self) -> None:
        timeout = self.limits.header_timeout_s
        cycle = self.cycle
        if not (self._in_message or self._seen) or (cycle is not None and not cycle.response_complete):
            _log_limit("idle", "HTTP: closing connections that sent no request within %g s", timeout)
            self._discarding = True
            self.transport.close()
            return
        _log_limit("head", "HTTP: closing connections whose request head took longer than %g s "
                   "(--http-header-timeout)", timeout)
        self._answer(408, "request_timeout",
                     f"the request's headers did not arrive within {timeout:g} s (--http-header-timeout)")

    def _body_timed_out(self) -> None:
        limits = self.limits
        allowed = max(limits.body_timeout_s, self._seen / limits.body_min_rate_bps)
        _log_limit("body", "HTTP: closing connections whose request body took longer than %g s "
                   "(--http-body-timeout, at least %d bytes/s past it)", limits.body_timeout_s,
                   limits.body_min_rate_bps)
        cycle = self.cycle
        if cycle is not None and cycle.response_started:
            self._discarding = True
            cycle.keep_alive = False
            self.transport.close()
            return
        self._answer(408, "request_timeout",
                     f"the request body did not arrive within {allowed:.3g} s ({self._seen} bytes came; the body "
                     f"has {limits.body_timeout_s:g} s, or longer at {limits.body_min_rate_bps} bytes/s)")

    def _head_too_large(self) -> None:
        cap = self.limits.max_header_bytes
        _log_limit("header-size", "HTTP: refusing request heads over %d bytes (--http-max-header-bytes)", cap)
        self._answer(431, "request_header_fields_too_large",
                     f"the request's headers are larger than {cap} bytes (--http-max-header-bytes)")

    def _admit(self) -> bool:
        """Count one more request in flight, or (at the cap) answer 503 and close: False."""
        gate, cap = self.gate, self.limits.max_inflight
        if gate.inflight >= cap:
            _log_limit("inflight", "HTTP: answering 503: %d requests in flight (--http-max-inflight)", cap)
            self._answer(503, "overloaded", f"the server is serving its limit of {cap} requests at once; "
                         f"retry shortly", retry_after_s=self.limits.retry_after_s)
            return False
        gate.inflight += 1
        self._admitted += 1
        return True

    def _release(self) -> None:
        if self._admitted:
            self.gate.inflight -= self._admitted
            self._admitted = 0

    def _refuse(self, transport: asyncio.Transport) -> None:
        """A connection past ``max_connections``: 503 at once, its request never read (nor buffered)."""
        self.transport = transport
        if isinstance(getattr(transport, "max_size", None), int):
            transport.max_size = _DISCARD_READ_SIZE  # type: ignore[attr-defined]
        cap = self.limits.max_connections
        _log_limit("connections", "HTTP: answering 503: %d connections open (--http-max-connections)", cap)
        self._answer(503, "overloaded", f"the server has its limit of {cap} connections open; retry shortly",
                     retry_after_s=self.limits.retry_after_s)

    def _answer(self, status: int, code: str, message: str, retry_after_s: int | None = None,
                headers: Sequence[tuple[bytes, bytes]] = ()) -> None:
        """Answer ``status`` (the request in progress, if any, is abandoned), then close the connection.

        What the client sends after the answer is read and dropped for up to :data:`LINGER_S` (the
        connection is half-closed at once), so that closing with unread data does not reset the
        connection before the client has read the answer.
        """
        transport = self.transport
        self._discarding = True
        self._phase = _BUSY
        self._release()
        cycle = self.cycle
        if cycle is not None and not cycle.response_complete:
            cycle.disconnected = True  # the endpoint stops: its receive() says http.disconnect, its sends are dropped
            cycle.message_event.set()
        if transport.is_closing():
            return
        response = error_response(status, code, message, self.server_state.default_headers, retry_after_s, headers)
        getattr(transport, "write_now", transport.write)(response)
        try:
            if transport.can_write_eof():
                transport.write_eof()
                self._linger = self.loop.call_later(LINGER_S, transport.close)
                return
        except (OSError, RuntimeError, NotImplementedError):
            pass
        transport.close()


def bind_socket(host: str = "127.0.0.1", port: int = 0) -> socket.socket:
    """A bound TCP socket for ``server.serve(sockets=[sock])`` (port 0: any free port).

    Created with ``IPPROTO_TCP`` explicitly: asyncio sets TCP_NODELAY only on connections of such
    sockets, and without it a response written in two parts waits ~40 ms for a delayed ACK.
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    return sock


def make_server(app: ASGIApp, host: str = "127.0.0.1", port: int = 8000,
                log_level: str = "warning", tls: TlsFiles | None = None,
                limits: HttpLimits | None = None) -> uvicorn.Server:
    """A uvicorn server for ``app`` tuned for the router: :class:`HttpProtocol`, no lifespan, no
    access log, no ``server`` header.

    uvicorn leaves the process's logging configuration alone (``log_config=None``); the CLI
    configures logging once for every component.

    Run it with ``await server.serve()``, or ``await server.serve(sockets=[bind_socket(host, 0)])``
    to serve on a free port; stop it with ``server.should_exit = True``. ``tls``: serve HTTPS with
    its certificate (no client certificate asked: API keys authenticate clients). ``limits``: the
    slow-client and overload limits (default :class:`HttpLimits`' defaults), with an in-flight
    count of this server's own.
    """
    limits = HttpLimits() if limits is None else limits
    protocol = protocol_class(limits)
    config = uvicorn.Config(app, host=host, port=port, http=protocol, ws="none", lifespan="off",
                            access_log=False, log_config=None, log_level=log_level,
                            server_header=False, proxy_headers=False,
                            ssl_certfile=tls.cert if tls else None, ssl_keyfile=tls.key if tls else None,
                            # uvicorn types it int; it is a delay for call_later, and seconds may be fractional
                            timeout_keep_alive=cast(int, limits.idle_timeout_s))
    return uvicorn.Server(config)


def protocol_class(limits: HttpLimits) -> type[HttpProtocol]:
    """:class:`HttpProtocol` for one server: ``limits``, and an in-flight count of its own."""
    return cast("type[HttpProtocol]", type("HttpProtocol", (HttpProtocol,),
                                           {"limits": limits, "gate": _Gate(), "__module__": __name__}))
