"""``pdrouter router``: run the front-door router until SIGINT / SIGTERM."""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import TYPE_CHECKING

from pdrouter.cli.limits_flags import (
    add_grpc_limit_flags,
    add_http_limit_flags,
    grpc_limits_from_args,
    http_limits_from_args,
)
from pdrouter.cli.local_cluster import check_ports_free, ready_line
from pdrouter.cli.security_flags import add_tls_flags, internal_token_from_env, redis_url, tls_from_args
from pdrouter.cli.serve import configure_logging, serve_until_signal
from pdrouter.core.errors import ConfigError
from pdrouter.wire.grpc_limits import GrpcLimits

if TYPE_CHECKING:
    from pdrouter.router.config import RouterConfig


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("router", help="run the router (OpenAI HTTP + gRPC front doors, PD dispatch)",
                       description="Run the front-door router for one model.")
    p.add_argument("--model", type=Path, required=True,
                   help="model folder with config.json and the tokenizer (weights are not read)")
    p.add_argument("--served-model-name", default=None, help="model name clients use (default: folder name)")
    p.add_argument("--redis", default=os.environ.get("PDROUTER_REDIS_URL"),
                   help="Redis URL: worker registry, prefix index, KV admission (env PDROUTER_REDIS_URL)")
    p.add_argument("--workers", default="", help="comma-separated static worker gRPC addresses (host:port)")
    p.add_argument("--mode", choices=["disaggregated", "colocated"], default="disaggregated")
    p.add_argument("--host", default="127.0.0.1", help="bind host of both front doors")
    p.add_argument("--http-port", type=int, default=8000, help="OpenAI HTTP port (0: any free port)")
    p.add_argument("--grpc-port", type=int, default=50051, help="gRPC front door port (0: any free port)")
    p.add_argument("--api-key", action="append", default=[], metavar="KEY",
                   help="an API key both front doors accept (repeatable; visible in `ps`: prefer --api-key-file "
                        "or the environment). With any key, requests need 'Authorization: Bearer KEY'")
    p.add_argument("--api-key-file", action="append", default=[], type=Path, metavar="FILE",
                   help="a file of API keys, one a line (blank lines and # comments skipped; repeatable)")
    p.add_argument("--tenants", type=Path, default=None, metavar="FILE",
                   help="a tenants file (YAML): each API key's tenant with its limits (requests and tokens per "
                        "minute, requests at once, enforced across every router through Redis), priority class, "
                        "fair-share weight and cache policy (docs/tenants.md). Without it: no tenants")
    p.add_argument("--metrics-port", type=int, default=None, metavar="PORT",
                   help="serve /metrics on a listener of its own, with no key asked (0: any free port); the "
                        "HTTP port then serves no /metrics. Without it, /metrics on the HTTP port needs the key")
    p.add_argument("--metrics-host", default=None, metavar="HOST",
                   help="bind host of the --metrics-port listener (default: --host)")
    p.add_argument("--block-size", type=int, default=16, help="KV block size the workers use")
    p.add_argument("--worker-transport", choices=["lane", "grpc"], default="lane",
                   help="reach workers over their lane where they serve one (faster), or always over gRPC")
    p.add_argument("--grpc-server", choices=["builtin", "grpcio"], default="builtin",
                   help="the gRPC door's server: the router's own (HTTP/2 written for the door, about a sixth of "
                        "grpcio's CPU a call) or grpcio's asyncio server; both enforce the --grpc-* limits")
    p.add_argument("--local-prefill-tokens", type=int, default=32,
                   help="uncached prompt tokens at or below which the decode worker prefills itself")
    p.add_argument("--no-cache-aware", action="store_true", help="place prefill by load alone")
    p.add_argument("--no-admission", action="store_true", help="do not book KV in Redis before routing")
    p.add_argument("--queue-timeout-s", type=float, default=10.0, help="longest wait for KV room before 429")
    p.add_argument("--queue-limit", type=int, default=1024, help="requests that may wait for KV room")
    p.add_argument("--lease-ms", type=int, default=30_000,
                   help="KV bookings expire this long after the last renewal (a crashed router's come back)")
    p.add_argument("--admission-credit", type=float, default=0.05, metavar="FRACTION",
                   help="book KV ahead in chunks of this fraction of a decode worker's pool, so that most "
                        "requests are admitted without a Redis round trip (0: book each request alone)")
    p.add_argument("--fair-headroom", type=float, default=0.05, metavar="FRACTION",
                   help="with --tenants: the fraction of each decode worker's pool a tenant with requests waiting "
                        "may not book while another tenant is active, so that one sending at its fair share "
                        "beside a flood is admitted on arrival (0: none; docs/tenants.md)")
    p.add_argument("--fair-headroom-requests", type=float, default=0.0, metavar="REQUESTS",
                   help="with --tenants: the headroom counted in requests of the other active tenants (their "
                        "largest), where that is more than --fair-headroom (0: the fraction alone)")
    p.add_argument("--fair-burst", type=float, default=8.0, metavar="REQUESTS",
                   help="with --tenants: how many of its requests a tenant that has been under its fair share may "
                        "have admitted ahead of the others' backlogs (0: none; docs/tenants.md)")
    p.add_argument("--admission-on-redis-error", choices=["fail", "local"], default="fail",
                   help="when Redis cannot be reached to book a request's KV: fail answers 503 / UNAVAILABLE; "
                        "local places it by load alone, without shared admission")
    p.add_argument("--redis-max-connections", type=int, default=64, metavar="N",
                   help="size of the router's Redis connection pool; calls beyond it wait for a free "
                        "connection (up to 5 s) instead of failing")
    p.add_argument("--request-timeout-s", type=float, default=None,
                   help="deadline of a request that brings none of its own (any HTTP request; a gRPC call "
                        "without a deadline keeps this, one with its own keeps that): admission, prefill and "
                        "decode all run within it, then DEADLINE_EXCEEDED / 504 (default: 600 s)")
    p.add_argument("--chat-template", type=Path, default=None, metavar="FILE",
                   help="Jinja chat template used instead of the model folder's (chat_template.jinja or "
                        "tokenizer_config.json); a model without one answers chat requests with 400")
    add_tls_flags(p, server_help="the calls to the workers verify them and present --tls-cert (mutual TLS); "
                  "the front doors serve --tls-cert to any client")
    add_http_limit_flags(p)
    add_grpc_limit_flags(p, GrpcLimits.for_door(), "the gRPC front door")
    p.add_argument("--log-level", default="INFO")
    p.set_defaults(func=run)


def build_config(args: argparse.Namespace) -> RouterConfig:
    from pdrouter.core.tenants import load_tenants
    from pdrouter.router.admission import AdmissionConfig
    from pdrouter.router.config import RouterConfig
    from pdrouter.router.dispatch import DEFAULT_DEADLINE_S, DispatchConfig
    from pdrouter.router.frontdoor.auth import ENV_VAR, collect_api_keys, key_file_tenants
    from pdrouter.router.frontdoor.served_models import FrontdoorConfig

    if not (args.model / "config.json").is_file():
        raise ConfigError(f"--model {args.model} has no config.json (create a model with `pdrouter make-model`)")
    if args.local_prefill_tokens < 0:
        raise ConfigError("--local-prefill-tokens must be >= 0")
    if not 0.0 <= args.admission_credit <= 0.5:
        raise ConfigError(f"--admission-credit is a fraction of a decode worker's pool in [0, 0.5], "
                          f"got {args.admission_credit:g}")
    if args.metrics_port is not None and not 0 <= args.metrics_port < 65536:
        raise ConfigError(f"--metrics-port must be in [0, 65535] (0: any free port), got {args.metrics_port}")
    if args.metrics_port is not None and args.metrics_port and args.metrics_port in (args.http_port, args.grpc_port):
        raise ConfigError(f"--metrics-port {args.metrics_port} is also a front door's port: give it another")
    if args.metrics_host is not None and args.metrics_port is None:
        raise ConfigError("--metrics-host needs --metrics-port")
    deadline_s = DEFAULT_DEADLINE_S if args.request_timeout_s is None else args.request_timeout_s
    if not deadline_s > 0:
        raise ConfigError(f"--request-timeout-s must be > 0, got {deadline_s:g}")
    api_keys = collect_api_keys(args.api_key, args.api_key_file, os.environ.get(ENV_VAR))
    key_tenants = key_file_tenants(args.api_key_file)
    if key_tenants and args.tenants is None:
        raise ConfigError("--api-key-file names tenants beside keys: give the tenants file too (--tenants FILE)")
    tenants = load_tenants(args.tenants, key_tenants) if args.tenants is not None else None
    tls = tls_from_args(args)
    if tls is not None and not tls.ca:
        raise ConfigError("--tls-ca is needed with --tls-cert: the router verifies its workers' certificates")
    workers = tuple(w.strip() for w in args.workers.split(",") if w.strip())
    chat_template = read_chat_template(args.chat_template)
    grpc_limits = grpc_limits_from_args(args)
    return RouterConfig(
        model_dir=args.model, model_name=args.served_model_name, redis_url=redis_url(args.redis),
        static_workers=workers,
        mode=args.mode, host=args.host, http_port=args.http_port, grpc_port=args.grpc_port,
        metrics_port=args.metrics_port, metrics_host=args.metrics_host, api_keys=api_keys, tenants=tenants,
        tls=tls, internal_token=internal_token_from_env(),
        block_size=args.block_size, worker_transport=args.worker_transport, grpc_server=args.grpc_server,
        cache_aware=not args.no_cache_aware, admission=not args.no_admission,
        dispatch=DispatchConfig(mode=args.mode, local_prefill_tokens=args.local_prefill_tokens,
                                default_deadline_s=deadline_s),
        admission_config=AdmissionConfig(queue_limit=args.queue_limit, queue_timeout_s=args.queue_timeout_s,
                                          lease_ms=args.lease_ms, credit_fraction=args.admission_credit,
                                          fair_headroom=args.fair_headroom, fair_burst=args.fair_burst,
                                          fair_headroom_requests=args.fair_headroom_requests,
                                          on_redis_error=args.admission_on_redis_error),
        redis_max_connections=args.redis_max_connections,
        http_limits=http_limits_from_args(args), grpc_limits=grpc_limits,
        frontdoor=FrontdoorConfig(request_timeout_s=deadline_s, chat_template=chat_template))


def read_chat_template(path: Path | None) -> str | None:
    """The text of a ``--chat-template`` file, checked to compile; None without one. ConfigError otherwise."""
    from pdrouter.core.chat_template import ChatTemplate

    if path is None:
        return None
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"--chat-template {path}: cannot read it ({exc})") from None
    ChatTemplate(text, f"--chat-template {path}")
    return text


def run(args: argparse.Namespace) -> int:
    from pdrouter.router.server import RouterProcess

    configure_logging(args.log_level)
    config = build_config(args)
    # A port already taken is one line naming the flag, before anything starts (a bind failure deep in
    # the servers would be a traceback).
    check_ports_free(config.host, [(config.http_port, "--http-port"), (config.grpc_port, "--grpc-port")]
                     + ([(config.metrics_port, "--metrics-port")] if config.metrics_port else []))
    from pdrouter.core.tracing import tracing_from_env

    process = RouterProcess(config, tracing=tracing_from_env("pdrouter-router"))
    serve_until_signal(process, lambda: ready_line("router", f"{process.config.host}:{process.http_port}",
                                                   process.grpc_address))
    return 0
