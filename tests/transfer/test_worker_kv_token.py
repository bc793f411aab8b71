"""How a worker started by the CLI gets its KV secret: ``PDROUTER_KV_TOKEN`` or ``PDROUTER_KV_TOKEN_FILE``,
at least 16 bytes, no default (only ``pdrouter up`` makes one)."""

from __future__ import annotations

from pathlib import Path

import pytest

from pdrouter.cli import worker_cmd
from pdrouter.cli.main import build_parser, main

SIM_DECODE = ["decode", "--backend", "sim", "--model-preset", "llama-3-8b", "--gpu", "h100", "--time-scale", "0"]
GOOD = "kv-secret-0123456789abcdef"


@pytest.fixture
def env(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    for name in ("PDROUTER_KV_TOKEN", "PDROUTER_KV_TOKEN_FILE", "CUDA_DEVICE_MEMORY_LIMIT",
                 *(f"CUDA_DEVICE_MEMORY_LIMIT_{i}" for i in range(8))):
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def refusal(capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    assert main(list(argv)) == 2
    out, err = capsys.readouterr()
    assert out == "" and "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    return err


@pytest.mark.parametrize("role", ["decode", "prefill"])
def test_a_kv_worker_without_the_secret_refuses_to_start(env: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
                                                         role: str) -> None:
    err = refusal(capsys, role, *SIM_DECODE[1:])
    assert "PDROUTER_KV_TOKEN" in err and "PDROUTER_KV_TOKEN_FILE" in err


def test_a_short_secret_is_refused_without_showing_it(env: pytest.MonkeyPatch,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    env.setenv("PDROUTER_KV_TOKEN", "pdrouter-dev")
    err = refusal(capsys, *SIM_DECODE)
    assert "at least 16 bytes" in err and "pdrouter-dev" not in err


def test_the_secret_from_the_environment_or_a_file(env: pytest.MonkeyPatch, tmp_path: Path) -> None:
    env.setenv("PDROUTER_KV_TOKEN", GOOD)
    assert worker_cmd.build_config(build_parser().parse_args(SIM_DECODE)).kv_auth_token == GOOD
    env.delenv("PDROUTER_KV_TOKEN")
    (secret := tmp_path / "kv-token").write_text(GOOD + "\n")
    env.setenv("PDROUTER_KV_TOKEN_FILE", str(secret))
    assert worker_cmd.build_config(build_parser().parse_args(SIM_DECODE)).kv_auth_token == GOOD


def test_both_forms_or_an_unreadable_file_are_one_line(env: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
                                                       tmp_path: Path) -> None:
    env.setenv("PDROUTER_KV_TOKEN_FILE", str(tmp_path / "missing"))
    assert "PDROUTER_KV_TOKEN_FILE" in refusal(capsys, *SIM_DECODE)
    env.setenv("PDROUTER_KV_TOKEN", GOOD)
    assert "both" in refusal(capsys, *SIM_DECODE)


def test_a_colocated_worker_needs_no_kv_secret(env: pytest.MonkeyPatch) -> None:
    config = worker_cmd.build_config(build_parser().parse_args(["worker", *SIM_DECODE[1:]]))
    assert config.kv_auth_token == ""
