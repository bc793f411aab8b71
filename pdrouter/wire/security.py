"""Who may call a worker: the internal secret, mutual TLS, and the gRPC plumbing for both.

Every internal call — router → worker (gRPC and the lane), decode → prefill — is authenticated by
one or both of:

- **the internal secret** (``PDROUTER_INTERNAL_TOKEN``, or ``PDROUTER_INTERNAL_TOKEN_FILE``): the
  router and every worker share it; gRPC calls carry it in the metadata entry
  :data:`TOKEN_METADATA`, the lane proves it by a challenge-response at connection start
  (``pdrouter.wire.lane``). Compared in constant time, as SHA-256 digests;
- **mutual TLS** (``--tls-ca``/``--tls-cert``/``--tls-key``): worker ports accept only clients with a
  certificate from the CA, and clients accept only workers with one.

:class:`PeerSecurity` is one process's side of both: the server credentials and interceptors of a
worker's gRPC port, the channels its clients open, the lane's token and ``ssl`` contexts. The
standard health service stays open for probes. Without either, internal ports are open (allowed
only where the CLI allows it: see ``pdrouter worker --help``).
"""

from __future__ import annotations

import hashlib
import hmac
import ssl
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import grpc

from pdrouter.core.errors import ConfigError
from pdrouter.core.tls import TlsFiles

INTERNAL_TOKEN_ENV = "PDROUTER_INTERNAL_TOKEN"
"""The secret the router and the workers share (or ``PDROUTER_INTERNAL_TOKEN_FILE``: a file holding it)."""
TOKEN_METADATA = "x-pdrouter-internal-token"
"""The gRPC metadata entry that carries the internal secret on internal calls."""
MIN_TOKEN_BYTES = 16
OPEN_GRPC_PREFIX = "/grpc.health.v1.Health/"
"""gRPC methods served without credentials: the standard health service."""
MISSING_TOKEN = (f"internal call without the internal secret: the caller must be a pd-router router or worker "
                 f"started with the same {INTERNAL_TOKEN_ENV}")
WRONG_TOKEN = f"internal call with a wrong internal secret: check {INTERNAL_TOKEN_ENV} on the caller and this worker"


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
    def token_digest(self) -> bytes | None:
        return None if self.token is None else hashlib.sha256(self.token.encode()).digest()

    @property
    def lane_token(self) -> bytes | None:
        """The lane's shared secret (its challenge-response key)."""
        return None if self.token is None else self.token.encode()

    # servers ----------------------------------------------------------------------------------

    def server_credentials(self) -> grpc.ServerCredentials | None:
        """A worker port's TLS credentials (client certificates required with a CA), or None: plaintext."""
        return None if self.tls is None else grpc_server_credentials(self.tls)

    def server_interceptors(self) -> list[grpc.aio.ServerInterceptor]:
        return [] if self.token is None else [TokenInterceptor(self.token)]

    def lane_server_ssl(self) -> ssl.SSLContext | None:
        """The lane server's TLS context (client certificates required with a CA), or None."""
        return None if self.tls is None else self.tls.server_context()

    # clients ----------------------------------------------------------------------------------

    def channel(self, address: str, options: Sequence[tuple[str, Any]] = ()) -> grpc.aio.Channel:
        """A channel to a worker that presents these credentials on every call."""
        interceptors = [] if self.token is None else _token_interceptors(self.token)
        if self.tls is None:
            return grpc.aio.insecure_channel(address, options=list(options), interceptors=interceptors or None)
        return grpc.aio.secure_channel(address, grpc_channel_credentials(self.tls), options=list(options),
                                       interceptors=interceptors or None)


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
    """A handler of ``handler``'s kind that ends the call with ``code`` before reading the request."""

    async def refuse(request: Any, context: grpc.aio.ServicerContext) -> None:
        await context.abort(code, message)

    if handler.request_streaming and handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(refuse)
    if handler.request_streaming:
        return grpc.stream_unary_rpc_method_handler(refuse)
    if handler.response_streaming:
        return grpc.unary_stream_rpc_method_handler(refuse)
    return grpc.unary_unary_rpc_method_handler(refuse)


class CredentialInterceptor(grpc.aio.ServerInterceptor):
    """Serves a call only when :meth:`refusal_reason` finds its metadata acceptable; else the call
    ends UNAUTHENTICATED with that reason before its handler runs (its request is not even parsed).
    The standard health service stays open for probes."""

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


class TokenInterceptor(CredentialInterceptor):
    """Serves a call only when its metadata carries the internal secret."""

    def __init__(self, token: str) -> None:
        self._digest = hashlib.sha256(token.encode()).digest()

    def refusal_reason(self, metadata: Sequence[tuple[str, str | bytes]]) -> str | None:
        presented, reason = single_entry(metadata, TOKEN_METADATA)
        if reason is not None:
            return reason
        if presented is None:
            return MISSING_TOKEN
        raw = presented if isinstance(presented, bytes) else presented.encode("utf-8", "surrogateescape")
        return None if hmac.compare_digest(hashlib.sha256(raw).digest(), self._digest) else WRONG_TOKEN


def _token_interceptors(token: str) -> list[grpc.aio.ClientInterceptor]:
    """One interceptor per call shape the workers serve: a grpc.aio channel files each interceptor
    under the first shape it implements, so one object cannot serve both."""
    entries = ((TOKEN_METADATA, token),)
    return [_UnaryTokenInterceptor(entries), _StreamTokenInterceptor(entries)]


def _with_token(details: grpc.aio.ClientCallDetails,
                entries: tuple[tuple[str, str], ...]) -> grpc.aio.ClientCallDetails:
    metadata = grpc.aio.Metadata(*(details.metadata or ()), *entries)
    return grpc.aio.ClientCallDetails(details.method, details.timeout, metadata, details.credentials,
                                      details.wait_for_ready)


class _UnaryTokenInterceptor(grpc.aio.UnaryUnaryClientInterceptor):
    """Adds the internal secret to the metadata of every unary call."""

    def __init__(self, entries: tuple[tuple[str, str], ...]) -> None:
        self._entries = entries

    async def intercept_unary_unary(self, continuation: Any, client_call_details: grpc.aio.ClientCallDetails,
                                    request: Any) -> Any:
        return await continuation(_with_token(client_call_details, self._entries), request)


class _StreamTokenInterceptor(grpc.aio.UnaryStreamClientInterceptor):
    """Adds the internal secret to the metadata of every server-streaming call."""

    def __init__(self, entries: tuple[tuple[str, str], ...]) -> None:
        self._entries = entries

    async def intercept_unary_stream(self, continuation: Any, client_call_details: grpc.aio.ClientCallDetails,
                                     request: Any) -> Any:
        return await continuation(_with_token(client_call_details, self._entries), request)
