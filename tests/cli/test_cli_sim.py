"""``--backend sim`` refuses bad input in one line with exit code 2, before anything starts."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pdrouter.cli.main import main


def run_error(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0, err
    return err


@pytest.mark.parametrize(("extra", "expected"), [
    (["--model-preset", "llama-9"], "presets: llama-3-8b, llama-3-70b"),
    (["--model-preset", "llama-3-8b", "--gpu", "h900"], "presets: a100-80g, h100-80g"),
    (["--model-preset", "llama-3-8b", "--tp", "3"], "does not divide"),
    (["--model-preset", "llama-3-70b"], "raise tensor parallelism"),
    (["--model-preset", "llama-3-8b", "--time-scale", "-2"], "--time-scale must be >= 0"),
    (["--model-preset", "llama-3-8b", "--link", "carrier-pigeon"], "presets: nvlink, rdma-400g"),
    ([], "exactly one of --model"),
    (["--model-preset", "llama-3-8b", "--kv-backend", "gloo"], "over tcp"),
    (["--model-preset", "llama-3-8b", "--device", "cuda"], "--device only apply to --backend torch"),
    (["--model-preset", "llama-3-8b", "--calibration", "tensorrt"], "neither a preset (vllm, vllm-v0, trtllm"),
    (["--model-preset", "llama-3-8b", "--operator-profile", "/nonexistent"], "needs mlp.csv"),
    (["--model-preset", "llama-3-8b", "--collective-profile", "/nonexistent"], "runs no all-reduce"),
    (["--model-preset", "llama-3-8b", "--tp", "2", "--collective-profile", "/nonexistent"],
     "cannot read the collective profile"),
])
def test_bad_simulated_workers_are_one_line_errors(extra: list[str], expected: str,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    assert expected in run_error(["decode", "--backend", "sim", *extra], capsys)


@pytest.mark.parametrize(("content", "field"), [
    ({"mbu": -0.5}, "mbu"),
    ({"mfu": 0.5, "step_overhead_s": None}, "step_overhead_s"),
    ({"mbu_typo": 0.5}, "mbu_typo"),
])
def test_a_bad_calibration_file_names_the_field(tmp_path: Path, content: dict[str, object], field: str,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "cal.json"
    path.write_text(json.dumps(content))
    err = run_error(["prefill", "--backend", "sim", "--model-preset", "llama-3-8b", "--calibration", str(path)],
                    capsys)
    assert field in err and str(path) in err


def test_sim_options_are_refused_for_the_torch_engine(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    err = run_error(["worker", "--model", str(tmp_path), "--time-scale", "3"], capsys)
    assert "--time-scale only apply to --backend sim" in err


def test_up_checks_the_simulated_fleet_before_starting(capsys: pytest.CaptureFixture[str]) -> None:
    assert "presets" in run_error(["up", "--backend", "sim", "--gpu", "h900"], capsys)
    assert "neither a preset" in run_error(["up", "--backend", "sim", "--calibration", "trt"], capsys)
    assert "runs no all-reduce" in run_error(["up", "--backend", "sim", "--collective-profile", "ar.txt"], capsys)
    assert "--collective-profile only apply to --backend sim" in run_error(
        ["up", "--collective-profile", "ar.txt"], capsys)


def test_an_operator_profile_must_match_the_workers_tp(capsys: pytest.CaptureFixture[str]) -> None:
    profile = Path(__file__).resolve().parents[2] / "benchmarks" / "data" / "vidur" / "h100_llama2_7b"
    err = run_error(["decode", "--backend", "sim", "--model-preset", "llama-3-70b", "--tp", "8",
                     "--operator-profile", str(profile)], capsys)
    assert "no rows for TP 8" in err


def test_the_calibration_flag_and_the_profile_reach_the_simulated_engine(tmp_path: Path) -> None:
    from pdrouter.cli.main import build_parser
    from pdrouter.cli.worker_cmd import _sim_config
    from pdrouter.engine.sim.calibration import Calibration

    base = ["decode", "--backend", "sim", "--model-preset", "llama-3-8b", "--num-blocks", "64"]
    assert _sim_config(build_parser().parse_args(base)).calibration == Calibration.preset("vllm")
    config = _sim_config(build_parser().parse_args([*base, "--calibration", "trtllm"]))
    assert config.calibration == Calibration.preset("trtllm")
    path = tmp_path / "cal.yaml"
    path.write_text("preset: torch-eager\nmbu: 0.5\n")
    config = _sim_config(build_parser().parse_args([*base, "--calibration", str(path)]))
    assert config.calibration == Calibration.preset("torch-eager").with_overrides(mbu=0.5)
    profile = Path(__file__).resolve().parents[2] / "benchmarks" / "data" / "vidur" / "h100_llama2_7b"
    config = _sim_config(build_parser().parse_args([*base, "--operator-profile", str(profile)]))
    assert config.profile is not None and config.profile.tp == 1


def test_a_collective_profile_reaches_the_simulated_engine(tmp_path: Path) -> None:
    from pdrouter.cli.main import build_parser
    from pdrouter.cli.worker_cmd import _sim_config

    nccl = tmp_path / "ar.txt"
    nccl.write_text("# nThread 1 nGpus 2 minBytes 8 maxBytes 8388608\n#  out-of-place\n"
                    "1048576 262144 float sum -1 80.0 13.1 13.1 0 79.0 13.2 13.2 0\n"
                    "8388608 2097152 float sum -1 500.0 16.8 16.8 0 498.0 16.8 16.8 0\n")
    base = ["decode", "--backend", "sim", "--model-preset", "llama-3-8b", "--num-blocks", "64", "--tp", "2",
            "--collective-profile", str(nccl)]
    config = _sim_config(build_parser().parse_args(base))
    assert config.profile is not None and config.profile.ops == {}
    assert config.profile.allreduce_time(1048576) == pytest.approx(80e-6)
    vidur = Path(__file__).resolve().parents[2] / "benchmarks" / "data" / "vidur" / "h100_llama2_7b"
    config = _sim_config(build_parser().parse_args([*base, "--operator-profile", str(vidur)]))
    assert config.profile is not None and config.profile.ops and config.profile.allreduce_time(8388608) == 500e-6
