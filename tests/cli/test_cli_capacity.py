"""``pdrouter capacity``: table, JSON, presets, the smallest TP that fits, one-line errors with exit
code 2, and the source document's figures, each from one command. Then the workers' side of a
memory quota: HAMi's limit read from the environment, the utilization derived from it.
"""

from __future__ import annotations

import argparse
import json
import logging
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from pdrouter.cli import worker_cmd
from pdrouter.cli.local_cluster import ManagedProcess
from pdrouter.cli.main import build_parser, main
from pdrouter.core.gpu import GiB
from pdrouter.core.model_spec import get_model_preset
from pdrouter.engine.model_folder import write_config_folder
from pdrouter.engine.sim.config import SimEngineConfig


def run_cli(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    code = main(list(args))
    out, err = capsys.readouterr()
    return code, out, err


def test_json_plan_for_70b_tp8(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run_cli(capsys, "capacity", "--model", "llama-3-70b", "--gpu", "h100", "--tp", "8",
                           "--context", "4096", "--utilization", "0.9", "--json")
    assert code == 0
    plan = json.loads(out)
    assert plan["kv_bytes_per_token"] == 40 * 1024
    assert plan["tp"] == 8 and plan["max_concurrency"] >= 100


def test_table_has_every_figure(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run_cli(capsys, "capacity", "--model", "llama-3-8b", "--gpu", "h100")
    assert code == 0
    for label in ("KV per token", "KV per request", "KV pool", "blocks", "max concurrency", "decode bound"):
        assert label in out
    assert "128.0 KiB" in out


def test_quota_derives_utilization(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run_cli(capsys, "capacity", "--model", "llama-3-8b", "--gpu", "h100", "--quota-gb", "40",
                           "--json")
    assert code == 0
    assert json.loads(out)["utilization"] == 0.5
    code, out, _ = run_cli(capsys, "capacity", "--quota-gb", "40")
    assert "utilization to configure" in out and "0.500" in out


@pytest.mark.parametrize(("args", "needle"), [
    (["--quota-gb", "40", "--utilization", "0.9"], "exceeds the 40.0 GiB memory quota"),
    (["--model", "nope"], "unknown model"),
    (["--gpu", "tpu-v9"], "unknown gpu"),
    (["--context", "0"], "--context must be > 0"),
    (["--tp", "-1"], "--tp must be > 0"),
    (["--utilization", "-0.5"], "--utilization must be > 0"),
    (["--min-concurrency", "0"], "--min-concurrency must be > 0"),
    (["--overhead-gb", "-1"], "--overhead-gb must be >= 0"),
])
def test_errors_are_one_line_and_exit_2(capsys: pytest.CaptureFixture[str], args: list[str],
                                        needle: str) -> None:
    code, out, err = run_cli(capsys, "capacity", *args)
    assert code == 2
    assert out == ""
    assert needle in err
    assert err.count("\n") == 1


def test_list_presets(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run_cli(capsys, "capacity", "--list", "--json")
    data = json.loads(out)
    assert code == 0 and "llama-3-70b" in data["models"] and "h200" in data["gpus"]


def test_console_script_help_lists_subcommands() -> None:
    out = subprocess.run([sys.executable, "-m", "pdrouter", "--help"], capture_output=True, text=True,
                         check=True).stdout
    assert "capacity" in out and "make-model" in out
    bad = subprocess.run([sys.executable, "-m", "pdrouter", "capacity", "--tp", "x"], capture_output=True,
                         text=True)
    assert bad.returncode == 2


def capacity_json(capsys: pytest.CaptureFixture[str], *args: str) -> dict[str, Any]:
    code, out, err = run_cli(capsys, "capacity", *args, "--json")
    assert code == 0 and err == ""
    return dict(json.loads(out))


# -- the source document's figures, one command each ------------------------------------------


def test_70b_on_h100_prints_its_figures_says_it_does_not_fit_and_plans_the_smallest_tp(
        capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run_cli(capsys, "capacity", "--model", "llama-3-70b", "--gpu", "h100", "--context", "4096")
    assert code == 0 and err == ""
    lines = out.splitlines()
    assert "KV per token                           320.0 KiB" in lines  # 2 × 80 × 8 × 128 × 2 bytes
    assert "KV per request (4096 tokens)           1.25 GiB" in lines
    assert "decode bound (1 stream)                23.7 tok/s at TP 1 (3.35 TB/s ÷ 141.1 GB)" in lines  # ≈ 24
    assert ("does not fit at TP 1: 72.0 GiB budget (0.90 × 80.0 GiB) − 131.4 GiB weights − 2.0 GiB overhead "
            "= -61.4 GiB") in lines
    assert "smallest TP that fits: 2" in lines
    assert "plan at TP 2 (per rank)" in lines
    assert "max concurrency                        6 on 2 GPUs" in lines
    table = lines[-5:]  # every TP that splits the 8 KV heads evenly, the plan marked
    assert table[0].split() == ["TP", "weights/rank", "KV", "pool/rank", "max", "concurrency", "per", "GPU",
                                "decode", "bound"]
    assert table[1].split() == ["1", "131.42", "GiB", "does", "not", "fit"]
    assert table[2].split() == ["2", "65.71", "GiB", "4.29", "GiB", "6", "3.0", "47.5", "tok/s", "<-", "plan"]
    assert [row.split()[0] for row in table[3:]] == ["4", "8"] and "<- plan" not in "".join(table[3:])
    plan = capacity_json(capsys, "--model", "llama-3-70b", "--gpu", "h100", "--context", "4096")
    geometry = plan["geometry"]
    assert isinstance(geometry, dict)
    assert geometry["kv_bytes_per_token"] == 320 * 1024
    assert geometry["kv_bytes_per_request"] == int(1.25 * GiB)
    assert 23.0 <= float(geometry["decode_tokens_per_s_bound"]) <= 24.5
    assert (plan["fits"], plan["fit_tp"], plan["requested_tp"], plan["tp"]) == (False, 2, 1, 2)
    assert "does not fit" not in str(plan["reason"]) and "131.4 GiB weights" in str(plan["reason"])
    assert plan["kv_bytes_per_token"] == 160 * 1024 and plan["max_concurrency"] == 6  # the TP-2 plan, per rank


def test_70b_needs_tp_8_for_reasonable_concurrency(capsys: pytest.CaptureFixture[str]) -> None:
    # Every TP: 1 does not fit, 2 holds single digits (like a 32B model on one card), 4 holds ~120,
    # 8 holds ~340 requests of 4k tokens.
    plan = capacity_json(capsys, "--model", "llama-3-70b", "--gpu", "h100", "--context", "4096")
    options = plan["tp_options"]
    assert isinstance(options, list)
    assert [(o["tp"], o["fits"], o["max_concurrency"]) for o in options] == [
        (1, False, None), (2, True, 6), (4, True, 118), (8, True, 342)]
    # "Reasonable": a full running batch at vLLM's default max_num_seqs (256) of 4k requests.
    plan = capacity_json(capsys, "--model", "llama-3-70b", "--gpu", "h100", "--context", "4096",
                         "--min-concurrency", "256")
    assert (plan["fits"], plan["fit_tp"], plan["max_concurrency"]) == (False, 8, 342)
    code, out, _ = run_cli(capsys, "capacity", "--model", "llama-3-70b", "--gpu", "h100", "--min-concurrency", "256")
    assert code == 0 and "smallest TP that holds 256 concurrent 4096-token requests: 8" in out.splitlines()


def test_8b_on_one_80_gb_card_holds_100_plus_4k_requests(capsys: pytest.CaptureFixture[str]) -> None:
    plan = capacity_json(capsys, "--model", "llama-3-8b", "--gpu", "h100", "--context", "4096")
    assert (plan["fits"], plan["fit_tp"], plan["tp"]) == (True, 1, 1)
    assert 100 <= plan["max_concurrency"] <= 130
    assert plan["reason"] is None


def test_32b_on_one_card_holds_single_digits(capsys: pytest.CaptureFixture[str]) -> None:
    plan = capacity_json(capsys, "--model", "qwen2.5-32b", "--gpu", "h100", "--context", "4096")
    assert (plan["fits"], plan["fit_tp"]) == (True, 1)
    assert 1 <= plan["max_concurrency"] <= 9


def test_quota_40_of_80_gives_utilization_half(capsys: pytest.CaptureFixture[str]) -> None:
    plan = capacity_json(capsys, "--gpu", "h100", "--quota-gb", "40")
    assert plan["utilization"] == plan["quota_utilization"] == 0.5


def test_nothing_fits_still_prints_the_figures(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run_cli(capsys, "capacity", "--model", "llama-3-70b", "--gpu", "l40s", "--quota-gb", "8")
    assert code == 0
    assert "KV per token                  320.0 KiB" in out.splitlines()
    assert "no TP up to 8 fits (powers of two dividing the 8 KV heads)" in out
    plan = capacity_json(capsys, "--model", "llama-3-70b", "--gpu", "l40s", "--quota-gb", "8")
    assert (plan["fits"], plan["fit_tp"], plan["tp"]) == (False, None, 1)
    assert "num_blocks" not in plan and isinstance(plan["geometry"], dict)


def test_a_requested_tp_that_fits_is_planned(capsys: pytest.CaptureFixture[str]) -> None:
    plan = capacity_json(capsys, "--model", "llama-3-70b", "--gpu", "h100", "--tp", "4")
    assert (plan["fits"], plan["fit_tp"], plan["tp"], plan["max_concurrency"]) == (True, 4, 4, 118)


# -- workers under a memory quota --------------------------------------------------------------

SIM_DECODE = ["decode", "--backend", "sim", "--model-preset", "llama-3-8b", "--gpu", "h100", "--time-scale", "0"]


def parse(*argv: str) -> argparse.Namespace:
    return build_parser().parse_args(list(argv))


@pytest.fixture
def no_quota_env(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    for name in ("CUDA_DEVICE_MEMORY_LIMIT", *(f"CUDA_DEVICE_MEMORY_LIMIT_{i}" for i in range(8))):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("PDROUTER_KV_TOKEN", "kv-test-token-0123456789")
    return monkeypatch


def test_a_simulated_worker_plans_within_hami_s_limit(no_quota_env: pytest.MonkeyPatch,
                                                      caplog: pytest.LogCaptureFixture) -> None:
    no_quota_env.setenv("CUDA_DEVICE_MEMORY_LIMIT_0", "40g")
    with caplog.at_level(logging.INFO, logger="pdrouter.cli.worker_cmd"):
        engine = worker_cmd.build_config(parse(*SIM_DECODE)).engine
    assert isinstance(engine, SimEngineConfig)
    assert engine.memory_utilization == 0.5 and engine.memory_quota_bytes == 40 * GiB
    plans = [r.getMessage() for r in caplog.records if r.getMessage().startswith("KV pool plan")]
    assert plans == ["KV pool plan: 11,797 blocks of 16 tokens = 23.04 GiB at utilization 0.500 of 80.00 GiB; "
                     "memory quota 40.00 GiB (CUDA_DEVICE_MEMORY_LIMIT_0=40g)"]


def test_a_utilization_above_hami_s_limit_is_one_line_and_exit_2(no_quota_env: pytest.MonkeyPatch,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    no_quota_env.setenv("CUDA_DEVICE_MEMORY_LIMIT_0", "40g")
    assert main([*SIM_DECODE, "--utilization", "0.9"]) == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert err == ("pdrouter decode: error: utilization 0.90 × 80 GiB = 72.0 GiB exceeds the 40.0 GiB memory quota "
                   "(CUDA_DEVICE_MEMORY_LIMIT_0=40g): the engine would size its KV pool past the quota and be "
                   "OOM-killed at start; use utilization <= 0.50 (quota ÷ physical memory)\n")


@pytest.mark.parametrize(("env", "device", "quota_bytes", "source"), [
    ({"CUDA_DEVICE_MEMORY_LIMIT": "40960m"}, 1, 40 * GiB, "CUDA_DEVICE_MEMORY_LIMIT=40960m"),
    ({"CUDA_DEVICE_MEMORY_LIMIT": "20g", "CUDA_DEVICE_MEMORY_LIMIT_1": "40G"}, 1, 40 * GiB,
     "CUDA_DEVICE_MEMORY_LIMIT_1=40G"),
    ({"CUDA_DEVICE_MEMORY_LIMIT_0": str(40 * GiB)}, 0, 40 * GiB, f"CUDA_DEVICE_MEMORY_LIMIT_0={40 * GiB}"),
    ({"CUDA_DEVICE_MEMORY_LIMIT_0": "40g"}, 1, None, None),
    ({}, 0, None, None),
])
def test_the_limit_of_the_worker_s_device_or_the_shared_one(
        no_quota_env: pytest.MonkeyPatch, env: dict[str, str], device: int, quota_bytes: int | None,
        source: str | None) -> None:
    for name, value in env.items():
        no_quota_env.setenv(name, value)
    quota = worker_cmd.memory_quota(parse(*SIM_DECODE), device)
    assert (None if quota is None else (quota.bytes, quota.source)) == (
        None if quota_bytes is None else (quota_bytes, source))


def test_quota_gb_overrides_the_environment_and_a_bad_limit_is_named(
        no_quota_env: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    no_quota_env.setenv("CUDA_DEVICE_MEMORY_LIMIT_0", "40g")
    engine = worker_cmd.build_config(parse(*SIM_DECODE, "--quota-gb", "60")).engine
    assert engine.memory_utilization == 0.75
    no_quota_env.setenv("CUDA_DEVICE_MEMORY_LIMIT_0", "forty")
    assert main(SIM_DECODE) == 2
    assert capsys.readouterr().err == ("pdrouter decode: error: CUDA_DEVICE_MEMORY_LIMIT_0: 'forty' is not a memory "
                                       "size (such as 40g, 40960m or a number of bytes)\n")


@pytest.fixture
def geometry_folder(tmp_path: Path) -> Path:
    """Llama-3-8B's config.json and tokenizer, no weights: what the CUDA path reads before torch loads."""
    return write_config_folder(get_model_preset("llama-3-8b"), tmp_path / "llama-3-8b")


def test_a_cuda_worker_derives_its_utilization_from_the_limit(
        no_quota_env: pytest.MonkeyPatch, geometry_folder: Path, capsys: pytest.CaptureFixture[str]) -> None:
    no_quota_env.setattr(worker_cmd, "_cuda_memory_bytes", lambda device: 80 * GiB)  # an 80 GiB card
    no_quota_env.setenv("CUDA_DEVICE_MEMORY_LIMIT_1", "40g")
    argv = ["decode", "--model", str(geometry_folder), "--device", "cuda:1"]
    engine = worker_cmd.build_config(parse(*argv)).engine
    assert engine.memory_utilization == 0.5 and engine.memory_budget_bytes == 80 * GiB
    assert main([*argv, "--utilization", "0.9"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "exceeds the 40.0 GiB memory quota (CUDA_DEVICE_MEMORY_LIMIT_1=40g)" in err


def test_a_device_that_already_reports_the_limit_keeps_the_default(
        no_quota_env: pytest.MonkeyPatch, geometry_folder: Path) -> None:
    no_quota_env.setattr(worker_cmd, "_cuda_memory_bytes", lambda device: 40 * GiB)  # HAMi's view of the card
    no_quota_env.setenv("CUDA_DEVICE_MEMORY_LIMIT_0", "40g")
    engine = worker_cmd.build_config(parse("decode", "--model", str(geometry_folder), "--device", "cuda")).engine
    assert engine.memory_utilization == 0.9 and engine.memory_budget_bytes == 40 * GiB


def test_a_started_simulated_worker_logs_its_plan_under_the_limit(no_quota_env: pytest.MonkeyPatch) -> None:
    with ManagedProcess("decode", [*SIM_DECODE, "--lane-port", "-1", "--log-level", "INFO"],
                        env={"CUDA_DEVICE_MEMORY_LIMIT_0": "40g"}) as worker:
        worker.wait_ready(timeout=60)
        assert any(line.endswith("KV pool plan: 11,797 blocks of 16 tokens = 23.04 GiB at utilization 0.500 of "
                                 "80.00 GiB; memory quota 40.00 GiB (CUDA_DEVICE_MEMORY_LIMIT_0=40g)")
                   for line in worker.tail), list(worker.tail)
