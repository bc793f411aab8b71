"""``pdrouter worker | prefill | decode``: run one worker process until SIGINT / SIGTERM."""

from __future__ import annotations

import argparse
import logging
import os
from pathlib import Path
from typing import TYPE_CHECKING

from pdrouter.cli.serve import configure_logging, serve_until_signal
from pdrouter.core.capacity import DEFAULT_OVERHEAD_BYTES, check_utilization_against_quota, utilization_from_quota
from pdrouter.core.errors import ConfigError
from pdrouter.core.gpu import GiB, get_gpu_preset
from pdrouter.core.workers import WorkerRole

if TYPE_CHECKING:
    from pdrouter.worker.config import WorkerConfig

KV_TOKEN_ENV = "PDROUTER_KV_TOKEN"
TORCH_THREADS_ENV = "PDROUTER_TORCH_THREADS"
DEV_KV_TOKEN = "pdrouter-dev-token"

_HELP = {
    "worker": "run a colocated worker (prefill and decode in one engine, chunked prefill)",
    "prefill": "run a prefill worker (computes prompts, pushes KV to decode workers)",
    "decode": "run a decode worker (owns a KV pool, receives KV, decodes with continuous batching)",
}
_ROLE = {"worker": WorkerRole.COLOCATED, "prefill": WorkerRole.PREFILL, "decode": WorkerRole.DECODE}


def add_parsers(sub: argparse._SubParsersAction) -> None:
    for name in ("worker", "prefill", "decode"):
        p = sub.add_parser(name, help=_HELP[name], description=_HELP[name] + ".")
        p.add_argument("--model", type=Path, required=True, help="HF-format model folder (pdrouter make-model)")
        p.add_argument("--served-model-name", default=None, help="model name clients use (default: folder name)")
        p.add_argument("--worker-id", default=None, help=f"registry id (default: {name}-<port>)")
        p.add_argument("--host", default="127.0.0.1", help="gRPC bind host")
        p.add_argument("--port", type=int, default=0, help="gRPC port (0: any free port)")
        p.add_argument("--lane-port", type=int, default=0,
                       help="worker lane port, the router's fast path (0: any free port; -1: serve gRPC only)")
        p.add_argument("--advertise-host", default=None, help="host others dial (default: the bind host)")
        p.add_argument("--redis", default=os.environ.get("PDROUTER_REDIS_URL"),
                       help="Redis URL for registry and prefix index (env PDROUTER_REDIS_URL)")
        p.add_argument("--device", default="cpu", help="cpu | cuda | cuda:N")
        p.add_argument("--dtype", default=None, help="float32 | bfloat16 | float16 (default: the model's)")
        p.add_argument("--block-size", type=int, default=16)
        p.add_argument("--num-blocks", type=int, default=None, help="KV pool blocks (overrides the memory math)")
        p.add_argument("--kv-memory-gb", type=float, default=None,
                       help="memory budget in GiB the pool is sized from (default on CPU: 1 GiB)")
        p.add_argument("--utilization", type=float, default=None,
                       help="fraction of --gpu/--kv-memory-gb memory the engine may use (default 0.9, or "
                            "quota ÷ physical with --quota-gb)")
        p.add_argument("--gpu", default=None,
                       help="GPU preset whose memory sizes the pool (e.g. h100); see `pdrouter capacity --list`")
        p.add_argument("--quota-gb", type=float, default=None,
                       help="memory quota in GiB (HAMi nvidia.com/gpumem); refuses a utilization above it")
        p.add_argument("--max-num-seqs", type=int, default=64)
        p.add_argument("--max-batched-tokens", type=int, default=512, help="per-step token budget (chunk size)")
        p.add_argument("--torch-threads", type=int, default=None,
                       help="torch intra-op threads on the CPU (0: torch's default of one per core, capped "
                            "by the CPUs this process may use: its affinity and cgroup CPU limit; env "
                            f"{TORCH_THREADS_ENV}). Give each worker its share of the cores when several "
                            "processes share a machine")
        if name != "worker":
            p.add_argument("--kv-backend", default="tcp", choices=["tcp", "gloo", "nccl"])
            p.add_argument("--kv-port", type=int, default=0, help="KV receiver port (decode; 0: any free)")
            p.add_argument("--lease-ms", type=int, default=30_000, help="allocation lease (decode)")
        p.add_argument("--log-level", default="INFO")
        p.set_defaults(func=run, role_name=name)


def torch_threads(args: argparse.Namespace) -> int:
    """The worker's torch intra-op threads: ``--torch-threads``, else the environment's, else 0 (torch's
    default, one per core, capped by the CPUs the process may use; see ``run``)."""
    threads = args.torch_threads
    if threads is None:
        raw = os.environ.get(TORCH_THREADS_ENV, "").strip() or "0"
        try:
            threads = int(raw)
        except ValueError:
            raise ConfigError(f"{TORCH_THREADS_ENV} must be a whole number, got {raw!r}") from None
    if threads < 0:
        raise ConfigError(f"--torch-threads must be 0 (torch's default) or more, got {threads}")
    return int(threads)


def build_config(args: argparse.Namespace) -> WorkerConfig:
    from pdrouter.engine.config import EngineConfig
    from pdrouter.worker.config import WorkerConfig

    torch_threads(args)  # checked with the rest, before anything starts
    if args.port and not 0 < args.port < 65536:
        raise ConfigError(f"--port must be in [1, 65535], got {args.port}")
    if not args.model.is_dir():
        raise ConfigError(f"--model {args.model} is not a folder (create one with `pdrouter make-model`)")
    physical = None
    if args.gpu:
        physical = get_gpu_preset(args.gpu).memory_bytes
    elif args.kv_memory_gb:
        physical = int(args.kv_memory_gb * GiB)
    utilization = args.utilization
    if args.quota_gb is not None:
        if physical is None:
            raise ConfigError("--quota-gb needs --gpu (or --kv-memory-gb) for the card's physical memory")
        quota = int(args.quota_gb * GiB)
        if utilization is None:
            utilization = utilization_from_quota(quota, physical)
        check_utilization_against_quota(utilization, quota, physical)
    utilization = 0.9 if utilization is None else utilization
    budget = None
    if not args.num_blocks:
        budget = physical or (int(1.0 * GiB) if args.device == "cpu" else None)
    engine = EngineConfig(model_dir=args.model, device=args.device, dtype=args.dtype,
                          block_size=args.block_size, num_blocks=args.num_blocks,
                          memory_budget_bytes=budget, memory_utilization=utilization,
                          overhead_bytes=DEFAULT_OVERHEAD_BYTES if args.gpu else None,
                          max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_batched_tokens)
    token = os.environ.get(KV_TOKEN_ENV, "")
    if not token and args.role_name != "worker":
        logging.getLogger(__name__).warning("%s is not set: using the development KV token; set it to a "
                                            "shared secret in any real deployment", KV_TOKEN_ENV)
        token = DEV_KV_TOKEN
    return WorkerConfig(
        role=_ROLE[args.role_name], worker_id=args.worker_id or f"{args.role_name}-{os.getpid()}",
        engine=engine, host=args.host, port=args.port, advertise_host=args.advertise_host,
        redis_url=args.redis, model_name=args.served_model_name,
        kv_backend=getattr(args, "kv_backend", "tcp"), kv_port=getattr(args, "kv_port", 0),
        kv_auth_token=token, lease_ms=getattr(args, "lease_ms", 30_000),
        lane_port=None if args.lane_port == -1 else args.lane_port)


def run(args: argparse.Namespace) -> int:
    from pdrouter.worker.process import WorkerProcess
    from pdrouter.worker.roles import build_role

    configure_logging(args.log_level)
    config = build_config(args)
    threads = torch_threads(args)
    import torch

    if not threads:
        from pdrouter.worker.cpus import cpu_budget

        budget = cpu_budget()
        if budget.usable < torch.get_num_threads():
            threads = budget.usable
            logging.getLogger(__name__).info(
                "torch threads: %d (torch's default %d; %d CPUs in the affinity mask, cgroup CPU limit %s)",
                threads, torch.get_num_threads(), budget.affinity,
                "none" if budget.limit is None else f"{budget.limit:g}")
    if threads:
        torch.set_num_threads(threads)
    process = WorkerProcess(config, build_role)
    serve_until_signal(process, lambda: f"{process.config.role.value} worker {process.config.worker_id} "
                                        f"ready at {process.address}")
    return 0
