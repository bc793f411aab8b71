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

Failures do not raise: the record says what happened (``http_429``, ``connect``, ``timeout``,
``protocol``, ``stream_error``…).
"""

from __future__ import annotations

import asyncio
import base64
import json
import netrc
import os
import time
import urllib.parse
import urllib.request

import aiohttp

from pdrouter.bench.stats import RequestRecord
from pdrouter.bench.workload import RequestSpec


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
CLIENT_CONNECTIONS = 1024
"""Connections the client opens at most: the requests it has in flight at once (one a connection)."""
CLIENT_IDLE_S = 2.0
"""Seconds an idle kept-alive connection stays in the client's pool."""
CONNECT_TIMEOUT_S = 10.0
"""The most a TCP (and TLS) connect may take, whatever the request's own timeout."""
MAX_EVENT_BYTES = 1 << 20
"""The longest streamed line (an SSE event) taken; a longer one is a protocol error."""


class _Events:
    """One response's ``data:`` lines into its record: the token steps' times, the usage, an error event."""

    __slots__ = ("chunks", "last", "record", "sent")

    def __init__(self, record: RequestRecord, sent: float) -> None:
        self.record = record
        self.sent = sent
        self.last: float | None = None
        self.chunks = 0

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


class CompletionsClient:
    """Sends ``RequestSpec`` s to ``{base_url}/completions`` over one pooled HTTP client.

    The client is aiohttp's, as in ``vllm bench serve``: its C parsers read a streamed response for
    less CPU per token than httpx's pure-Python HTTP stack (measured by ``benchmarks/bench_client_cpu.py``;
    the figures are in ``docs/benchmarks.md``). The load generator shares the machine with what it
    measures, so what it spends per token is taken from the servers under test.
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
        http = self._http()
        sent = time.perf_counter()
        events = _Events(record, sent)
        silence = _Silence(self.timeout_s, sent)
        try:
            async with http.post(self.url, data=body, proxy=self._proxy) as response:
                record.status = response.status
                if response.status != 200:
                    record.error = f"http_{response.status}"
                    record.detail = server_reason(await response.read())
                    return record
                # The bytes as they arrive, split into lines here: one call per read, not one per line
                # (most reads under load hold several events). The events of one read share its time.
                pending = b""
                async for piece in response.content.iter_any():
                    now = silence.heard = time.perf_counter()
                    lines = (pending + piece).split(b"\n") if pending else piece.split(b"\n")
                    pending = lines.pop()  # the start of a line the next read ends
                    if len(pending) > MAX_EVENT_BYTES:
                        raise ValueError(f"a streamed line longer than {MAX_EVENT_BYTES} bytes")
                    for line in lines:
                        if events.line(line, now):
                            return record
                if pending and events.line(pending, time.perf_counter()):
                    return record
        except aiohttp.ClientConnectorError as exc:  # nothing listens there, or the name does not resolve
            record.error, record.detail = "connect", _reason(exc)
        except TimeoutError as exc:  # a connect, a pooled connection or a read that took too long
            record.error, record.detail = "timeout", _reason(exc)
        except (aiohttp.ClientError, ValueError) as exc:  # the server broke the protocol (JSON included)
            record.error, record.detail = "protocol", _reason(exc)
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

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None
