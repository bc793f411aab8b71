"""One streamed OpenAI ``/v1/completions`` request, timed token by token, as ``vllm bench serve`` times it.

Works against any OpenAI-compatible server (this router, vLLM, SGLang): the prompt goes as token
ids, ``max_tokens`` with ``ignore_eos`` fixes the output length, ``stream_options.include_usage``
asks for the server's token counts. Times, from the moment the request is written (its JSON body
is encoded before the clock starts):

* TTFT: the first streamed chunk with a choice, whether or not its text is empty (a token that
  completes no character, a special token), as ``vllm bench serve`` times it: counting only chunks
  with text would put the first token one or more steps late whenever a model's first token is an
  incomplete character;
* ITL: the gap between successive such chunks (one per token on servers that stream token by
  token, as vLLM's and this router's do; a chunk of several tokens counts once, as in
  ``vllm bench serve``);
* E2E: the end of the stream (``data: [DONE]``).

A chunk's time is when the bytes holding it were read: chunks that arrive in one read share it.

The connection is read by an asyncio protocol over ``httptools``' response parser: each read is parsed
and its events timed in the protocol's callback, and the request's coroutine wakes once, when its
response ends, instead of once per read (as a client's stream reader wakes it): much less CPU per token
when a stream arrives a token at a time (measured in ``docs/benchmarks.md``), CPU otherwise taken from
the servers it measures on the same machine. Through a proxy (the environment's ``*_PROXY``)
requests go through aiohttp instead.

Failures do not raise: the record says what happened (``http_429``, ``connect``, ``timeout``,
``protocol``, ``stream_error``…).
"""

from __future__ import annotations

import asyncio
import base64
import json
import netrc
import os
import ssl
import time
import urllib.parse
import urllib.request
from dataclasses import dataclass

import aiohttp
import httptools

from pdrouter.bench.stats import RequestRecord
from pdrouter.bench.workload import RequestSpec
from pdrouter.core.net import raise_open_file_limit


def server_reason(body: bytes) -> str:
    """The message of an OpenAI error body (``{"error": {"message": ...}}``), else the body's start;
    at most ``MAX_DETAIL`` characters."""
    text = body.decode("utf-8", "replace").strip()
    try:
        parsed = json.loads(text)
    except ValueError:
        parsed = None
    if isinstance(parsed, dict):
        error = parsed.get("error", parsed)
        message = error.get("message") if isinstance(error, dict) else error
        if message:
            text = str(message)
    return text[:MAX_DETAIL]


def _reason(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"[:MAX_DETAIL]


_JSON = {"Content-Type": "application/json"}

MAX_DETAIL = 300
"""Characters of a server's error message kept per failed request."""
CLIENT_CONNECTIONS = 8192
"""Connections the client opens at most: the requests it has in flight at once (one a connection). An
open-loop point keeps rate × lifetime requests in flight (144 req/s of 8B chat at time scale 1: about
1,300 at its peak), and one that finds every connection taken waits for one, inside its TTFT: the
client would measure its own cap. ``vllm bench serve`` sets none without ``--max-concurrency``; this
one is far above what a point here reaches, and only keeps a server that stops answering from taking
every descriptor of the client. A run reports the requests that waited (``ClientFigures``). (The help of
``pdrouter bench run --max-concurrency`` names the figure: it is built without importing this module.)"""
CLIENT_IDLE_S = 2.0
"""Seconds an idle kept-alive connection stays in the client's pool."""
CONNECT_TIMEOUT_S = 10.0
"""The most a TCP (and TLS) connect may take, whatever the request's own timeout."""
MAX_EVENT_BYTES = 1 << 20
"""The longest streamed line (an SSE event) taken; a longer one is a protocol error."""


class _Events:
    """One response's ``data:`` lines into its record: the token steps' times, the usage, an error event."""

    __slots__ = ("chunks", "last", "pending", "record", "sent")

    def __init__(self, record: RequestRecord, sent: float) -> None:
        self.record = record
        self.sent = sent
        self.last: float | None = None
        self.chunks = 0
        self.pending = b""
        """The start of a line that the next read ends."""

    def feed(self, piece: bytes, now: float) -> bool:
        """Take the bytes of one read, which arrived at ``now``: split into lines here, one call per read,
        not one per line (most reads under load hold several events), the events of one read sharing its
        time. True when an event ended the request (an error event); ValueError when the server broke
        the protocol (a line past ``MAX_EVENT_BYTES``, an event that is not JSON)."""
        lines = (self.pending + piece).split(b"\n") if self.pending else piece.split(b"\n")
        pending = self.pending = lines.pop()
        if len(pending) > MAX_EVENT_BYTES:
            raise ValueError(f"a streamed line longer than {MAX_EVENT_BYTES} bytes")
        return any(self.line(line, now) for line in lines)

    def end(self, now: float) -> bool:
        """The body ended: its last line, when no newline followed it (as ``feed``)."""
        pending, self.pending = self.pending, b""
        return bool(pending) and self.line(pending, now)

    def line(self, line: bytes, now: float) -> bool:
        """Take one line that arrived at ``now``; True when it ended the request (an error event)."""
        if not line.startswith(b"data:"):
            return False
        record = self.record
        data = line[5:].strip()
        if data == b"[DONE]":
            # The caller reads on to the end of the body (the servers end it right after): leaving
            # early would close the connection instead of pooling it, and every request would pay a
            # TCP connect inside its TTFT.
            record.e2e_s = now - self.sent
            return False
        event = json.loads(data)
        if event.get("error"):
            record.error = "stream_error"
            record.detail = server_reason(data)
            return True
        usage = event.get("usage")
        if usage:
            record.output_tokens = int(usage.get("completion_tokens") or 0)
            details = usage.get("prompt_tokens_details") or {}
            if details.get("cached_tokens") is not None:
                record.cached_tokens = int(details["cached_tokens"])
        # A chunk with a choice is a token step, its text empty or not (an incomplete character, a
        # special token): time to first token and the gaps count it, as vLLM's benchmark does.
        if not event.get("choices"):
            return False
        self.chunks += 1
        if self.last is None:
            record.ttft_s = now - self.sent
        else:
            record.itl_s.append(now - self.last)
        self.last = now
        return False


def environment_for(url: str, with_login: bool = True) -> tuple[str | None, str | None]:
    """What the environment says about requests to ``url``, as a client trusting it reads it (httpx's and
    curl's default, aiohttp's ``trust_env``): the proxy the ``*_PROXY`` variables name for its scheme,
    unless ``NO_PROXY`` exempts its host, and (``with_login``: no key was given) the login ``.netrc``
    (or the file ``NETRC`` names) holds for its host, as an ``Authorization`` header's value."""
    parts = urllib.parse.urlsplit(url)
    host = parts.hostname or ""
    proxy = None if urllib.request.proxy_bypass(host) else urllib.request.getproxies().get(parts.scheme)
    login = None
    if with_login and host:
        try:
            found = netrc.netrc(os.environ.get("NETRC")).authenticators(host)
        except (OSError, netrc.NetrcParseError):  # no such file (the usual case), or one that does not parse
            found = None
        if found is not None:
            login = "Basic " + base64.b64encode(f"{found[0] or ''}:{found[2] or ''}".encode()).decode()
    return proxy, login


class _Silence:
    """A read timeout for one request without a timer per read: aiohttp's ``sock_read`` cancels and makes
    one for every read, a tenth of the client's CPU per token on a stream read a token at a time. One timer
    here, which on firing re-arms itself for ``limit_s`` after the last read (``heard``, set by the
    reader); when nothing came for ``limit_s``, it cancels the request's task."""

    __slots__ = ("_handle", "_loop", "_task", "fired", "heard", "limit_s")

    def __init__(self, limit_s: float, now: float) -> None:
        self.limit_s = limit_s
        self.heard = now
        self.fired = False
        self._task = asyncio.current_task()
        self._loop = asyncio.get_running_loop()
        self._handle = self._loop.call_later(limit_s, self._check)

    def _check(self) -> None:
        quiet = time.perf_counter() - self.heard
        if quiet < self.limit_s:
            self._handle = self._loop.call_later(self.limit_s - quiet, self._check)
        elif self._task is not None:
            self.fired = True
            self._task.cancel()

    def ended(self) -> bool:
        """True when this silence cancelled the task (its cancellation then taken back); False when the
        cancellation came from elsewhere, too or alone."""
        return self.fired and self._task is not None and self._task.uncancel() == 0

    def stop(self) -> None:
        self._handle.cancel()


MAX_ERROR_BODY = 64 << 10
"""The most bytes of an error response's body kept (its message is in the first few hundred)."""


class _Failure(Exception):
    """A request's failure found on its connection: ``kind`` (``protocol``) and the reason."""

    def __init__(self, kind: str, detail: str) -> None:
        super().__init__(detail)
        self.kind = kind
        self.detail = detail


class _Connection(asyncio.Protocol):
    """One kept-alive HTTP/1.1 connection of the client, one request at a time.

    Written by hand over ``httptools``' parser (the HTTP parser uvicorn and this router use) rather than
    read through a client library's stream: here each read is parsed and its events are timed in this
    protocol's callbacks, and the request's coroutine wakes once, when the response has ended. A stream
    read a token at a time costs much less CPU a token than through aiohttp's reader
    (``benchmarks/bench_client_cpu.py --burst 1 --gap-ms 10``; the figures are in ``docs/benchmarks.md``)."""

    __slots__ = ("_body", "_events", "_parser", "_silence", "_status", "done", "idle_since",
                 "keep_alive", "lost", "transport")

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.lost = False
        self.keep_alive = False
        self.idle_since = 0.0
        self.done: asyncio.Future[None] | None = None
        self._parser = httptools.HttpResponseParser(self)
        self._events: _Events | None = None
        self._silence: _Silence | None = None
        self._status = 0
        self._body: list[bytes] = []

    # -- one request ------------------------------------------------------------------------
    def start(self, data: bytes, events: _Events, silence: _Silence) -> asyncio.Future[None]:
        """Write a request; the future ends with its response (``_Failure`` when the connection broke it)."""
        assert self.transport is not None
        self.done = asyncio.get_running_loop().create_future()
        self._parser = httptools.HttpResponseParser(self)
        self._events, self._silence = events, silence
        self._status, self._body = 0, []
        self.keep_alive = False
        self.transport.write(data)
        return self.done

    @property
    def status(self) -> int:
        return self._status

    def error_body(self) -> bytes:
        return b"".join(self._body)

    def _end(self, failure: _Failure | None = None) -> None:
        done = self.done
        if done is not None and not done.done():
            if failure is None:
                done.set_result(None)
            else:
                done.set_exception(failure)
        self._events = self._silence = None

    def _fail(self, failure: _Failure) -> None:
        self.keep_alive = False
        if self.transport is not None:
            self.transport.close()
        self._end(failure)

    # -- asyncio ----------------------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]  # a stream transport (asyncio's or uvloop's)

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost = True
        if self._events is None:
            return
        # An error body may end with the connection; a stream that sent [DONE] was whole.
        if (self._status and self._status != 200) or self._events.record.e2e_s is not None:
            self._end()
        else:
            self._end(_Failure("protocol", "the server closed the connection before the response ended"
                               + (f" ({exc})" if exc else "")))

    def data_received(self, data: bytes) -> None:
        if self._events is None:
            return  # bytes after a response that ended early (an error event): the connection is closing
        if self._silence is not None:
            self._silence.heard = time.perf_counter()
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserError as exc:
            if self._events is not None:  # (a failure a callback raised has ended the request already)
                self._fail(_Failure("protocol", f"the response is not HTTP/1.1: {exc}"[:MAX_DETAIL]))

    # -- httptools' callbacks ---------------------------------------------------------------------
    def on_headers_complete(self) -> None:
        self._status = self._parser.get_status_code()
        self.keep_alive = self._parser.should_keep_alive()

    def on_body(self, body: bytes) -> None:
        events = self._events
        if events is None:
            return
        if self._status != 200:
            if sum(map(len, self._body)) < MAX_ERROR_BODY:
                self._body.append(body)
            return
        try:
            if events.feed(body, time.perf_counter()):  # an error event: the request ends here
                self._fail(_Failure("", ""))
        except Exception as exc:  # the server broke the protocol (its JSON, or events of another shape)
            self._fail(_Failure("protocol", _reason(exc)))

    def on_message_complete(self) -> None:
        events = self._events
        if events is None:
            return
        if self._status == 200:
            try:
                events.end(time.perf_counter())
            except Exception as exc:
                self._fail(_Failure("protocol", _reason(exc)))
                return
        self._end()


@dataclass
class ClientFigures:
    """What a client's connection pool saw during a run (its own connections, not the proxied ones)."""

    connections: int
    """The cap (``max_connections``)."""
    peak_in_flight: int = 0
    """The most requests on a connection at once."""
    waited: int = 0
    """Requests that found every connection taken and waited for one (their TTFT holds the wait)."""
    in_flight: int = 0

    def to_dict(self) -> dict[str, int]:
        return {"connections": self.connections, "peak_in_flight": self.peak_in_flight,
                "waited_for_a_connection": self.waited}


class CompletionsClient:
    """Sends ``RequestSpec`` s to ``{base_url}/completions`` over kept-alive connections.

    Each connection is a ``_Connection`` (``httptools``' parser; see its docstring for why not a client
    library's stream), at most ``max_connections`` at once, the idle ones kept ``CLIENT_IDLE_S``. Through
    a proxy the environment names, requests go by aiohttp, as in ``vllm bench serve``.
    """

    def __init__(self, base_url: str, model: str, *, api_key: str | None = None, timeout_s: float = 600.0,
                 max_connections: int = CLIENT_CONNECTIONS) -> None:
        self.url = base_url.rstrip("/") + "/completions"
        self.model = model
        self._proxy, login = environment_for(self.url, with_login=api_key is None)
        authorization = f"Bearer {api_key}" if api_key else login
        self._headers = {**_JSON, **({"Authorization": authorization} if authorization else {})}
        # Each wait for the server's bytes (its answer's head, a slow server's next token) may last up to
        # timeout_s (``_Silence``), as may taking a pooled connection; a connect gets CONNECT_TIMEOUT_S at most.
        self.timeout_s = timeout_s
        self._timeout = aiohttp.ClientTimeout(total=None, connect=timeout_s,
                                              sock_connect=min(CONNECT_TIMEOUT_S, timeout_s))
        self._max_connections = max_connections
        self._session: aiohttp.ClientSession | None = None
        parts = urllib.parse.urlsplit(self.url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"the URL must be http:// or https:// with a host, not {base_url!r}")
        self._host = parts.hostname
        self._port = parts.port or (443 if parts.scheme == "https" else 80)
        self._ssl = ssl.create_default_context() if parts.scheme == "https" else None
        host = f"[{self._host}]" if ":" in self._host else self._host
        default_port = parts.port is None or parts.port == (443 if parts.scheme == "https" else 80)
        target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
        self._head = "".join([f"POST {target} HTTP/1.1\r\n",
                              f"Host: {host if default_port else f'{host}:{self._port}'}\r\n",
                              "User-Agent: pdrouter-bench\r\nAccept: text/event-stream\r\n",
                              *(f"{name}: {value}\r\n" for name, value in self._headers.items())])
        self._idle: list[_Connection] = []
        self._slots: asyncio.Semaphore | None = None
        self._open: set[_Connection] = set()
        self.figures = ClientFigures(max_connections)
        raise_open_file_limit(max_connections + 64)  # (and a few for the scrapes, the logs, the loop)

    def _http(self) -> aiohttp.ClientSession:
        """The session, made on first use (on the running event loop, as aiohttp wants)."""
        if self._session is None:
            # Idle connections are let go after 2 s: sooner than the router's keep-alive idle timeout (5 s
            # by default, as uvicorn's), so the client never reuses one the router is closing at that moment.
            connector = aiohttp.TCPConnector(limit=self._max_connections, keepalive_timeout=CLIENT_IDLE_S)
            # The proxy and the .netrc login come from ``environment_for``, found once: aiohttp's trust_env
            # looks both up again for every request, each in a thread of the default executor.
            self._session = aiohttp.ClientSession(connector=connector, headers=self._headers, timeout=self._timeout,
                                                  cookie_jar=aiohttp.DummyCookieJar())
        return self._session

    def body(self, spec: RequestSpec) -> dict[str, object]:
        return {"model": self.model, "prompt": list(spec.prompt), "max_tokens": spec.max_tokens,
                "temperature": 0.0, "ignore_eos": True, "stream": True,
                "stream_options": {"include_usage": True}}

    async def send(self, spec: RequestSpec, start_s: float, clock_zero: float) -> RequestRecord:
        """Run one request; ``start_s`` is its send time after the run's start (``clock_zero``)."""
        record = RequestRecord(index=spec.index, start_s=start_s, input_tokens=spec.input_tokens,
                               prompt_digest=spec.digest)
        # Encoded before the clock starts: the body is the client's work, not the server's (a
        # 8k-token prompt takes milliseconds to encode on a small machine).
        body = json.dumps(self.body(spec), separators=(",", ":")).encode()
        exchange = self._exchange if self._proxy is None else self._exchange_proxied
        sent = time.perf_counter()
        events = _Events(record, sent)
        silence = _Silence(self.timeout_s, sent)
        try:
            await exchange(body, events, silence)
        except _Failure as exc:
            if exc.kind:
                record.error, record.detail = exc.kind, exc.detail
        except TimeoutError as exc:  # a connect, or (aiohttp) taking a pooled connection, took too long
            record.error, record.detail = "timeout", _reason(exc)
        except (aiohttp.ClientConnectorError, ssl.SSLError) as exc:  # the proxy does not answer; TLS refused
            record.error, record.detail = "connect", _reason(exc)
        except (aiohttp.ClientError, ValueError) as exc:  # the server broke the protocol (JSON included)
            record.error, record.detail = "protocol", _reason(exc)
        except OSError as exc:  # nothing listens there, or the name does not resolve
            record.error, record.detail = "connect", _reason(exc)
        except asyncio.CancelledError:
            if not silence.ended():  # cancelled from outside, not by the silence
                record.error = "cancelled"
                raise
            record.error, record.detail = "timeout", f"no data from the server for {self.timeout_s:g} s"
        finally:
            silence.stop()
            if not record.output_tokens:
                record.output_tokens = events.chunks
        if record.e2e_s is None and not record.error:
            record.error, record.detail = "protocol", "the stream ended without data: [DONE]"
        return record

    async def _exchange(self, body: bytes, events: _Events, silence: _Silence) -> None:
        """The request on a kept-alive connection of this client's own; the events are read into
        ``events`` as they arrive. Raises ``_Failure`` when the connection broke the response."""
        record = events.record
        data = f"{self._head}Content-Length: {len(body)}\r\n\r\n".encode() + body
        if self._slots is None:
            self._slots = asyncio.Semaphore(self._max_connections)
        conn: _Connection | None = None
        figures = self.figures
        if self._slots.locked():
            figures.waited += 1
        try:
            async with self._slots:  # a request waiting for a connection: the wait is in its times
                figures.in_flight += 1
                figures.peak_in_flight = max(figures.peak_in_flight, figures.in_flight)
                try:
                    conn = await self._connection()
                    try:
                        await conn.start(data, events, silence)
                    finally:  # (a response broken after its head has its status too)
                        record.status = conn.status or record.status
                finally:
                    figures.in_flight -= 1
            if conn.keep_alive and not conn.lost:  # the response ended whole: the connection serves on
                conn.idle_since = time.monotonic()
                self._idle.append(conn)
            answered, conn = conn, None
            if answered.status != 200:
                record.error, record.detail = f"http_{answered.status}", server_reason(answered.error_body())
        finally:
            if conn is not None:  # not back in the pool: mid-response, broken or not to be kept
                self._discard(conn)

    async def _connection(self) -> _Connection:
        """An idle kept-alive connection, else a new one (a connect within ``CONNECT_TIMEOUT_S``)."""
        now = time.monotonic()
        while self._idle:
            conn = self._idle.pop()
            if not conn.lost and now - conn.idle_since < CLIENT_IDLE_S:
                return conn
            self._discard(conn)
        loop = asyncio.get_running_loop()
        _, conn = await asyncio.wait_for(
            loop.create_connection(_Connection, self._host, self._port, ssl=self._ssl),
            min(CONNECT_TIMEOUT_S, self.timeout_s))
        self._open.add(conn)
        return conn

    def _discard(self, conn: _Connection) -> None:
        self._open.discard(conn)
        if conn.transport is not None and not conn.lost:
            conn.transport.close()

    async def _exchange_proxied(self, body: bytes, events: _Events, silence: _Silence) -> None:
        """``_exchange`` through the environment's proxy, by aiohttp."""
        record = events.record
        async with self._http().post(self.url, data=body, proxy=self._proxy) as response:
            record.status = response.status
            if response.status != 200:
                record.error = f"http_{response.status}"
                record.detail = server_reason(await response.read())
                return
            async for piece in response.content.iter_any():
                now = silence.heard = time.perf_counter()
                if events.feed(piece, now):
                    return
            events.end(time.perf_counter())

    async def close(self) -> None:
        for conn in list(self._open):
            self._discard(conn)
        self._idle.clear()
        if self._session is not None:
            await self._session.close()
            self._session = None
