"""The router's gRPC door on each of its servers, for tests that must hold for both
(``RouterConfig.grpc_server``): the server written for the door and grpcio's."""

from __future__ import annotations

from pdrouter.router.frontdoor.auth import ApiKeys
from pdrouter.router.frontdoor.grpc_api import ApiKeyInterceptor
from pdrouter.wire.grpc_limits import GrpcLimits
from pdrouter.wire.grpc_util import GrpcServer
from pdrouter.wire.h2_grpc import H2GrpcServer

DOOR_SERVERS = ("builtin", "grpcio")


def door_server(kind: str, *, limits: GrpcLimits | None = None,
                keys: ApiKeys | None = None) -> GrpcServer | H2GrpcServer:
    """An unstarted door server of ``kind`` (:data:`DOOR_SERVERS`) on a free port; with ``keys``, calls
    need one of them (as the router builds it)."""
    check = ApiKeyInterceptor(keys) if keys is not None and keys.enabled else None
    if kind == "builtin":
        return H2GrpcServer(limits=limits, refusal=None if check is None else check.refusal_reason)
    if kind == "grpcio":
        return GrpcServer(limits=limits, interceptors=() if check is None else (check,))
    raise ValueError(f"kind must be one of {DOOR_SERVERS}, not {kind!r}")
