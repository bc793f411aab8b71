"""deploy/healthcheck.py (``pdrouter-healthcheck`` in the image): healthy is exit 0, anything else 1."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, HTTPServer
from types import ModuleType

import pytest
from grpc_health.v1 import health_pb2

from pdrouter.state.embedded_redis import free_port
from pdrouter.wire.grpc_util import GrpcServer

from .deploy_files import load_healthcheck_module


@pytest.fixture(scope="module")
def healthcheck() -> ModuleType:
    return load_healthcheck_module()


class _Status(BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        self.send_response(200 if self.path == "/health" else 503)
        self.end_headers()

    def log_message(self, format: str, *args: object) -> None:
        pass


@pytest.fixture
def http_port() -> Iterator[int]:
    server = HTTPServer(("127.0.0.1", 0), _Status)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server.server_address[1]
    server.shutdown()
    server.server_close()


def test_http_200_is_healthy(healthcheck: ModuleType, http_port: int) -> None:
    assert healthcheck.main(["http", f"http://127.0.0.1:{http_port}/health"]) == 0


def test_http_error_or_no_server_is_unhealthy(healthcheck: ModuleType, http_port: int,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    assert healthcheck.main(["http", f"http://127.0.0.1:{http_port}/other"]) == 1
    assert healthcheck.main(["--timeout", "1", "http", f"http://127.0.0.1:{free_port()}/health"]) == 1
    assert capsys.readouterr().err.count("unhealthy:") == 2


async def test_grpc_serving_is_healthy_and_not_serving_is_not(healthcheck: ModuleType,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    server = GrpcServer("127.0.0.1", 0)
    await server.start()
    address = f"127.0.0.1:{server.port}"
    try:
        assert await asyncio.to_thread(healthcheck.main, ["grpc", address]) == 0
        assert await asyncio.to_thread(healthcheck.main, ["grpc", address, "--service", "no.such.Service"]) == 1
        await server.health.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
        assert await asyncio.to_thread(healthcheck.main, ["grpc", address]) == 1
    finally:
        await server.stop(0)
    assert await asyncio.to_thread(healthcheck.main, ["--timeout", "1", "grpc", address]) == 1
    err = capsys.readouterr().err
    assert "NOT_FOUND" in err and "NOT_SERVING" in err and "UNAVAILABLE" in err
