"""The gRPC front door: ``pdrouter.v1.Router`` (``Generate`` stream, ``ListModels``), and the
:class:`ApiKeyInterceptor` that refuses calls without an accepted key when the router has keys.

Protobuf stops here: :func:`to_router_request` and :func:`to_response` are the only places that
convert between ``router_pb2`` messages and the router's dataclasses. Errors are
``pdrouter.core.errors`` types mapped to status codes by ``pdrouter.wire.grpc_util.grpc_errors``
(INVALID_ARGUMENT, NOT_FOUND, RESOURCE_EXHAUSTED, UNAVAILABLE…); anything else is INTERNAL.

Requests are parsed by :func:`add_to_server`'s own deserializers: bytes that are not a valid
message (bad UTF-8 in a string, a corrupt wire format) reach the servicer as :class:`Undecodable`
and end INVALID_ARGUMENT, as any other bad request does, rather than gRPC's UNKNOWN.

``Generate`` writes its messages with ``context.write`` from the handler's own coroutine rather
than being an async generator: when the client cancels, gRPC cancels that coroutine wherever it
waits (for a token or for flow control), so the dispatcher's iterator is closed at once and the
request is cancelled on the workers.

With tenants the call's ``authorization`` key names its tenant; with tracing the call is a server
span continuing the ``traceparent`` / ``tracestate`` of its metadata (or starting a trace).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from contextlib import aclosing
from typing import Any

import grpc
from google.protobuf.message import DecodeError, Message

from pdrouter.core.errors import InvalidRequestError, PdRouterError
from pdrouter.core.hashing import cache_salt_key
from pdrouter.core.ids import new_request_id
from pdrouter.core.sampling import SamplingParams
from pdrouter.core.tenants import Tenant, Tenants
from pdrouter.core.tls import TlsFiles
from pdrouter.core.tokenizer import Tokenizer
from pdrouter.core.tracing import Tracing
from pdrouter.router.frontdoor.auth import ApiKeys, AuthenticationError
from pdrouter.router.frontdoor.detokenize import TextStream
from pdrouter.router.frontdoor.generation import Piece, stream_pieces
from pdrouter.router.frontdoor.openai_schema import MAX_MODEL_NAME_CHARS, check_cache_salt
from pdrouter.router.frontdoor.served_models import FrontdoorConfig, ModelRegistry, ServedModel
from pdrouter.router.frontdoor.spans import describe, end_span
from pdrouter.router.metrics import RouterMetrics
from pdrouter.router.request import Dispatcher, FinishReason, RouterRequest, prompt_ids
from pdrouter.wire.grpc_limits import GrpcLimits
from pdrouter.wire.grpc_util import GrpcServer, grpc_errors
from pdrouter.wire.h2_grpc import UNARY_STREAM, UNARY_UNARY, H2GrpcServer, Method
from pdrouter.wire.security import CredentialInterceptor, grpc_server_credentials, single_entry
from pdrouter.wire.v1 import common_pb2, router_pb2, router_pb2_grpc

log = logging.getLogger(__name__)

SERVICE_NAME = "pdrouter.v1.Router"
MAX_REQUEST_ID_LEN = 128

_FINISH_TO_PB = {FinishReason.STOP: common_pb2.FINISH_REASON_STOP,
                 FinishReason.LENGTH: common_pb2.FINISH_REASON_LENGTH,
                 FinishReason.ABORT: common_pb2.FINISH_REASON_ABORT}


def to_router_request(msg: router_pb2.GenerateRequest, served: ServedModel, config: FrontdoorConfig,
                      deadline: float | None, tenant: Tenant | None = None) -> RouterRequest:
    """A validated ``RouterRequest`` from a ``GenerateRequest`` for ``served``.

    Unset proto3 scalars read as: ``max_tokens`` 0 → the context left after the prompt capped at
    ``config.default_max_tokens`` (as over HTTP); ``top_p`` 0 → 1; ``temperature`` 0 → greedy.
    The request always gets a fresh id of the router's; the client's ``request_id``, when set, is
    only its label (echoed in the responses). Every field is bounded as over HTTP (``top_k`` at
    most ``MAX_TOP_K``, ``seed`` below 2^63, ``temperature`` finite in [0, 100]…): a bad value is an
    InvalidRequestError (INVALID_ARGUMENT) naming the field. ``tenant`` (the call's key's) gives
    its priority class and its part of the cache salt.
    """
    if len(msg.request_id) > MAX_REQUEST_ID_LEN:
        raise InvalidRequestError(f"request_id is longer than {MAX_REQUEST_ID_LEN} characters")
    if msg.request_id and not (msg.request_id.isascii() and msg.request_id.isprintable()):
        raise InvalidRequestError("request_id must be printable ASCII")
    if len(msg.model) > MAX_MODEL_NAME_CHARS:
        raise InvalidRequestError(f"model names have at most {MAX_MODEL_NAME_CHARS} characters")
    which = msg.WhichOneof("prompt")
    ids: Sequence[int]
    if which == "text":
        ids = served.tokenizer.encode_prompt(msg.text)
    elif which == "token_ids":
        ids = tuple(msg.token_ids.ids)
        served.check_token_ids(ids, "token_ids")
    else:
        raise InvalidRequestError("prompt is required: set text or token_ids")
    s = msg.sampling
    stop_ids = tuple(s.stop_token_ids)
    served.check_token_ids(stop_ids, "sampling.stop_token_ids")
    max_tokens = served.max_tokens_for(len(ids), s.max_tokens or None, config.default_max_tokens)
    sampling = sampling_params(s, max_tokens)
    salt = check_cache_salt(msg.cache_salt or None, "cache_salt")
    prompt = prompt_ids(ids)
    if tenant is None and salt is None:
        return RouterRequest(new_request_id(), served.name, prompt, sampling, deadline,
                             label=msg.request_id or None)
    return RouterRequest(new_request_id(), served.name, prompt, sampling, deadline, label=msg.request_id or None,
                         tenant=tenant, priority=0 if tenant is None else tenant.priority,
                         cache_salt=cache_salt_key(None if tenant is None else tenant.salt_scope, salt))


def sampling_params(s: common_pb2.SamplingParams, max_tokens: int) -> SamplingParams:
    """The request's ``SamplingParams``; InvalidRequestError naming ``sampling.<field>`` when one is out of range."""
    try:
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=round(s.temperature, 6),  # float32 on the wire: 0.7 arrives as 0.69999998…
            top_p=round(s.top_p, 6) or 1.0,
            top_k=s.top_k,
            seed=s.seed if s.HasField("seed") else None,
            stop_token_ids=tuple(s.stop_token_ids),
            ignore_eos=s.ignore_eos,
        )
    except InvalidRequestError as exc:
        raise InvalidRequestError(f"sampling.{exc.message}") from None


def to_response(request_id: str, piece: Piece) -> router_pb2.GenerateResponse:
    """One ``GenerateResponse`` for ``piece``; the finished one carries finish_reason and usage."""
    msg = router_pb2.GenerateResponse(request_id=request_id, token_ids=piece.token_ids, text=piece.text)
    if piece.finish_reason is not None:
        msg.finish_reason = _FINISH_TO_PB[piece.finish_reason]
        if piece.usage is not None:
            msg.usage.prompt_tokens = piece.usage.prompt_tokens
            msg.usage.completion_tokens = piece.usage.completion_tokens
            msg.usage.cached_tokens = piece.usage.cached_tokens
    return msg


class RouterServicer(router_pb2_grpc.RouterServicer):
    """``pdrouter.v1.Router`` over an dispatcher; register with ``router_pb2_grpc.add_RouterServicer_to_server``.

    ``tokenizers`` maps each served model name to its tokenizer, as for the HTTP door; pass the
    same ``metrics`` to both doors to export them on one registry. ``tenants`` and ``tracing`` as
    for the HTTP door.
    """

    def __init__(self, dispatcher: Dispatcher, tokenizers: Mapping[str, Tokenizer], *,
                 metrics: RouterMetrics | None = None, config: FrontdoorConfig | None = None,
                 tenants: Tenants | None = None, tracing: Tracing | None = None) -> None:
        self.dispatcher = dispatcher
        self.tenants = tenants
        self.tracing = tracing
        self.config = config if config is not None else FrontdoorConfig()
        self.models = ModelRegistry(dispatcher, tokenizers, self.config.chat_template)
        self.metrics = metrics if metrics is not None else RouterMetrics()
        self.door_metrics = self.metrics.frontdoor("grpc")

    @grpc_errors
    async def Generate(self, request: router_pb2.GenerateRequest | Undecodable,
                       context: grpc.aio.ServicerContext) -> None:
        arrival = time.perf_counter()
        metrics = self.door_metrics
        metrics.in_flight.inc()
        error: BaseException | None = None
        span: Any = None
        if self.tracing is not None:
            span = self.tracing.incoming("pdrouter.v1.Router/Generate", context.invocation_metadata(), {
                "rpc.system": "grpc", "rpc.service": SERVICE_NAME, "rpc.method": "Generate"})
        try:
            if isinstance(request, Undecodable):
                raise InvalidRequestError(request.message)
            if not request.model:
                raise InvalidRequestError("model is required")
            served = self.models.get(request.model)
            remaining = context.time_remaining()
            deadline = None if remaining is None else time.monotonic() + remaining
            tenant = None
            if self.tenants is not None:
                key, _ = single_entry(context.invocation_metadata() or (), "authorization")
                tenant = self.tenants.for_authorization(key)
            router_request = to_router_request(request, served, self.config, deadline, tenant)
            if span is not None:
                router_request = dataclasses.replace(router_request, trace=span)
                describe(span, router_request)
            rid = router_request.label or router_request.request_id
            text = TextStream(served.tokenizer.stream_decoder())
            async with aclosing(stream_pieces(self.dispatcher, router_request, text, metrics,
                                              arrival)) as pieces:
                async for piece in pieces:
                    await context.write(to_response(rid, piece))
        except (PdRouterError, asyncio.CancelledError) as exc:
            error = exc
            raise
        except Exception as exc:
            log.error("Generate failed", exc_info=exc)
            error = exc
            raise PdRouterError(f"internal error ({type(exc).__name__})") from exc
        finally:
            metrics.in_flight.dec()
            metrics.finished(error, time.perf_counter() - arrival)
            if span is not None:
                end_span(self.tracing, span, error)

    @grpc_errors
    async def ListModels(self, request: router_pb2.ListModelsRequest | Undecodable,
                         context: grpc.aio.ServicerContext) -> router_pb2.ListModelsResponse:
        if isinstance(request, Undecodable):
            raise InvalidRequestError(request.message)
        cards = [router_pb2.ModelCard(
            id=m.name, block_size=m.info.block_size,
            geometry=common_pb2.ModelGeometry(name=m.name, vocab_size=m.info.vocab_size,
                                              max_context=m.info.max_context))
            for m in self.models.refresh()]
        return router_pb2.ListModelsResponse(models=cards)


class ApiKeyInterceptor(CredentialInterceptor):
    """Serves a call only when its metadata has ``authorization: Bearer <key>`` for one of ``keys``;
    else the call ends UNAUTHENTICATED before its handler runs, and before any byte of its request
    message is read.
    The health service (``grpc.health.v1.Health``) stays open for probes."""

    def __init__(self, keys: ApiKeys) -> None:
        self._keys = keys

    def refusal_reason(self, metadata: Sequence[tuple[str, str | bytes]]) -> str | None:
        presented, reason = single_entry(metadata, "authorization")
        if reason is not None:
            return reason
        try:
            self._keys.check(presented)
        except AuthenticationError as exc:
            return exc.message
        return None


class Undecodable:
    """What a request deserializer of :func:`add_to_server` gives for bytes that are not its message."""

    __slots__ = ("message",)

    def __init__(self, message: str) -> None:
        self.message = message


def _decoder(message_type: type[Message]) -> Callable[[bytes], Message | Undecodable]:
    name = message_type.DESCRIPTOR.name

    def decode(data: bytes) -> Message | Undecodable:
        try:
            return message_type.FromString(data)
        except DecodeError as exc:
            return Undecodable(f"the request is not a valid {name} message ({exc})")
    return decode


def router_methods(servicer: RouterServicer) -> dict[str, Method]:
    """``pdrouter.v1.Router``'s methods on ``servicer``, with :func:`_decoder` s for the requests
    (``tests/router/test_input_bounds.py`` checks that every method of the proto is served)."""
    return {
        "Generate": Method(UNARY_STREAM, servicer.Generate, _decoder(router_pb2.GenerateRequest),
                           router_pb2.GenerateResponse.SerializeToString),
        "ListModels": Method(UNARY_UNARY, servicer.ListModels, _decoder(router_pb2.ListModelsRequest),
                             router_pb2.ListModelsResponse.SerializeToString),
    }


_GRPCIO_HANDLERS = {UNARY_STREAM: grpc.unary_stream_rpc_method_handler,
                    UNARY_UNARY: grpc.unary_unary_rpc_method_handler}


def _add_router_servicer(servicer: RouterServicer, server: grpc.aio.Server) -> None:
    """:func:`router_methods` on a grpcio server."""
    handlers = {name: _GRPCIO_HANDLERS[m.cardinality](m.handler, request_deserializer=m.deserialize,
                                                         response_serializer=m.serialize)
                for name, m in router_methods(servicer).items()}
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE_NAME, handlers),))
    server.add_registered_method_handlers(SERVICE_NAME, handlers)


DOOR_SERVERS = ("builtin", "grpcio")
"""The door's servers (``RouterConfig.grpc_server``): its own (``pdrouter.wire.h2_grpc``) and grpcio's."""


def door_server(kind: str, host: str = "127.0.0.1", port: int = 0, *, tls: TlsFiles | None = None,
                limits: GrpcLimits | None = None, keys: ApiKeys | None = None) -> GrpcServer | H2GrpcServer:
    """An unstarted door server of ``kind`` (:data:`DOOR_SERVERS`) bound to ``host:port`` (0: a free
    port): TLS with ``tls`` (no client certificate asked); with ``keys``, every call but the health
    service's needs one of them (UNAUTHENTICATED, before its message is read)."""
    check = ApiKeyInterceptor(keys) if keys is not None and keys.enabled else None
    if kind == "builtin":
        return H2GrpcServer(host, port, tls=tls, limits=limits, refusal=None if check is None else check.refusal_reason)
    if kind == "grpcio":
        credentials = None if tls is None else grpc_server_credentials(tls, require_client_cert=False)
        return GrpcServer(host, port, credentials=credentials, limits=limits,
                          interceptors=() if check is None else (check,))
    raise ValueError(f"the gRPC door's server is one of {DOOR_SERVERS}, not {kind!r}")


def add_to_server(server: GrpcServer | H2GrpcServer, servicer: RouterServicer) -> None:
    """Serve ``servicer`` as ``pdrouter.v1.Router`` on ``server`` (its health service included)."""
    if isinstance(server, H2GrpcServer):
        server.add_service(SERVICE_NAME, router_methods(servicer))
    else:
        server.add(_add_router_servicer, servicer, SERVICE_NAME)
