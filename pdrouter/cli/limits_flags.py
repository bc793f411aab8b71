"""The flags of the slow-client and overload limits: the router's HTTP doors (``--http-*``), every
gRPC server (``--grpc-*``: the router's door, a worker's port) and the workers' lane (``--lane-*``).
``docs/limits.md`` describes each limit and what a client sees.

Each ``add_*`` adds its flags to a subcommand's parser; each ``*_from_args`` builds the frozen limits
from the parsed flags, refusing a bad value with one line naming the flag (``ConfigError``).
"""

from __future__ import annotations

import argparse
import math

from pdrouter.core.errors import ConfigError
from pdrouter.router.frontdoor.limits import HttpLimits
from pdrouter.wire.grpc_limits import GrpcLimits
from pdrouter.wire.lane.limits import LaneLimits

_HTTP = HttpLimits()
_LANE = LaneLimits()


def add_http_limit_flags(p: argparse.ArgumentParser) -> None:
    """``--http-header-timeout`` … ``--http-max-inflight``: the limits of both HTTP doors (API and metrics)."""
    g = p.add_argument_group("HTTP limits", "slow clients and overload, on the HTTP door and the metrics listener")
    g.add_argument("--http-header-timeout", type=float, default=_HTTP.header_timeout_s, metavar="S",
                   help="a request's headers must have arrived this long after its connection (or, on a kept-alive "
                        "connection, its first byte) came; trickling does not extend it. Past it: 408 and close "
                        "(default %(default)g)")
    g.add_argument("--http-body-timeout", type=float, default=_HTTP.body_timeout_s, metavar="S",
                   help="a request body has this long to arrive, or longer at --http-body-min-rate; past it: 408 and "
                        "close, the partial body dropped (default %(default)g)")
    g.add_argument("--http-body-min-rate", type=int, default=_HTTP.body_min_rate_bps, metavar="BYTES_PER_S",
                   help="past --http-body-timeout, a body keeps going only while it has averaged this rate "
                        "(default %(default)d)")
    g.add_argument("--http-idle-timeout", type=float, default=_HTTP.idle_timeout_s, metavar="S",
                   help="a kept-alive connection with no request for this long is closed (default %(default)g)")
    g.add_argument("--http-max-header-bytes", type=int, default=_HTTP.max_header_bytes, metavar="N",
                   help="largest request head (target and headers) accepted; larger: 431 (default %(default)d)")
    g.add_argument("--http-max-connections", type=int, default=_HTTP.max_connections, metavar="N",
                   help="open connections per door; one more is answered 503 with Retry-After and closed "
                        "(default %(default)d)")
    g.add_argument("--http-max-inflight", type=int, default=_HTTP.max_inflight, metavar="N",
                   help="requests served at once per door; one more is answered 503 with Retry-After "
                        "(default %(default)d)")
    g.add_argument("--http-max-unauthenticated-connections", type=int, default=None, metavar="N",
                   help="connections that have not yet sent a request with an accepted API key; past it (or at "
                        "--http-max-connections) the oldest of them is closed, so clients with a key always get "
                        "in (default: half of --http-max-connections)")


def http_limits_from_args(args: argparse.Namespace) -> HttpLimits:
    """The :class:`HttpLimits` of :func:`add_http_limit_flags`' flags; ConfigError naming a bad one."""
    return HttpLimits(
        header_timeout_s=_seconds(args.http_header_timeout, "--http-header-timeout"),
        body_timeout_s=_seconds(args.http_body_timeout, "--http-body-timeout"),
        body_min_rate_bps=count_flag(args.http_body_min_rate, "--http-body-min-rate"),
        idle_timeout_s=_seconds(args.http_idle_timeout, "--http-idle-timeout"),
        max_header_bytes=count_flag(args.http_max_header_bytes, "--http-max-header-bytes", 1024),
        max_connections=count_flag(args.http_max_connections, "--http-max-connections"),
        max_inflight=count_flag(args.http_max_inflight, "--http-max-inflight"),
        unauthenticated_connections=_budget(args.http_max_unauthenticated_connections,
                                            "--http-max-unauthenticated-connections", args.http_max_connections,
                                            "--http-max-connections"))


def _budget(value: int | None, flag: str, cap: int, cap_flag: str) -> int | None:
    """A budget of unauthenticated connections: None (the default share of the cap), or at most the cap."""
    if value is None:
        return None
    value = count_flag(value, flag)
    if value > cap:
        raise ConfigError(f"{flag} ({value}) must not exceed {cap_flag} ({cap})")
    return value


def add_grpc_limit_flags(p: argparse.ArgumentParser, defaults: GrpcLimits, what: str) -> None:
    """``--grpc-handshake-timeout`` … ``--grpc-max-metadata-bytes``: the limits of the process's gRPC
    server (``what``: which one, for the help), with ``defaults``."""
    g = p.add_argument_group("gRPC limits", f"slow, idle or greedy peers on {what}")
    g.add_argument("--grpc-handshake-timeout", type=float, default=defaults.handshake_timeout_s, metavar="S",
                   help="a connection must finish its TLS handshake and HTTP/2 preface this long after it opened, "
                        "however its bytes trickle; else it is closed (default %(default)g)")
    g.add_argument("--grpc-idle-timeout", type=float, default=defaults.idle_timeout_s, metavar="S",
                   help="a connection with no call for this long is closed (GOAWAY; clients reconnect) "
                        "(default %(default)g)")
    g.add_argument("--grpc-max-connection-age", type=float, default=defaults.max_connection_age_s, metavar="S",
                   help="a connection is sent GOAWAY this long after it opened (default %(default)g)")
    g.add_argument("--grpc-max-connection-age-grace", type=float, default=defaults.max_connection_age_grace_s,
                   metavar="S", help="the calls of a connection past its age have this long to finish, then it is "
                                     "closed (default %(default)g)")
    g.add_argument("--grpc-max-connections", type=int, default=defaults.max_connections, metavar="N",
                   help="open connections; one more is closed on arrival (default %(default)d)")
    g.add_argument("--grpc-max-streams", type=int, default=defaults.max_streams, metavar="N",
                   help="calls at once on one connection (HTTP/2 MAX_CONCURRENT_STREAMS); more wait in the client "
                        "(default %(default)d)")
    g.add_argument("--grpc-max-inflight", type=int, default=defaults.max_inflight or 0, metavar="N",
                   help="calls at once in all; one more ends RESOURCE_EXHAUSTED (0: no cap; default %(default)d)")
    g.add_argument("--grpc-max-message-bytes", type=int, default=defaults.max_message_bytes, metavar="N",
                   help="largest request message; larger ones end RESOURCE_EXHAUSTED (default %(default)d)")
    g.add_argument("--grpc-max-metadata-bytes", type=int, default=defaults.max_metadata_bytes, metavar="N",
                   help="largest request headers (metadata); larger ones end the call before any handler runs "
                        "(default %(default)d)")


def grpc_limits_from_args(args: argparse.Namespace) -> GrpcLimits:
    """The :class:`GrpcLimits` of :func:`add_grpc_limit_flags`' flags; ConfigError naming a bad one."""
    inflight = args.grpc_max_inflight
    if inflight < 0:
        raise ConfigError(f"--grpc-max-inflight must be >= 0 (0: no cap), got {inflight}")
    return GrpcLimits(
        handshake_timeout_s=_seconds(args.grpc_handshake_timeout, "--grpc-handshake-timeout"),
        idle_timeout_s=_seconds(args.grpc_idle_timeout, "--grpc-idle-timeout"),
        max_connection_age_s=_seconds(args.grpc_max_connection_age, "--grpc-max-connection-age"),
        max_connection_age_grace_s=_seconds(args.grpc_max_connection_age_grace, "--grpc-max-connection-age-grace"),
        max_connections=count_flag(args.grpc_max_connections, "--grpc-max-connections"),
        max_streams=count_flag(args.grpc_max_streams, "--grpc-max-streams"),
        max_inflight=inflight or None,
        max_message_bytes=count_flag(args.grpc_max_message_bytes, "--grpc-max-message-bytes", 1024),
        max_metadata_bytes=count_flag(args.grpc_max_metadata_bytes, "--grpc-max-metadata-bytes", 1024))


def add_lane_limit_flags(p: argparse.ArgumentParser) -> None:
    """``--lane-handshake-timeout`` … ``--lane-max-buffered-bytes``: the limits of a worker's lane."""
    g = p.add_argument_group("lane limits", "slow or unauthenticated peers on the worker lane")
    g.add_argument("--lane-handshake-timeout", type=float, default=_LANE.handshake_timeout_s, metavar="S",
                   help="a lane connection must have greeted (and proved the internal token) this long after it "
                        "opened (after its TLS handshake, itself bounded by the same time); else it is closed "
                        "(default %(default)g)")
    g.add_argument("--lane-frame-timeout", type=float, default=_LANE.frame_timeout_s, metavar="S",
                   help="a frame, once begun, must be complete within this long, or longer at "
                        "--lane-frame-min-rate; trickling does not extend it (default %(default)g)")
    g.add_argument("--lane-frame-min-rate", type=int, default=_LANE.frame_min_rate_bps, metavar="BYTES_PER_S",
                   help="a large frame has its size at this rate to arrive, if longer than --lane-frame-timeout "
                        "(default %(default)d)")
    g.add_argument("--lane-max-connections", type=int, default=_LANE.max_connections, metavar="N",
                   help="open lane connections; one more is refused (default %(default)d)")
    g.add_argument("--lane-max-unauthenticated-connections", type=int, default=None, metavar="N",
                   help="lane connections that have not proved the internal token yet; past it (or at "
                        "--lane-max-connections) the oldest of them is closed (default: a quarter of "
                        "--lane-max-connections)")
    g.add_argument("--lane-max-buffered-bytes", type=int, default=_LANE.max_buffered_bytes, metavar="N",
                   help="bytes of an incomplete frame a connection may hold, so also the largest frame "
                        "(default %(default)d)")
    g.add_argument("--lane-max-preauth-bytes", type=int, default=_LANE.max_preauth_bytes, metavar="N",
                   help="the same, before a connection has proved the internal token (default %(default)d)")


def lane_limits_from_args(args: argparse.Namespace) -> LaneLimits:
    """The :class:`LaneLimits` of :func:`add_lane_limit_flags`' flags; ConfigError naming a bad one."""
    buffered = count_flag(args.lane_max_buffered_bytes, "--lane-max-buffered-bytes", 1024)
    if buffered > _LANE.max_buffered_bytes:
        raise ConfigError(f"--lane-max-buffered-bytes must be at most {_LANE.max_buffered_bytes} (the lane's largest "
                          f"frame), got {buffered}")
    preauth = count_flag(args.lane_max_preauth_bytes, "--lane-max-preauth-bytes", 256)
    if preauth > buffered:
        raise ConfigError(f"--lane-max-preauth-bytes ({preauth}) must not exceed --lane-max-buffered-bytes "
                          f"({buffered})")
    return LaneLimits(
        handshake_timeout_s=_seconds(args.lane_handshake_timeout, "--lane-handshake-timeout"),
        frame_timeout_s=_seconds(args.lane_frame_timeout, "--lane-frame-timeout"),
        frame_min_rate_bps=count_flag(args.lane_frame_min_rate, "--lane-frame-min-rate"),
        max_connections=count_flag(args.lane_max_connections, "--lane-max-connections"),
        max_buffered_bytes=buffered, max_preauth_bytes=preauth,
        max_unauthenticated_connections=_budget(args.lane_max_unauthenticated_connections,
                                                "--lane-max-unauthenticated-connections", args.lane_max_connections,
                                                "--lane-max-connections"))


def _seconds(value: float, flag: str) -> float:
    if not (math.isfinite(value) and 0 < value < 1e9):
        raise ConfigError(f"{flag} must be a number of seconds > 0, got {value:g}")
    return float(value)


def count_flag(value: int, flag: str, least: int = 1) -> int:
    """``value`` of ``flag`` when it is at least ``least``; else a ConfigError naming the flag."""
    if value < least:
        raise ConfigError(f"{flag} must be at least {least}, got {value}")
    return int(value)
