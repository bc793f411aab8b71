"""The OpenAI-compatible HTTP front door: an ASGI app (the server is ``pdrouter.router.frontdoor.http_server``).

Routes: ``POST /v1/completions``, ``POST /v1/chat/completions``, ``GET /v1/models``,
``GET /health`` (and ``/healthz``), ``GET /metrics`` (Prometheus text; not here when the router
serves it on a port of its own, :func:`metrics_app`); anything else is a JSON 404 (a known path with
another method, a JSON 405). The two generation POSTs go straight to their handler; everything
else is routed by Starlette.

Each request is decided on its head first (:meth:`HttpApp.check_head`, which the server calls
before it reads any byte of the body): with API keys (``pdrouter.router.frontdoor.auth``) every
path but ``/health`` and ``/healthz`` needs ``Authorization: Bearer <key>``: without it, or with a
key not accepted, the answer is 401 in OpenAI's error shape (``code`` ``invalid_api_key``) with
``WWW-Authenticate: Bearer``; a generation POST whose ``Content-Type`` is not JSON is answered 415
(``code`` ``unsupported_media_type``; no ``Content-Type`` at all is read as JSON). A client's
``X-Request-Id`` (at most 128 printable ASCII characters) is kept as the request's label: logged,
and echoed back in the response's ``x-request-id``; without one, that header carries the router's
own id for the request.

A generation request is validated and tokenized in the endpoint; the response object then drives
the dispatcher's stream itself, so that:

* the status line waits for the first token: an error raised before it (capacity, unknown
  model, unavailable…) is an ordinary HTTP error reply; one raised after it is an SSE event
  ``data: {"error": {...}}`` that ends the stream;
* a client disconnect (seen by a small task reading the ASGI ``receive`` channel) cancels the
  request's task, which closes the dispatcher's iterator and so cancels the request on the
  workers, whether it is queued, prefilling or streaming, streamed or not;
* a request that is not streamed and has no stop strings is ``RouterRequest.whole``: its worker
  sends the tokens in one chunk at the end, so the door parses and decodes once however long the
  output. Stop strings are matched here, on the decoded text, token by token (the worker has no
  text), so a request with them keeps its tokens coming as they are made: it ends at the token
  that completes one, its usage counts the tokens up to it, and the worker stops there.

With tenants (``pdrouter.core.tenants``) the request's key names its tenant, which the request
carries (its limits are the dispatcher's: ``pdrouter.router.tenancy``). With tracing
(``pdrouter.core.tracing``) each generation request is a server span continuing the client's W3C
``traceparent`` / ``tracestate`` (or starting a trace), ended when the response is.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import time
from collections.abc import AsyncGenerator, Awaitable, Callable, Mapping, Sequence
from contextlib import aclosing
from typing import Any

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route
from starlette.types import ASGIApp, Receive, Scope, Send

from pdrouter.core.errors import CancelledError, InvalidRequestError, PdRouterError
from pdrouter.core.tenants import Tenants
from pdrouter.core.tokenizer import Tokenizer
from pdrouter.core.tokens import TokenSink
from pdrouter.core.tracing import Tracing
from pdrouter.router.frontdoor.auth import OPEN_HTTP_PATHS, ApiKeys, AuthenticationError
from pdrouter.router.frontdoor.detokenize import TextStream
from pdrouter.router.frontdoor.generation import Piece, PieceState, stream_pieces
from pdrouter.router.frontdoor.http_cycle import NO_HEAD, FastCycle, Handler, RequestHead
from pdrouter.router.frontdoor.http_server import DISCONNECT_EXTENSION, OnDisconnect, Refusal, Verdict
from pdrouter.router.frontdoor.openai_responses import SseWriter, completion_body, error_reply, response_id
from pdrouter.router.frontdoor.openai_schema import OpenAIRequest, parse_openai_request, to_router_request
from pdrouter.router.frontdoor.served_models import FrontdoorConfig, ModelRegistry, ServedModel
from pdrouter.router.frontdoor.spans import describe, end_span

# The server's own, importable from here too by code that builds a door and its server together.
from pdrouter.router.metrics import METRICS_CONTENT_TYPE, RouterMetrics
from pdrouter.router.request import Dispatcher, RouterRequest, Usage

log = logging.getLogger(__name__)

_JSON = "application/json"
_SSE_HEADERS = [(b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache"),
                (b"x-accel-buffering", b"no")]


def _json_headers(body: bytes) -> list[tuple[bytes, bytes]]:
    return [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]


def _json_response(status: int, body: bytes, headers: Mapping[str, str] | None = None) -> Response:
    return Response(body, status_code=status, headers=headers, media_type=_JSON)


class HttpFrontdoor:
    """The OpenAI HTTP API over an dispatcher; :attr:`app` is the ASGI application to serve.

    ``tokenizers`` maps each served model name to its tokenizer; models the dispatcher lists
    without a tokenizer are not served. ``api_keys``: the keys requests need (none: open).
    ``serve_metrics`` False leaves ``/metrics`` to a listener of its own. ``tenants``: whose key is
    whose (None: no tenants); ``tracing``: the router's tracer (None: off). Each front door owns its
    state: no module globals.
    """

    def __init__(self, dispatcher: Dispatcher, tokenizers: Mapping[str, Tokenizer], *,
                 metrics: RouterMetrics | None = None, config: FrontdoorConfig | None = None,
                 api_keys: ApiKeys | None = None, serve_metrics: bool = True, tenants: Tenants | None = None,
                 tracing: Tracing | None = None) -> None:
        self.dispatcher = dispatcher
        self.tenants = tenants
        self.tracing = tracing
        self.config = config if config is not None else FrontdoorConfig()
        self.models = ModelRegistry(dispatcher, tokenizers, self.config.chat_template)
        self.metrics = metrics if metrics is not None else RouterMetrics()
        self.door_metrics = self.metrics.frontdoor("http")
        self.api_keys = api_keys if api_keys is not None and api_keys.enabled else None
        completions, chat_completions = _GenerationEndpoint(self, chat=False), _GenerationEndpoint(self, chat=True)
        routes = Starlette(
            routes=[
                Route("/v1/completions", completions, methods=["POST"]),
                Route("/v1/chat/completions", chat_completions, methods=["POST"]),
                Route("/v1/models", self._list_models, methods=["GET"]),
                Route("/health", self._health, methods=["GET"]),
                Route("/healthz", self._health, methods=["GET"]),
                *([Route("/metrics", self._metrics, methods=["GET"])] if serve_metrics else []),
            ],
            exception_handlers={404: self._no_route, 405: self._no_route},
        )
        self.app = HttpApp(routes, {"/v1/completions": completions, "/v1/chat/completions": chat_completions},
                           self.api_keys)

    async def generation(self, receive: Receive, send: Send, chat: bool,
                         on_disconnect: OnDisconnect | None = None, head: RequestHead = NO_HEAD) -> None:
        """Serve one ``/v1/completions`` (``chat`` False) or ``/v1/chat/completions`` request.

        ``on_disconnect`` (the server's :data:`DISCONNECT_EXTENSION`, when it has it) replaces the
        task that otherwise watches ``receive`` for the client going away. ``head``: the request's
        head (its ``X-Request-Id`` is echoed back; its key names its tenant; its trace context).
        """
        arrival = time.perf_counter()
        self.door_metrics.in_flight.inc()
        client_id: str | None = None
        span = None
        if self.tracing is not None:
            span = self.tracing.incoming("POST /v1/chat/completions" if chat else "POST /v1/completions",
                                         (("traceparent", head.traceparent), ("tracestate", head.tracestate)),
                                         {"http.request.method": "POST", "http.route": "/v1/chat/completions"
                                          if chat else "/v1/completions"})
        try:
            client_id = request_label(head.request_id)
            body = await self._read_body(receive)
            parsed = parse_openai_request(body, chat, self.config)
            served = self.models.get(parsed.model)
            timeout = self.config.request_timeout_s
            deadline = None if timeout is None else time.monotonic() + timeout
            tenant = None if self.tenants is None else self.tenants.for_authorization(head.authorization)
            router_request = to_router_request(parsed, served, self.config, deadline, client_id, tenant)
            if span is not None:
                router_request = dataclasses.replace(router_request, trace=span)
                describe(span, router_request)
        except Exception as exc:
            self.finish(exc, arrival, span)
            reply = error_reply(exc, self.config.retry_after_s)
            payload = reply.body()
            headers = [(k.encode(), v.encode()) for k, v in reply.headers.items()]
            headers += [(b"content-length", str(len(payload)).encode()), (b"content-type", b"application/json")]
            if client_id is not None:
                headers.append((b"x-request-id", client_id.encode()))
            await send({"type": "http.response.start", "status": reply.status, "headers": headers})
            await send({"type": "http.response.body", "body": payload, "more_body": False})
            return
        await _Generation(self, parsed, served, router_request, arrival).run(receive, send, on_disconnect)

    async def _read_body(self, receive: Receive) -> bytes:
        limit = self.config.max_body_bytes
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] != "http.request":  # http.disconnect
                raise CancelledError("the client disconnected while sending the request")
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > limit:
                raise InvalidRequestError(f"request body is larger than {limit} bytes")
            chunks.append(chunk)
            if not message.get("more_body", False):
                return chunks[0] if len(chunks) == 1 else b"".join(chunks)

    def finish(self, error: BaseException | None, arrival: float, span: Any = None) -> None:
        """Account one finished generation request (outcome, latency, in-flight gauge; its span)."""
        self.door_metrics.in_flight.dec()
        self.door_metrics.finished(error, time.perf_counter() - arrival)
        if span is not None:
            end_span(self.tracing, span, error)
        if isinstance(error, PdRouterError):
            if error.http_status >= 500:
                log.warning("request failed: %s: %s", type(error).__name__, error.message)
        elif error is not None and not isinstance(error, asyncio.CancelledError):
            log.error("request failed", exc_info=error)

    async def _list_models(self, request: Request) -> Response:
        data = [{"id": m.name, "object": "model", "created": m.info.created, "owned_by": "pd-router",
                 "max_model_len": m.info.max_context} for m in self.models.refresh()]
        return _json_response(200, json.dumps({"object": "list", "data": data}).encode())

    async def _health(self, request: Request) -> Response:
        return _json_response(200, b'{"status":"ok"}')

    async def _metrics(self, request: Request) -> Response:
        return Response(self.metrics.exposition(), media_type=METRICS_CONTENT_TYPE)

    async def _no_route(self, request: Request, exc: Exception) -> Response:
        status = exc.status_code if isinstance(exc, HTTPException) else 404
        headers = exc.headers if isinstance(exc, HTTPException) else None  # "Allow" with a 405
        what = "no such route" if status == 404 else "method not allowed"
        error = {"message": f"{what}: {request.method} {request.url.path}", "type": "invalid_request_error",
                 "param": None, "code": "not_found" if status == 404 else "method_not_allowed"}
        return _json_response(status, json.dumps({"error": error}, separators=(",", ":")).encode(), headers)


class HttpApp:
    """The ASGI application of an :class:`HttpFrontdoor`.

    ``POST`` requests to the generation paths go straight to their endpoint, skipping routing;
    every other request (other routes, other methods, unknown paths, any scope with a root path)
    goes through the Starlette ``routes``, which hold the same endpoints, so both ways answer alike.
    Every request's head is checked first (:meth:`check_head`): by the router's server before it
    reads the body, and here again for requests that arrive from another server.
    """

    __slots__ = ("_api_keys", "_posts", "_routes", "state")

    def __init__(self, routes: Starlette, posts: Mapping[str, ASGIApp], api_keys: ApiKeys | None = None) -> None:
        self._routes = routes
        self._posts = dict(posts)
        self._api_keys = api_keys
        self.state = routes.state

    def fast_handlers(self, on_disconnect: OnDisconnect) -> dict[bytes, tuple[Handler, int]]:
        """Per generation path: ``handler(receive, send, head)`` and the body limit, for the server's
        own request cycle (``pdrouter.router.frontdoor.http_server.FastRoutes``), which checks heads first."""
        out: dict[bytes, tuple[Handler, int]] = {}
        for path, endpoint in self._posts.items():
            if isinstance(endpoint, _GenerationEndpoint):
                out[path.encode()] = (endpoint.handler(on_disconnect), endpoint.body_limit)
        return out

    def check_head(self, method: bytes, path: bytes, authorization: Sequence[bytes],
                   content_type: Sequence[bytes]) -> Verdict:
        """The decision on a request's head (``pdrouter.router.frontdoor.http_server.HeadCheck``): 401 without
        an accepted key (on every path but the probes'), 415 for a generation POST that is not JSON.
        ``path`` is matched as sent: an encoded probe path needs the key like any other."""
        keys = self._api_keys
        proven = keys is None
        if keys is not None and path.decode("latin-1") not in OPEN_HTTP_PATHS:
            try:
                if len(authorization) > 1:
                    raise AuthenticationError("several Authorization headers: send one")
                keys.check(authorization[0] if authorization else None)
            except AuthenticationError as exc:
                return Verdict(Refusal(exc.http_status, exc.openai_code, exc.message, _WWW_AUTHENTICATE), False)
            proven = True
        if method == b"POST" and path.decode("latin-1") in self._posts:
            refusal = _content_type_refusal(content_type)
            if refusal is not None:
                return Verdict(refusal, proven)
        return Verdict(None, proven)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            refusal = self.check_head(scope["method"].encode("latin-1"), scope["path"].encode("latin-1"),
                                      _values(scope, b"authorization"), _values(scope, b"content-type")).refusal
            if refusal is not None:
                await send_refusal(send, refusal)
                return
        if scope["type"] == "http" and scope["method"] == "POST" and not scope.get("root_path"):
            endpoint = self._posts.get(scope["path"])
            if endpoint is not None:
                await endpoint(scope, receive, send)
                return
        await self._routes(scope, receive, send)


class _GenerationEndpoint:
    """The ASGI app of ``/v1/completions`` or ``/v1/chat/completions``.

    An object rather than a function, so that Starlette serves it as a plain ASGI app (no
    ``Request`` / ``Response`` objects) when it routes to it.
    """

    __slots__ = ("_chat", "_door")

    def __init__(self, door: HttpFrontdoor, chat: bool) -> None:
        self._door = door
        self._chat = chat

    @property
    def body_limit(self) -> int:
        return self._door.config.max_body_bytes

    def handler(self, on_disconnect: OnDisconnect) -> Handler:
        """The server's handler of this endpoint (the server has checked the head: ``HttpApp.check_head``)."""
        door, chat = self._door, self._chat

        def handle(receive: Receive, send: Send, head: RequestHead) -> Awaitable[None]:
            return door.generation(receive, send, chat, on_disconnect, head)
        return handle

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        extension = (scope.get("extensions") or {}).get(DISCONNECT_EXTENSION)
        labels = _values(scope, b"x-request-id")
        if len(labels) > 1:
            await send_refusal(send, Refusal(400, "invalid_request_id", "several X-Request-Id headers: send one"))
            return
        authorization = _values(scope, b"authorization")
        parent, state = _values(scope, b"traceparent"), _values(scope, b"tracestate")
        head = RequestHead(authorization[0] if authorization else None, None, labels[0] if labels else None,
                           parent[0] if len(parent) == 1 else None, state[0] if len(state) == 1 else None)
        await self._door.generation(receive, send, self._chat, extension["register"] if extension else None, head)


class _Generation:
    """The response to one completion request: runs the stream, answers, watches for disconnect."""

    __slots__ = ("_arrival", "_client_gone", "_complete", "_door", "_parsed", "_request", "_served")

    def __init__(self, door: HttpFrontdoor, parsed: OpenAIRequest, served: ServedModel,
                 request: RouterRequest, arrival: float) -> None:
        self._door = door
        self._parsed = parsed
        self._served = served
        self._request = request
        self._arrival = arrival
        self._complete = False      # the last byte of the response is (being) sent
        self._client_gone = False

    async def run(self, receive: Receive, send: Send, on_disconnect: OnDisconnect | None = None) -> None:
        """Answer the request on the ASGI channels; account it with the door when it ends."""
        task = asyncio.current_task()
        assert task is not None
        watcher: asyncio.Task[None] | None = None
        forget: Callable[[], None] | None = None
        if on_disconnect is not None:  # no task per request: the connection calls back
            forget = on_disconnect(lambda: self._client_lost(task))
        else:
            watcher = task.get_loop().create_task(self._watch_disconnect(receive, task))
        error: BaseException | None = None
        try:
            error = await (self._stream(send) if self._parsed.stream else self._unary(send))
        except asyncio.CancelledError as exc:
            error = exc
            if not self._client_gone:
                raise
            task.uncancel()
        finally:
            if forget is not None:
                forget()
            if watcher is not None:
                watcher.cancel()
            self._door.finish(error, self._arrival, self._request.trace)

    def _client_lost(self, task: asyncio.Task[Any]) -> None:
        if not self._complete:
            self._client_gone = True
            task.cancel()

    async def _watch_disconnect(self, receive: Receive, task: asyncio.Task[Any]) -> None:
        while (await receive())["type"] != "http.disconnect":
            pass
        self._client_lost(task)

    def _state(self) -> PieceState:
        """A new stream's progress: its text decoder (with the request's stop strings) and the door's metrics."""
        parsed = self._parsed
        return PieceState(TextStream(self._served.tokenizer.stream_decoder(), parsed.stop,
                                     parsed.include_stop_str_in_output), self._door.door_metrics)

    def _pieces(self, state: PieceState) -> aclosing[AsyncGenerator[Piece, None]]:
        """The request's pieces; ``state``: their progress (``_state``), shared with the caller."""
        door = self._door
        return aclosing(stream_pieces(door.dispatcher, self._request, state.text, state.metrics,
                                      self._arrival, stop_strings=bool(self._parsed.stop), state=state))

    def _sink(self, send: Send, writer: SseWriter, state: PieceState) -> TokenSink | None:
        """The request's ``TokenSink`` on this connection, when its chunks can bypass the stream; None where
        something must see every delta (stop strings cut the text; a tenant's count of its tokens), or
        ``send`` is not this server's (no way to write outside it).

        The chunks it takes from one read of the worker's connection become one SSE chunk (``flush``), as
        the stream merges the chunks that are already there into one delta (``TokenStream``), written as
        ``_stream`` writes a delta's."""
        cycle = getattr(send, "__self__", None)
        if self._parsed.stop or self._request.tenant is not None or not isinstance(cycle, FastCycle):
            return None
        can_send, send_now, later_text, text = cycle.can_send_now, cycle.send_now, state.later_text, writer.text
        sink = TokenSink()
        pending: list[int] = []

        def deliver(ids: tuple[int, ...]) -> bool:
            if not pending and not can_send():
                return False
            pending.extend(ids)
            return True

        def flush() -> None:
            ids = tuple(pending)
            pending.clear()
            if cycle.disconnected or cycle.response_complete:
                return  # (the client is gone: its task is being cancelled)
            try:
                send_now(text(later_text(ids)))
            except Exception as exc:  # the stream raises it to the consumer at its next chunk
                sink.deliver, sink.error = None, exc

        sink.deliver, sink.flush = deliver, flush
        return sink

    def _headers(self, base: list[tuple[bytes, bytes]]) -> list[tuple[bytes, bytes]]:
        request = self._request
        return [*base, (b"x-request-id", (request.label or request.request_id).encode())]

    async def _unary(self, send: Send) -> BaseException | None:
        texts: list[str] = []
        try:
            async with self._pieces(self._state()) as pieces:
                async for piece in pieces:
                    texts.append(piece.text)
                    if piece.finish_reason is not None:
                        body = completion_body(self._parsed.chat, response_id(self._request, self._parsed.chat),
                                               int(time.time()), self._served.name, "".join(texts),
                                               piece.finish_reason, _usage(piece))
                        self._complete = True
                        await send({"type": "http.response.start", "status": 200,
                                    "headers": self._headers(_json_headers(body))})
                        await send({"type": "http.response.body", "body": body, "more_body": False})
        except Exception as exc:
            return await self._fail(send, exc, started=False)
        return None

    async def _stream(self, send: Send) -> BaseException | None:
        parsed = self._parsed
        writer = SseWriter(parsed.chat, response_id(self._request, parsed.chat), int(time.time()),
                           self._served.name, parsed.include_usage)
        state = self._state()
        # After the first delta, the worker call hands the later ones straight to ``deliver`` while this
        # loop waits (``TokenSink``): their chunks are written as the loop below would write them.
        sink = self._sink(send, writer, state)
        deliver = None
        if sink is not None:
            self._request = dataclasses.replace(self._request, sink=sink)
            deliver, sink.deliver = sink.deliver, None
        started = False
        try:
            async with self._pieces(state) as pieces:
                async for piece in pieces:
                    if not started:
                        started = True
                        await send({"type": "http.response.start", "status": 200,
                                    "headers": self._headers(_SSE_HEADERS)})
                    if piece.finish_reason is not None:
                        self._complete = True
                        await send({"type": "http.response.body", "more_body": False,
                                    "body": writer.final(piece.text, piece.finish_reason, _usage(piece))})
                    else:  # one chunk per token delta, its text empty while a character is incomplete (as vLLM's)
                        await send({"type": "http.response.body", "body": writer.text(piece.text),
                                    "more_body": True})
                        if sink is not None:
                            sink.deliver = deliver
        except Exception as exc:
            return await self._fail(send, exc, started)
        finally:
            if sink is not None:
                sink.deliver = None
        return None

    async def _fail(self, send: Send, exc: Exception, started: bool) -> BaseException | None:
        if self._complete:  # the client has its answer; only the stream's tail failed
            log.warning("request %s: error after the response was sent: %s", self._request.request_id, exc)
            return None
        self._complete = True
        reply = error_reply(exc, self._door.config.retry_after_s)
        if started:
            await send({"type": "http.response.body", "body": reply.sse_event(), "more_body": False})
        else:
            body = reply.body()
            headers = [(k.encode(), v.encode()) for k, v in reply.headers.items()]
            await send({"type": "http.response.start", "status": reply.status,
                        "headers": self._headers([*_json_headers(body), *headers])})
            await send({"type": "http.response.body", "body": body, "more_body": False})
        return exc


_WWW_AUTHENTICATE = ((b"www-authenticate", b"Bearer"),)
MAX_LABEL_CHARS = 128
"""The longest ``X-Request-Id`` kept (as the gRPC door's ``request_id``)."""


def request_label(value: bytes | None) -> str | None:
    """The client's ``X-Request-Id`` as a label (None without one); InvalidRequestError when it is
    longer than :data:`MAX_LABEL_CHARS` or not printable ASCII."""
    if value is None:
        return None
    if len(value) > MAX_LABEL_CHARS or not (value.isascii() and value.decode("ascii").isprintable()):
        raise InvalidRequestError(f"the X-Request-Id header must be at most {MAX_LABEL_CHARS} printable ASCII "
                                  f"characters")
    return value.decode("ascii") or None


def _content_type_refusal(content_type: Sequence[bytes]) -> Refusal | None:
    """415 unless the request's ``Content-Type`` is JSON (``application/json`` or ``*/*+json``, any
    parameters) or absent."""
    if not content_type:
        return None
    if len(content_type) == 1:
        media = content_type[0].partition(b";")[0].strip().lower()
        if media == b"application/json" or (media.startswith(b"application/") and media.endswith(b"+json")):
            return None
        shown = content_type[0][:64].decode("latin-1")
        shown = shown if shown.isprintable() else "(unprintable)"
        message = f"the request body must be JSON: send Content-Type: application/json, not {shown!r}"
    else:
        message = "several Content-Type headers: send one, application/json"
    return Refusal(415, "unsupported_media_type", message)


def _values(scope: Scope, name: bytes) -> list[bytes]:
    """Every value of the request's header ``name`` (lower case)."""
    return [value for key, value in scope["headers"] if key == name]


async def send_refusal(send: Send, refusal: Refusal) -> None:
    """Answer a refused head in OpenAI's error shape (with the refusal's own headers)."""
    body = json.dumps({"error": {"message": refusal.message, "type": "invalid_request_error", "param": None,
                                 "code": refusal.code}}, separators=(",", ":")).encode()
    await send({"type": "http.response.start", "status": refusal.status,
                "headers": [*_json_headers(body), *refusal.headers]})
    await send({"type": "http.response.body", "body": body, "more_body": False})


def metrics_app(metrics: RouterMetrics) -> ASGIApp:
    """The ASGI application of a metrics listener (``--metrics-port``): ``GET /metrics`` and
    ``GET /health``, no key asked (bind it where only the scrapers reach); anything else 404."""
    content_type = METRICS_CONTENT_TYPE.encode()

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return
        if scope["method"] in ("GET", "HEAD") and scope["path"] == "/metrics":
            status, body, kind = 200, metrics.exposition(), content_type
        elif scope["method"] in ("GET", "HEAD") and scope["path"] in OPEN_HTTP_PATHS:
            status, body, kind = 200, b'{"status":"ok"}', b"application/json"
        else:
            status, body, kind = 404, b"not found\n", b"text/plain; charset=utf-8"
        await send({"type": "http.response.start", "status": status,
                    "headers": [(b"content-type", kind), (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": b"" if scope["method"] == "HEAD" else body})
    return app


def _usage(piece: Piece) -> Usage:
    assert piece.usage is not None  # stream_pieces puts usage on every finished piece
    return piece.usage


def create_app(dispatcher: Dispatcher, tokenizers: Mapping[str, Tokenizer], *,
               metrics: RouterMetrics | None = None, config: FrontdoorConfig | None = None,
               api_keys: ApiKeys | None = None, serve_metrics: bool = True, tenants: Tenants | None = None,
               tracing: Tracing | None = None) -> HttpApp:
    """The ASGI app of an :class:`HttpFrontdoor` (its front door is ``app.state.frontdoor``)."""
    door = HttpFrontdoor(dispatcher, tokenizers, metrics=metrics, config=config, api_keys=api_keys,
                         serve_metrics=serve_metrics, tenants=tenants, tracing=tracing)
    door.app.state.frontdoor = door
    return door.app
