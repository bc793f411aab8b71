"""The router's HTTP/1.1 server: uvicorn's httptools protocol, with the two generation POSTs on a
request cycle of its own. Everything uvicorn- and httptools-specific lives here; the OpenAI API
(``pdrouter.router.frontdoor.http_api``) knows only the seam below. The generation POSTs' request
cycle (:class:`FastCycle`, :func:`whole_request`, the corked transport) is in ``http_cycle``.

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
import json
import logging
import math
import socket
import time
from collections.abc import Callable, Mapping, Sequence
from typing import ClassVar, NamedTuple, Protocol, cast, runtime_checkable

import uvicorn
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from pdrouter.core.tls import TlsFiles
from pdrouter.router.frontdoor.http_cycle import (
    ASGIApp,
    CorkedTransport,
    FastCycle,
    Handler,
    RequestHead,
    as_values,
    first_value,
    status_line,
    trace_values,
    whole_request_head,
)
from pdrouter.router.frontdoor.limits import HttpLimits

log = logging.getLogger(__name__)

PROBE_PATHS = frozenset({b"/health", b"/healthz"})
"""Paths the in-flight cap never refuses."""

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
    at most :data:`READ_SIZE` bytes at a time, writing through a :class:`CorkedTransport`, under
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
                if not self._passes(b"POST", path, as_values(head.authorization), as_values(head.content_type)) \
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
        head = RequestHead(first_value(authorization), first_value(content_type), first_value(request_id),
                           *trace_values(trace))
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
        corked = CorkedTransport(cast(asyncio.Transport, transport))  # a stream connection
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
    # ASGI 3 named, not detected: uvicorn detects it by the app being a coroutine function, which a
    # compiled app (scripts/compile_engine.py --router) is not to `inspect`.
    config = uvicorn.Config(app, host=host, port=port, http=protocol, ws="none", lifespan="off", interface="asgi3",
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
