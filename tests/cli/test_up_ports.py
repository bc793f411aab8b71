"""``pdrouter up`` with a router port taken: one line naming the port and its flag, exit 2; the
parent reads a child's address only from the child's ready line, never from a traceback."""

from __future__ import annotations

import socket
from collections.abc import Iterator
from pathlib import Path

import pytest

from pdrouter.cli.local_cluster import ManagedProcess, parse_ready_line, ready_line
from pdrouter.cli.main import main
from pdrouter.cli.up_cmd import wait_for_router
from pdrouter.core.errors import ConfigError, UnavailableError
from pdrouter.core.model_spec import get_model_preset
from pdrouter.engine.model_folder import write_config_folder


@pytest.fixture
def taken_port() -> Iterator[int]:
    """A port on 127.0.0.1 that something else listens on."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen(1)
        yield sock.getsockname()[1]


@pytest.mark.parametrize(("flag", "other"), [("--http-port", "--grpc-port"), ("--grpc-port", "--http-port")])
def test_a_taken_router_port_is_one_line_naming_the_port_and_the_flag(
        flag: str, other: str, taken_port: int, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["up", "--backend", "sim", "--model", str(tmp_path / "model"), flag, str(taken_port), other, "0"])
    out, err = capsys.readouterr()
    assert code == 2
    assert err == (f"pdrouter up: error: port {taken_port} on 127.0.0.1 is already in use: stop what listens "
                   f"there or choose another port with {flag}\n")
    assert out == "" and not (tmp_path / "model").exists()  # nothing was started or written


def test_the_same_port_for_both_front_doors_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["up", "--backend", "sim", "--http-port", "8123", "--grpc-port", "8123"]) == 2
    assert capsys.readouterr().err == ("pdrouter up: error: --http-port and --grpc-port are both 8123: give them "
                                       "different ports\n")


def test_only_a_whole_ready_line_counts() -> None:
    assert parse_ready_line(ready_line("router", "127.0.0.1:8000", "127.0.0.1:50051") + "\n") == (
        "127.0.0.1:8000", "127.0.0.1:50051")
    assert parse_ready_line(ready_line("decode worker decode-0", "10.0.0.7:41234")) == ("10.0.0.7:41234", None)
    # What a failed child prints: the traceback quotes the code that would have printed the line.
    for line in ['    serve_until_signal(process, lambda: ready_line("router", f"{process.config.host}:'
                 '{process.http_port}",',
                 '    serve_until_signal(process, lambda: f"router ready at {process.config.host}:'
                 '{process.http_port} "',
                 "router ready at 127.0.0.1:8000 grpc 127.0.0.1:50051",
                 "2025-01-01 12:00:00 INFO x: ready: router at 127.0.0.1:8000",
                 "ready: router at {process.config.host}:{process.http_port}",
                 "ready: router at 127.0.0.1:port"]:
        assert parse_ready_line(line) is None, line


def test_a_router_that_cannot_bind_is_not_taken_for_ready(taken_port: int, tmp_path: Path) -> None:
    folder = write_config_folder(get_model_preset("tiny"), tmp_path / "tiny")
    with ManagedProcess("router", ["router", "--model", str(folder), "--workers", "127.0.0.1:1",
                                   "--http-port", str(taken_port), "--grpc-port", "0", "--log-level", "WARNING"]
                        ) as router:
        with pytest.raises(UnavailableError, match="router exited"):
            router.wait_ready(timeout=60)
        assert router.address is None
        # The router itself checks its ports first: one line naming the flag, no traceback.
        assert not any("Traceback" in line for line in router.tail)
        assert any(f"port {taken_port}" in line and "--http-port" in line for line in router.tail)
        # `pdrouter up` then checks the router's ports again and names the one taken in one line.
        with pytest.raises(ConfigError, match=f"port {taken_port} on 127.0.0.1 is already in use: .* --http-port$"):
            wait_for_router(router, "127.0.0.1", [(taken_port, "--http-port"), (0, "--grpc-port")])


@pytest.mark.parametrize("flag", ["--http-port", "--grpc-port"])
def test_a_router_on_a_taken_port_is_one_line_naming_the_flag(flag: str, taken_port: int, tmp_path: Path,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    folder = write_config_folder(get_model_preset("tiny"), tmp_path / "model")
    other = "--grpc-port" if flag == "--http-port" else "--http-port"
    assert main(["router", "--model", str(folder), "--workers", "127.0.0.1:1", flag, str(taken_port),
                 other, "0"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"port {taken_port}" in err[0] and flag in err[0], err
