"""Who may call a worker: the internal secret, mutual TLS, and the gRPC plumbing for both.

Every internal call — router → worker (gRPC and the lane), decode → prefill — is authenticated by
one or both of:

- **the internal secret** (``PDROUTER_INTERNAL_TOKEN``, or ``PDROUTER_INTERNAL_TOKEN_FILE``): the
  router and every worker share it, and it never travels. On gRPC the worker first proves to the
  caller that it holds the secret and answers at the address dialled, then every call carries a
  proof of its own (``pdrouter.wire.call_proofs``); the lane runs a challenge-response with the
  same two properties (``pdrouter.wire.lane``). A server that cannot prove itself is sent nothing
  but that first health check, so a registry record forged to point at a foreign server gets
  neither requests nor the secret;
- **mutual TLS** (``--tls-ca``/``--tls-cert``/``--tls-key``): worker ports accept only clients with a
  certificate from the CA, and clients accept only workers with one for the host they dial.

:class:`PeerSecurity` is one process's side of both: the server credentials and interceptors of a
worker's gRPC port, the channels its clients open, the lane's token and ``ssl`` contexts. The
standard health service stays open for probes. Without either, internal ports are open (allowed
only where the CLI allows it: see ``pdrouter worker --help``).
"""

from __future__ import annotations

import asyncio
import hmac
import secrets
import ssl
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import grpc
from grpc_health.v1 import health_pb2

from pdrouter.core.errors import ConfigError
from pdrouter.core.tls import TlsFiles
from pdrouter.wire.call_proofs import (
    CALL_PROOF_METADATA,
    CHALLENGE_BYTES,
    CHALLENGE_METADATA,
    IDENTITY_METADATA,
    PEER_PROOF_METADATA,
    TARGET_METADATA,
    ReplayWindow,
    check_call_proof,
    new_call_proof,
    peer_proof,
)
from pdrouter.wire.grpc_util import StatusError

INTERNAL_TOKEN_ENV = "PDROUTER_INTERNAL_TOKEN"
"""The secret the router and the workers share (or ``PDROUTER_INTERNAL_TOKEN_FILE``: a file holding it)."""
MIN_TOKEN_BYTES = 16
OPEN_GRPC_PREFIX = "/grpc.health.v1.Health/"
"""gRPC methods served without credentials: the standard health service."""
HEALTH_CHECK = OPEN_GRPC_PREFIX + "Check"
PROVE_TIMEOUT_S = 5.0
"""How long a caller waits for a worker to prove itself (the first call on a channel waits for it)."""


def check_token(token: str) -> str:
    """``token`` when it is long enough to be a secret; ConfigError (one line, never the token) otherwise."""
    if len(token.encode()) < MIN_TOKEN_BYTES:
        raise ConfigError(f"{INTERNAL_TOKEN_ENV} must be at least {MIN_TOKEN_BYTES} bytes (make one with: "
                          f"python -c 'import secrets; print(secrets.token_hex(16))')")
    return token


@dataclass(frozen=True)
class PeerSecurity:
    """One process's credentials for internal calls: the shared secret, TLS files, or both."""

    token: str | None = field(default=None, repr=False)
    tls: TlsFiles | None = None

    def __post_init__(self) -> None:
        if self.token is not None:
            check_token(self.token)
        if self.tls is not None and not (self.tls.cert and self.tls.key):
            raise ConfigError("internal TLS needs --tls-cert and --tls-key (and --tls-ca for mutual TLS)")

    @property
    def authenticated(self) -> bool:
        """True when a worker built from this refuses unauthenticated callers."""
        return self.token is not None or (self.tls is not None and self.tls.mutual)

    @property
    def lane_token(self) -> bytes | None:
        """The lane's shared secret (its challenge-response key)."""
        return None if self.token is None else self.token.encode()

    # servers ----------------------------------------------------------------------------------

    def server_credentials(self) -> grpc.ServerCredentials | None:
        """A worker port's TLS credentials (client certificates required with a CA), or None: plaintext."""
        return None if self.tls is None else grpc_server_credentials(self.tls)

    def server_interceptors(self) -> list[grpc.aio.ServerInterceptor]:
        """A worker port's: with the secret, a :class:`TokenInterceptor` (``GrpcServer`` tells it the
        address it answers as)."""
        return [] if self.token is None else [TokenInterceptor(self.token)]

    def lane_server_ssl(self) -> ssl.SSLContext | None:
        """The lane server's TLS context (client certificates required with a CA), or None."""
        return None if self.tls is None else self.tls.server_context()

    # clients ----------------------------------------------------------------------------------

    def channel(self, address: str, options: Sequence[tuple[str, Any]] = ()) -> grpc.aio.Channel:
        """A channel to the worker at ``address`` (as it registered it). With the secret, its first
        call waits for the worker to prove itself (or fails UNAUTHENTICATED, having sent nothing), and
        every call carries its own proof; the secret is never sent."""
        prover = None if self.token is None else _Prover(self.token.encode(), address)
        interceptors = None if prover is None else [_UnaryProofs(prover), _StreamProofs(prover)]
        if self.tls is None:
            channel = grpc.aio.insecure_channel(address, options=list(options), interceptors=interceptors)
        else:
            channel = grpc.aio.secure_channel(address, grpc_channel_credentials(self.tls), options=list(options),
                                              interceptors=interceptors)
        if prover is not None:
            prover.channel = channel
        return channel

    def client_ssl(self) -> ssl.SSLContext | None:
        """The TLS context of a client socket to a worker (the lane, the KV connection), or None."""
        return None if self.tls is None else self.tls.client_context()


OPEN = PeerSecurity()
"""No credentials: plaintext, no secret."""


def grpc_server_credentials(tls: TlsFiles, *, require_client_cert: bool | None = None) -> grpc.ServerCredentials:
    """gRPC server credentials from ``tls`` (client certificates required when it has a CA, or as told)."""
    ca, cert, key = tls.pem()
    if cert is None or key is None:
        raise ConfigError("a TLS server needs --tls-cert and --tls-key")
    mutual = tls.mutual if require_client_cert is None else require_client_cert
    return grpc.ssl_server_credentials([(key, cert)], root_certificates=ca if mutual else None,
                                       require_client_auth=mutual)


def grpc_channel_credentials(tls: TlsFiles) -> grpc.ChannelCredentials:
    """gRPC channel credentials: verify the server against the CA, present the certificate if any."""
    ca, cert, key = tls.pem()
    return grpc.ssl_channel_credentials(root_certificates=ca, private_key=key, certificate_chain=cert)


def refusal(handler: grpc.RpcMethodHandler, code: grpc.StatusCode, message: str) -> grpc.RpcMethodHandler:
    """A handler that ends the call with ``code`` before reading anything of its request.

    Always a request-streaming handler, whatever ``handler`` is: grpc reads a unary call's request
    message whole before it runs the handler, so a refusal that took the request would wait for it
    (up to the largest message, trickled in for as long as the client likes). One that takes the
    request stream runs at once, and the call ends without a byte of the message read.
    """

    async def refuse(requests: Any, context: grpc.aio.ServicerContext) -> None:
        await context.abort(code, message)

    if handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(refuse)
    return grpc.stream_unary_rpc_method_handler(refuse)


class CredentialInterceptor(grpc.aio.ServerInterceptor):
    """Serves a call only when :meth:`refusal_reason` finds its metadata acceptable; else the call
    ends UNAUTHENTICATED with that reason before its handler runs and before any byte of its
    request is read (:func:`refusal`). The standard health service stays open for probes."""

    def refusal_reason(self, metadata: Sequence[tuple[str, str | bytes]]) -> str | None:
        """Why a call with ``metadata`` is refused, or None to serve it."""
        raise NotImplementedError

    async def intercept_service(
            self, continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler | None]],
            handler_call_details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler | None:
        method: str = handler_call_details.method
        message = None
        if not method.startswith(OPEN_GRPC_PREFIX):
            message = self.refusal_reason(handler_call_details.invocation_metadata or ())
        handler = await continuation(handler_call_details)
        if message is None or handler is None:
            return handler
        return refusal(handler, grpc.StatusCode.UNAUTHENTICATED, message)


def single_entry(metadata: Sequence[tuple[str, str | bytes]], key: str) -> tuple[str | bytes | None, str | None]:
    """``(value, None)`` for the one ``key`` entry of ``metadata`` (None when absent), or ``(None,
    reason)`` when there are several."""
    values = [value for name, value in metadata if name == key]
    if len(values) > 1:
        return None, f"several {key} metadata entries: send one"
    return (values[0] if values else None), None


def _text(value: str | bytes | None) -> str | None:
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else value


class TokenInterceptor(grpc.aio.ServerInterceptor):
    """A worker port's side of the internal secret (``pdrouter.wire.call_proofs``): serves a call
    only with a valid proof of the secret for this worker's address (else UNAUTHENTICATED before
    the handler runs or the request is read), and proves this worker to a caller whose health check
    carries a challenge. Other health checks are served as they are."""

    def __init__(self, token: str) -> None:
        self._secret = token.encode()
        self._replays = ReplayWindow()
        self.identity = ""
        """The address this worker answers as (``host:port``, as registered): set by ``GrpcServer``."""

    def bind_identity(self, identity: str) -> None:
        self.identity = identity

    async def intercept_service(
            self, continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler | None]],
            handler_call_details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler | None:
        handler = await continuation(handler_call_details)
        if handler is None:
            return None
        method: str = handler_call_details.method
        metadata = handler_call_details.invocation_metadata or ()
        if method.startswith(OPEN_GRPC_PREFIX):
            return self._proving(handler, metadata)
        reason = self.refusal_reason(method, metadata)
        return handler if reason is None else refusal(handler, grpc.StatusCode.UNAUTHENTICATED, reason)

    def refusal_reason(self, method: str, metadata: Sequence[tuple[str, str | bytes]]) -> str | None:
        """Why a call of ``method`` with ``metadata`` is refused, or None to serve it."""
        proof, reason = single_entry(metadata, CALL_PROOF_METADATA)
        target, again = single_entry(metadata, TARGET_METADATA)
        if reason is not None or again is not None:
            return reason or again
        return check_call_proof(self._secret, self.identity, method, _text(target), _text(proof), self._replays)

    def _proving(self, handler: grpc.RpcMethodHandler,
                 metadata: Sequence[tuple[str, str | bytes]]) -> grpc.RpcMethodHandler:
        challenge_hex, _ = single_entry(metadata, CHALLENGE_METADATA)
        behavior = handler.unary_unary
        try:
            challenge = bytes.fromhex(_text(challenge_hex) or "")
        except ValueError:
            return handler
        if len(challenge) != CHALLENGE_BYTES or behavior is None:
            return handler
        answer = ((IDENTITY_METADATA, self.identity),
                  (PEER_PROOF_METADATA, peer_proof(self._secret, challenge, self.identity).hex()))

        async def check(request: Any, context: grpc.aio.ServicerContext) -> Any:
            await context.send_initial_metadata(answer)
            return await behavior(request, context)

        return grpc.unary_unary_rpc_method_handler(check, request_deserializer=handler.request_deserializer,
                                                   response_serializer=handler.response_serializer)


class PeerNotProven(StatusError):
    """A call not made: its worker did not prove itself (or could not be asked). ``code()`` /
    ``details()`` as on a failed call."""


class _Prover:
    """One channel's side of the secret: asks its worker to prove itself once (a health check with a
    challenge), then stamps every call with a proof of its own."""

    def __init__(self, secret: bytes, address: str) -> None:
        self.secret = secret
        self.address = address
        self.channel: grpc.aio.Channel | None = None
        self._proven: asyncio.Future[None] | None = None

    async def stamp(self, details: grpc.aio.ClientCallDetails) -> grpc.aio.ClientCallDetails:
        method = details.method.decode() if isinstance(details.method, bytes) else details.method
        if method.startswith(OPEN_GRPC_PREFIX):
            return details
        proven = self._proven
        if proven is None or not proven.done() or proven.cancelled() or proven.exception() is not None:
            if proven is None or proven.done():  # not asked yet, or failed: ask (again)
                proven = self._proven = asyncio.ensure_future(self._prove())
            await asyncio.shield(proven)
        metadata = grpc.aio.Metadata(*(details.metadata or ()),
                                     (CALL_PROOF_METADATA, new_call_proof(self.secret, method, self.address)),
                                     (TARGET_METADATA, self.address))
        return grpc.aio.ClientCallDetails(details.method, details.timeout, metadata, details.credentials,
                                          details.wait_for_ready)

    async def _prove(self) -> None:
        assert self.channel is not None
        challenge = secrets.token_bytes(CHALLENGE_BYTES)
        check = self.channel.unary_unary(HEALTH_CHECK,
                                         request_serializer=health_pb2.HealthCheckRequest.SerializeToString,
                                         response_deserializer=health_pb2.HealthCheckResponse.FromString)
        call = check(health_pb2.HealthCheckRequest(), metadata=((CHALLENGE_METADATA, challenge.hex()),),
                     timeout=PROVE_TIMEOUT_S)
        try:
            answer = await call.initial_metadata()
            await call
        except grpc.RpcError as exc:
            code = exc.code() if hasattr(exc, "code") else grpc.StatusCode.UNAVAILABLE
            raise PeerNotProven(code, f"cannot reach the worker at {self.address} to have it prove itself: "
                                      f"{exc.details() if hasattr(exc, 'details') else exc}") from None
        identity = _text(dict(answer or ()).get(IDENTITY_METADATA))
        proof = _text(dict(answer or ()).get(PEER_PROOF_METADATA)) or ""
        if identity is not None and identity != self.address:
            raise PeerNotProven(grpc.StatusCode.UNAUTHENTICATED,
                                f"the worker at {self.address} answers as {identity}: the address it was dialled at "
                                f"(from the registry, or the worker list) is not its own; nothing was sent to it")
        try:
            valid = hmac.compare_digest(bytes.fromhex(proof), peer_proof(self.secret, challenge, self.address))
        except ValueError:
            valid = False
        if not valid:
            raise PeerNotProven(grpc.StatusCode.UNAUTHENTICATED,
                                f"the server at {self.address} did not prove the internal secret: it is no worker of "
                                f"this cluster, or this side's {INTERNAL_TOKEN_ENV} is not the cluster's; nothing was "
                                f"sent to it")


class _UnaryProofs(grpc.aio.UnaryUnaryClientInterceptor):
    """Proofs on every unary call (a grpc.aio channel files each interceptor under the first call
    shape it implements, so one object per shape)."""

    def __init__(self, prover: _Prover) -> None:
        self._prover = prover

    async def intercept_unary_unary(self, continuation: Any, client_call_details: grpc.aio.ClientCallDetails,
                                    request: Any) -> Any:
        return await continuation(await self._prover.stamp(client_call_details), request)


class _StreamProofs(grpc.aio.UnaryStreamClientInterceptor):
    """Proofs on every server-streaming call."""

    def __init__(self, prover: _Prover) -> None:
        self._prover = prover

    async def intercept_unary_stream(self, continuation: Any, client_call_details: grpc.aio.ClientCallDetails,
                                     request: Any) -> Any:
        return await continuation(await self._prover.stamp(client_call_details), request)
