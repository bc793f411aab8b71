"""Worker and router CLI: the lane settings and their errors (one line, exit 2, nothing started)."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from pdrouter.cli.main import build_parser
from pdrouter.cli.worker_cmd import build_config
from pdrouter.engine.model_io import make_model


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_model("tiny", 0, tmp_path_factory.mktemp("cli") / "tiny")


def parse(*argv: str) -> argparse.Namespace:
    return build_parser().parse_args(list(argv))


def test_lane_port_default_fixed_and_off(model: Path) -> None:
    assert build_config(parse("decode", "--model", str(model))).lane_port == 0  # any free port
    assert build_config(parse("prefill", "--model", str(model), "--lane-port", "50062")).lane_port == 50062
    assert build_config(parse("worker", "--model", str(model), "--lane-port", "-1")).lane_port is None


@pytest.mark.parametrize("port", ["-5", "70000"])
def test_a_bad_lane_port_is_one_line_and_exit_2(model: Path, port: str, capsys: pytest.CaptureFixture[str]) -> None:
    from pdrouter.cli.main import main

    assert main(["worker", "--model", str(model), "--lane-port", port]) == 2
    err = capsys.readouterr().err.strip()
    assert err == f"pdrouter worker: error: the lane port must be in [0, 65535], got {port}"


def test_router_worker_transport_choices(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        parse("router", "--model", "m", "--worker-transport", "carrier-pigeon")
    assert info.value.code == 2 and "invalid choice: 'carrier-pigeon'" in capsys.readouterr().err


def test_router_admission_credit_default_and_bad(model: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from pdrouter.cli.main import main
    from pdrouter.cli.router_cmd import build_config as router_config

    redis = ("--redis", "redis://127.0.0.1:1")
    assert router_config(parse("router", "--model", str(model), *redis)).admission_config.credit_fraction == 0.05
    off = router_config(parse("router", "--model", str(model), *redis, "--admission-credit", "0"))
    assert off.admission_config.credit_fraction == 0.0
    assert main(["router", "--model", str(model), *redis, "--admission-credit", "0.9"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == ("pdrouter router: error: --admission-credit is a fraction of a decode worker's pool in "
                   "[0, 0.5], got 0.9")


def test_torch_threads_flag_environment_and_bad_values(model: Path, monkeypatch: pytest.MonkeyPatch,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    from pdrouter.cli.main import main
    from pdrouter.cli.worker_cmd import TORCH_THREADS_ENV, torch_threads

    monkeypatch.delenv(TORCH_THREADS_ENV, raising=False)
    assert torch_threads(parse("decode", "--model", str(model))) == 0  # torch's default
    monkeypatch.setenv(TORCH_THREADS_ENV, "3")
    assert torch_threads(parse("decode", "--model", str(model))) == 3
    assert torch_threads(parse("decode", "--model", str(model), "--torch-threads", "1")) == 1  # the flag wins
    assert main(["worker", "--model", str(model), "--torch-threads", "-1"]) == 2
    assert capsys.readouterr().err.strip() == ("pdrouter worker: error: --torch-threads must be 0 (torch's "
                                               "default) or more, got -1")
    monkeypatch.setenv(TORCH_THREADS_ENV, "two")
    assert main(["prefill", "--model", str(model)]) == 2
    assert capsys.readouterr().err.strip() == ("pdrouter prefill: error: PDROUTER_TORCH_THREADS must be a whole "
                                               "number, got 'two'")


def test_cores_each_splits_the_cores() -> None:
    from pdrouter.cli.local_cluster import cores_each, worker_args
    from pdrouter.worker.cpus import cpu_budget

    cores = cpu_budget().usable  # the affinity mask, capped by a cgroup CPU limit
    assert cores_each(1) == cores and cores_each(cores * 4) == 1 and cores_each(0) == cores
    assert worker_args("decode", "m", torch_threads=2)[-2:] == ["--torch-threads", "2"]
    assert "--torch-threads" not in worker_args("decode", "m")


def test_heartbeat_flags_default_set_and_refused(model: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from pdrouter.cli.main import main

    default = build_config(parse("worker", "--model", str(model)))
    assert (default.heartbeat_interval_s, default.heartbeat_ttl_ms) == (1.0, 3000)
    slow_host = build_config(parse("decode", "--model", str(model), "--heartbeat-ttl-ms", "10000",
                                   "--heartbeat-interval-s", "2"))
    assert (slow_host.heartbeat_interval_s, slow_host.heartbeat_ttl_ms) == (2.0, 10000)
    assert main(["worker", "--model", str(model), "--heartbeat-ttl-ms", "1000"]) == 2
    assert capsys.readouterr().err.strip() == (
        "pdrouter worker: error: the heartbeat interval (1.0 s) must be shorter than the heartbeat TTL (1000 ms): "
        "a TTL of 2-3 times the interval rides out a late heartbeat")
    for bad in ("0", "-1", "nan"):
        assert main(["prefill", "--model", str(model), "--heartbeat-interval-s", bad]) == 2
        assert capsys.readouterr().err.strip() == (
            f"pdrouter prefill: error: --heartbeat-interval-s must be > 0, got {float(bad)}")


def test_the_kv_tcp_congestion_flag(model: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from pdrouter.cli.main import main

    assert build_config(parse("decode", "--model", str(model))).kv_tcp_congestion is None  # the host's
    chosen = build_config(parse("prefill", "--model", str(model), "--kv-tcp-congestion", "reno"))
    assert chosen.kv_tcp_congestion == "reno" and chosen.engine is not None
    assert main(["decode", "--model", str(model), "--kv-tcp-congestion", "no-such-cc"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("pdrouter decode: error: the kernel refused TCP congestion control 'no-such-cc'")
    assert "\n" not in err and "available here:" in err

