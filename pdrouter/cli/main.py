"""The ``pdrouter`` command: one entry point, one subcommand per job.

Every subcommand reports a bad argument or configuration as one line on stderr and exit code 2.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from pdrouter.core.errors import PdRouterError


def _add_make_model(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("make-model", help="write a seeded random model in HF format (config + safetensors)",
                       description="Write a small Llama-family model with seeded random weights and the "
                                   "project's byte-level tokenizer, also as an HF tokenizer.json with a chat "
                                   "template (the same ids), loadable by the engine, by transformers and by vLLM.")
    p.add_argument("--preset", default="tiny", help="tiny | small (or any model preset, if you have the RAM)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", default=None, help="float32 | bfloat16 | float16 (default: the preset's)")
    p.add_argument("--out", type=Path, required=True, help="output folder")
    p.set_defaults(func=_run_make_model)


def _run_make_model(args: argparse.Namespace) -> int:
    from pdrouter.engine.model_io import make_model

    out = make_model(args.preset, args.seed, args.out, dtype=args.dtype)
    print(out)
    return 0


def build_parser() -> argparse.ArgumentParser:
    from pdrouter.cli import bench_cmd, capacity_cmd, router_cmd, up_cmd, worker_cmd

    parser = argparse.ArgumentParser(
        prog="pdrouter", description="Prefill/decode-disaggregated LLM serving router and workers.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    capacity_cmd.add_parser(sub)
    _add_make_model(sub)
    worker_cmd.add_parsers(sub)
    router_cmd.add_parser(sub)
    up_cmd.add_parser(sub)
    bench_cmd.add_parser(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    from pdrouter.cli.local_cluster import follow_parent

    follow_parent()  # a child of `pdrouter up` stops when `up` is gone, however it went
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args))
    except (PdRouterError, ValueError) as exc:
        message = exc.message if isinstance(exc, PdRouterError) else str(exc)
        print(f"pdrouter {args.command}: error: {message}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
