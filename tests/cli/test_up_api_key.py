"""``pdrouter up`` and API keys: it makes a key (or takes those of ``PDROUTER_API_KEYS``), hands it
to the router by the environment, never a command line, and prints it just before the router's line
(``api key    <key>``); ``--no-api-key`` runs open on loopback only.

The cluster test runs the real ``pdrouter up`` on simulated workers (``--time-scale 0``).
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from pdrouter.cli.main import main

KEY = "k-" + "a" * 30
OTHER_KEY = "k-" + "b" * 30
WAIT_S = 10.0  # hang guard, not a latency bound


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def test_up_runs_open_only_on_loopback(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["up", "--backend", "sim", "--no-api-key", "--host", "0.0.0.0"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err == ("pdrouter up: error: --no-api-key serves loopback hosts only, not --host 0.0.0.0: "
                                 "leave it out (the router then asks for a key, printed at start)\n")


def test_up_checks_the_keys_of_its_environment(capsys: pytest.CaptureFixture[str],
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    from pdrouter.cli.up_cmd import add_parser, router_api_keys

    monkeypatch.setenv("PDROUTER_API_KEYS", f" {KEY} ,{OTHER_KEY}")
    parser = argparse.ArgumentParser()
    add_parser(parser.add_subparsers())
    assert router_api_keys(parser.parse_args(["up"])) == (KEY, f"{KEY},{OTHER_KEY}")
    assert router_api_keys(parser.parse_args(["up", "--no-api-key"])) == (None, "")
    monkeypatch.setenv("PDROUTER_API_KEYS", "")
    key, passed = router_api_keys(parser.parse_args(["up"]))
    assert key is not None and passed == key and len(key) == 32
    monkeypatch.setenv("PDROUTER_API_KEYS", "hunter2")
    assert main(["up", "--backend", "sim"]) == 2
    assert "PDROUTER_API_KEYS has 7 characters" in capsys.readouterr().err


@pytest.fixture
def up_cluster(tmp_path: Path) -> Iterator[tuple[subprocess.Popen[str], list[str]]]:
    env = {k: v for k, v in os.environ.items() if k != "PDROUTER_API_KEYS"}
    argv = [sys.executable, "-m", "pdrouter", "up", "--backend", "sim", "--time-scale", "0", "--model-preset",
            "tiny", "--model", str(tmp_path / "tiny"), "--http-port", "0", "--grpc-port", "0"]
    up = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    lines: list[str] = []
    try:
        assert up.stdout is not None
        deadline = time.monotonic() + 120
        for line in up.stdout:
            lines.append(line.rstrip("\n"))
            if line.startswith("router ") or time.monotonic() > deadline:
                break
        assert lines and lines[-1].startswith("router "), "\n".join(lines)
        yield up, lines
    finally:
        up.send_signal(signal.SIGINT)
        try:
            up.wait(60)
        except subprocess.TimeoutExpired:
            up.kill()
            up.wait()


def test_up_makes_a_key_prints_it_and_the_router_asks_for_it(
        up_cluster: tuple[subprocess.Popen[str], list[str]]) -> None:
    up, lines = up_cluster
    key_lines = [line for line in lines if line.startswith("api key ")]
    assert len(key_lines) == 1 and lines.index(key_lines[0]) == len(lines) - 2  # just before the router's line
    match = re.fullmatch(r"api key {4}(?P<key>[A-Za-z0-9_-]{32})", key_lines[0])
    assert match is not None, key_lines
    key = match.group("key")
    url = lines[-1].split()[1]  # router     http://host:port/v1  …
    assert re.fullmatch(r"http://127\.0\.0\.1:\d+/v1", url)
    body = {"model": "tiny", "prompt": "hello", "max_tokens": 4, "ignore_eos": True}
    assert httpx.post(f"{url}/completions", json=body, timeout=WAIT_S).status_code == 401
    answer = httpx.post(f"{url}/completions", json=body, headers=bearer(key), timeout=60)
    assert answer.status_code == 200, answer.text
    assert answer.json()["usage"]["completion_tokens"] == 4
    # The key reached the router by its environment: no process's command line shows it.
    for pid in _descendants(up.pid):
        with open(f"/proc/{pid}/cmdline", "rb") as cmdline:
            assert key.encode() not in cmdline.read()


def _descendants(pid: int) -> list[int]:
    out: list[int] = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            children = [int(c) for c in (task / "children").read_text().split()]
        except OSError:
            continue
        for child in children:
            out += [child, *_descendants(child)]
    return out
