#!/usr/bin/env python3
"""Container health check for the pd-router services, installed in the image as ``pdrouter-healthcheck``.

    pdrouter-healthcheck grpc HOST:PORT [--service NAME]   # grpc.health.v1 Check answers SERVING
    pdrouter-healthcheck http URL                          # GET answers 200

Exit status 0 when healthy, 1 otherwise (with one line on stderr saying why). Docker Compose needs
it because its ``healthcheck`` runs a command; Kubernetes does not, its probes speak gRPC health
and HTTP natively.
"""

from __future__ import annotations

import argparse
import sys
import urllib.error
import urllib.request
from collections.abc import Sequence


def check_grpc(address: str, service: str, timeout: float) -> str | None:
    """None when the server at ``address`` reports SERVING for ``service``, else the reason."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    with grpc.insecure_channel(address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        try:
            reply = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=timeout)
        except grpc.RpcError as exc:
            return f"{exc.code().name}: {exc.details()}"
    if reply.status != health_pb2.HealthCheckResponse.SERVING:
        return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
    return None


def check_http(url: str, timeout: float) -> str | None:
    """None when ``GET url`` answers 200, else the reason."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as reply:
            return None if reply.status == 200 else f"HTTP {reply.status}"
    except (urllib.error.URLError, OSError) as exc:
        return str(exc)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pdrouter-healthcheck", description="Health check of a pd-router container.")
    parser.add_argument("--timeout", type=float, default=3.0, help="seconds")
    sub = parser.add_subparsers(dest="kind", required=True)
    grpc_p = sub.add_parser("grpc", help="grpc.health.v1 Check")
    grpc_p.add_argument("address", help="HOST:PORT")
    grpc_p.add_argument("--service", default="", help="service name (default: the whole server)")
    http_p = sub.add_parser("http", help="HTTP GET expecting 200")
    http_p.add_argument("url")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.kind == "grpc":
        problem = check_grpc(args.address, args.service, args.timeout)
        target = args.address
    else:
        problem = check_http(args.url, args.timeout)
        target = args.url
    if problem is not None:
        print(f"unhealthy: {target}: {problem}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
