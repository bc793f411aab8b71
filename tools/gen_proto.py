"""Regenerate the Python gRPC stubs in ``pdrouter/wire/v1`` from ``proto/`` with grpcio-tools.

    python tools/gen_proto.py            # write pdrouter/wire/v1/*_pb2*.py
    python tools/gen_proto.py --out DIR  # write them under DIR instead (the staleness test)

The contracts keep their protobuf package and file names (``pdrouter/v1/*.proto``, package
``pdrouter.v1``); only the Python modules live in the wire layer, so the generated imports of one
stub by another (``from pdrouter.v1 import common_pb2``) are pointed at ``pdrouter.wire.v1``.
The stubs are build output: never edit them by hand; change ``proto/`` and run this.
"""

from __future__ import annotations

import argparse
import re
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROTO_ROOT = ROOT / "proto"
PACKAGE_DIR = Path("pdrouter") / "wire" / "v1"
# Module paths of the generated code: `from pdrouter.v1 import x_pb2` and 'pdrouter.v1.x_pb2'.
_MODULE_PATH = re.compile(r"\bpdrouter\.v1(?=\s+import\s|\.\w+_pb2\b)")


def generate(out_root: Path) -> list[Path]:
    """Compile every ``proto/pdrouter/v1/*.proto`` into ``out_root/pdrouter/wire/v1``; returns the files."""
    import grpc_tools
    from grpc_tools import protoc

    protos = sorted(str(p.relative_to(PROTO_ROOT)) for p in (PROTO_ROOT / "pdrouter" / "v1").glob("*.proto"))
    well_known = str(Path(grpc_tools.__file__).parent / "_proto")
    out_dir = out_root / PACKAGE_DIR
    out_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        args = ["grpc_tools.protoc", f"-I{PROTO_ROOT}", f"-I{well_known}", f"--python_out={tmp}",
                f"--pyi_out={tmp}", f"--grpc_python_out={tmp}", *protos]
        if protoc.main(args) != 0:
            raise SystemExit("protoc failed")
        for src in sorted((Path(tmp) / "pdrouter" / "v1").glob("*_pb2*.py*")):
            (out_dir / src.name).write_text(_MODULE_PATH.sub("pdrouter.wire.v1", src.read_text()))
    return sorted(out_dir.glob("*_pb2*.py*"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=ROOT, help="output root (default: the repository)")
    files = generate(parser.parse_args().out)
    print("\n".join(str(f) for f in files), file=sys.stderr)


if __name__ == "__main__":
    main()
