"""``pdrouter capacity``: table, JSON, presets, and one-line errors with exit code 2."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from pdrouter.cli.main import main


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
    (["--model", "llama-3-70b"], "does not fit"),
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
