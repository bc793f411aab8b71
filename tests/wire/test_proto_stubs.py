"""The committed gRPC stubs are exactly what grpcio-tools generates from ``proto/`` now."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_stubs_are_not_stale(tmp_path: Path) -> None:
    subprocess.run([sys.executable, str(ROOT / "tools" / "gen_proto.py"), "--out", str(tmp_path)],
                   check=True, capture_output=True)
    fresh = {p.name: p.read_bytes() for p in (tmp_path / "pdrouter" / "wire" / "v1").glob("*_pb2*.py*")}
    committed = {p.name: p.read_bytes() for p in (ROOT / "pdrouter" / "wire" / "v1").glob("*_pb2*.py*")}
    assert len(fresh) == 9  # common, router, worker × (pb2, pyi, grpc)
    assert sorted(fresh) == sorted(committed), "run: python tools/gen_proto.py"
    stale = [name for name in fresh if fresh[name] != committed[name]]
    assert not stale, f"stale stubs {stale}: run `python tools/gen_proto.py` and commit"


def test_every_service_is_defined() -> None:
    from pdrouter.wire.v1 import router_pb2, worker_pb2

    services = {**router_pb2.DESCRIPTOR.services_by_name, **worker_pb2.DESCRIPTOR.services_by_name}
    methods = {f"{s}.{m.name}" for s, d in services.items() for m in d.methods}
    assert {"Router.Generate", "Router.ListModels", "PrefillWorker.Prefill", "DecodeWorker.Allocate",
            "DecodeWorker.Generate", "DecodeWorker.Release", "ColocatedWorker.Generate",
            "WorkerInfoService.GetInfo", "WorkerInfoService.GetLoad"} <= methods
    assert services["Router"].methods_by_name["Generate"].server_streaming
    assert services["DecodeWorker"].methods_by_name["Generate"].server_streaming
