"""Regenerate the Python gRPC stubs in ``pdrouter/v1`` from ``proto/`` with grpcio-tools.

    python tools/gen_proto.py            # write pdrouter/v1/*_pb2*.py
    python tools/gen_proto.py --out DIR  # write them under DIR instead (the staleness test)

The stubs are build output: never edit them by hand; change ``proto/`` and run this.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROTO_ROOT = ROOT / "proto"


def generate(out_root: Path) -> list[Path]:
    """Compile every ``proto/pdrouter/v1/*.proto`` into ``out_root/pdrouter/v1``; returns the files."""
    import grpc_tools
    from grpc_tools import protoc

    protos = sorted(str(p.relative_to(PROTO_ROOT)) for p in (PROTO_ROOT / "pdrouter" / "v1").glob("*.proto"))
    well_known = str(Path(grpc_tools.__file__).parent / "_proto")
    out_root.mkdir(parents=True, exist_ok=True)
    args = ["grpc_tools.protoc", f"-I{PROTO_ROOT}", f"-I{well_known}", f"--python_out={out_root}",
            f"--pyi_out={out_root}", f"--grpc_python_out={out_root}", *protos]
    if protoc.main(args) != 0:
        raise SystemExit("protoc failed")
    return sorted((out_root / "pdrouter" / "v1").glob("*_pb2*.py*"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=ROOT, help="output root (default: the repository)")
    files = generate(parser.parse_args().out)
    print("\n".join(str(f) for f in files), file=sys.stderr)


if __name__ == "__main__":
    main()
