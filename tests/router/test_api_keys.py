"""API keys on both front doors: which keys are accepted, the 401 / UNAUTHENTICATED answers on
every way a request arrives, the open liveness paths, ``/metrics`` behind the key or on its own
port, and the start-up checks.

The doors serve the echo dispatcher on real servers; the router tests run the real process.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import socket
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import httpx
import pytest

from pdrouter.cli.local_cluster import ManagedProcess
from pdrouter.cli.main import main
from pdrouter.core.errors import ConfigError
from pdrouter.core.model_spec import get_model_preset
from pdrouter.core.net import is_loopback
from pdrouter.core.tokenizer import ByteTokenizer
from pdrouter.engine.model_folder import write_config_folder
from pdrouter.router.config import RouterConfig
from pdrouter.router.frontdoor.auth import ApiKeys, AuthenticationError, collect_api_keys
from pdrouter.router.frontdoor.grpc_api import DOOR_SERVERS, SERVICE_NAME, RouterServicer, add_to_server, door_server
from pdrouter.router.frontdoor.http_api import HttpFrontdoor
from pdrouter.router.frontdoor.http_cycle import RequestHead, whole_request_head
from pdrouter.router.metrics import RouterMetrics
from pdrouter.router.server import RouterProcess
from pdrouter.testing.echo import EchoDispatcher
from pdrouter.testing.http import serving
from pdrouter.wire.grpc_util import check_health
from pdrouter.wire.v1 import common_pb2, router_pb2, router_pb2_grpc

KEY = "k-" + "a" * 30
OTHER_KEY = "k-" + "b" * 30
WRONG_KEY = "k-" + "c" * 30
TOKENIZERS = {"echo": ByteTokenizer(512)}
BODY = b'{"model": "echo", "prompt": "hi", "max_tokens": 2}'
WAIT_S = 10.0  # hang guard, not a latency bound


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


# -- which keys are accepted ---------------------------------------------------------------------


def test_keys_are_the_union_of_flags_files_and_the_environment(tmp_path: Path) -> None:
    first, second = tmp_path / "a.keys", tmp_path / "b.keys"
    first.write_text(f"# the web team\n\n  {OTHER_KEY}  \n#{WRONG_KEY}\n")
    second.write_text(f"{'d' * 16}\n")
    keys = collect_api_keys([KEY], [first, second], f" {'e' * 20} ,, ")
    assert len(keys) == 4 and keys.enabled
    for key in (KEY, OTHER_KEY, "d" * 16, "e" * 20):
        keys.check(f"Bearer {key}".encode())
    with pytest.raises(AuthenticationError, match="invalid API key"):
        keys.check(f"Bearer {WRONG_KEY}".encode())  # commented out
    assert collect_api_keys([KEY, KEY], env=KEY) == ApiKeys([KEY])
    assert not collect_api_keys(env="").enabled and not collect_api_keys(env=" , ").enabled


def test_a_key_is_never_shown() -> None:
    keys = ApiKeys([KEY, OTHER_KEY])
    assert repr(keys) == "ApiKeys(2 keys)"
    config = RouterConfig(model_dir=Path("m"), redis_url="redis://:s3cret@cache:6379/0", api_keys=keys)
    assert KEY not in repr(config) and "s3cret" not in repr(config)


@pytest.mark.parametrize(("flags", "env", "file_text", "words"), [
    (["short-key"], None, None, "an API key from --api-key has 9 characters: keys need at least 16"),
    ([], "a" * 20 + ",tiny", None, "an API key from PDROUTER_API_KEYS has 4 characters"),
    ([], None, f"{KEY}\nnot-long\n", "line 2 has 8 characters"),
    (["has a space in it, too"], None, None, "a space or a character that is not printable ASCII"),
    ([], None, "# nothing but comments\n\n", "holds no key"),
])
def test_bad_keys_are_refused_without_showing_them(tmp_path: Path, flags: list[str], env: str | None,
                                                   file_text: str | None, words: str) -> None:
    files = []
    if file_text is not None:
        files = [tmp_path / "keys"]
        files[0].write_text(file_text)
    with pytest.raises(ConfigError, match=re.escape(words)) as raised:
        collect_api_keys(flags, files, env)
    assert "short-key" not in raised.value.message and "not-long" not in raised.value.message
    assert "\n" not in raised.value.message


@pytest.mark.parametrize(("authorization", "error"), [
    (None, "no API key"),
    (b"", "no API key"),
    (b"Basic " + KEY.encode(), "no API key"),
    (KEY.encode(), "no API key"),
    (b"Bearer", "invalid API key"),
    (b"Bearer " + WRONG_KEY.encode(), "invalid API key"),
    (b"Bearer " + KEY.encode()[:-1], "invalid API key"),
    (b"Bearer " + KEY.encode() + b"x", "invalid API key"),
    (b"Bearer " + KEY.upper().encode(), "invalid API key"),
    (b"Bearer \xff\xfe", "invalid API key"),
    (None, None),  # open doors: anything goes
])
def test_the_check(authorization: bytes | None, error: str | None) -> None:
    keys = ApiKeys([KEY, OTHER_KEY]) if error else ApiKeys()
    if error is None:
        keys.check(authorization)
        return
    with pytest.raises(AuthenticationError, match=error):
        keys.check(authorization)
    for good in (f"Bearer {KEY}", f"bearer {OTHER_KEY}", f"  BEARER   {KEY} ", f"Bearer {KEY}".encode()):
        keys.check(good)


@pytest.mark.parametrize(("host", "loopback"), [
    ("127.0.0.1", True), ("127.3.4.5", True), ("::1", True), ("[::1]", True), ("localhost", True),
    ("0.0.0.0", False), ("::", False), ("10.0.0.7", False), ("router.internal", False), ("", False)])
def test_loopback_hosts(host: str, loopback: bool) -> None:
    assert is_loopback(host) is loopback


# -- the HTTP door -----------------------------------------------------------------------------


@pytest.fixture
async def door_port() -> AsyncIterator[int]:
    door = HttpFrontdoor(EchoDispatcher(), TOKENIZERS, metrics=RouterMetrics(), api_keys=ApiKeys([KEY, OTHER_KEY]))
    async with serving(door.app, WAIT_S) as (_, port):
        yield port


def assert_401(status: int, headers: Any, body: bytes, words: str) -> None:
    assert status == 401
    assert headers["www-authenticate"] == "Bearer"
    error = json.loads(body)["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert (error["type"], error["param"], error["code"]) == ("invalid_request_error", None, "invalid_api_key")
    assert words in error["message"]


async def raw_exchange(port: int, *parts: bytes) -> tuple[int, dict[str, str], bytes]:
    """Send ``parts`` on a new connection, a pause between them (so the server reads them apart);
    the response's status, headers and body."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        for i, part in enumerate(parts):
            if i:
                await asyncio.sleep(0.05)
            writer.write(part)
            await writer.drain()
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), WAIT_S)
        status_line, *lines = head.decode("latin-1").rstrip("\r\n").split("\r\n")
        headers = {name.lower(): value for name, _, value in (line.partition(": ") for line in lines)}
        body = await asyncio.wait_for(reader.readexactly(int(headers["content-length"])), WAIT_S)
        return int(status_line.split(" ")[1]), headers, body
    finally:
        writer.close()


def request(target: bytes = b"/v1/completions", authorization: bytes | None = None, extra: bytes = b"") -> bytes:
    auth = b"" if authorization is None else b"Authorization: %s\r\n" % authorization
    return (b"POST %s HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n%s%scontent-length: %d\r\n\r\n%s"
            % (target, auth, extra, len(BODY), BODY))


def test_a_request_read_whole_gives_its_head() -> None:
    routes = {b"/v1/completions": "completions"}
    good = b"Bearer " + KEY.upper().encode()
    path, json_type = b"/v1/completions", b"application/json"
    assert whole_request_head(request(authorization=good), routes) == (
        "completions", True, BODY, path, RequestHead(good, json_type, None))  # the key keeps its case
    assert whole_request_head(request(authorization=b"  " + good + b" \t"), routes) == (
        "completions", True, BODY, path, RequestHead(good, json_type, None))
    assert whole_request_head(request(), routes) == ("completions", True, BODY, path,
                                                     RequestHead(None, json_type, None))
    labelled = request(extra=b"X-Request-Id: Mine-1\r\n")
    assert whole_request_head(labelled, routes) == ("completions", True, BODY, path,
                                                    RequestHead(None, json_type, b"Mine-1"))
    two = request(authorization=good, extra=b"authorization: " + good + b"\r\n")
    assert whole_request_head(two, routes) is None  # the parser, then the application, answer it


@pytest.mark.parametrize("arrival", ["whole", "in pieces", "query string"])
async def test_generation_needs_a_key_however_it_arrives(door_port: int, arrival: str) -> None:
    """Each entry point of the server: read whole, parsed by httptools, uvicorn's own cycle."""
    def parts(authorization: bytes | None) -> tuple[bytes, ...]:
        if arrival == "query string":
            return (request(b"/v1/completions?x=1", authorization),)
        data = request(authorization=authorization)
        return (data,) if arrival == "whole" else (data[:-10], data[-10:])

    assert_401(*await raw_exchange(door_port, *parts(None)), "no API key")
    assert_401(*await raw_exchange(door_port, *parts(b"Bearer " + WRONG_KEY.encode())), "invalid API key")
    assert_401(*await raw_exchange(door_port, *parts(b"Basic dXNlcjpwYXNz")), "no API key")
    for key in (KEY, OTHER_KEY):
        status, _, body = await raw_exchange(door_port, *parts(b"Bearer " + key.encode()))
        assert status == 200 and json.loads(body)["choices"][0]["text"] == "hi"


async def test_two_authorization_headers_are_refused(door_port: int) -> None:
    good = b"Bearer " + KEY.encode()
    data = request(authorization=good, extra=b"Authorization: " + good + b"\r\n")
    assert_401(*await raw_exchange(door_port, data), "several Authorization headers")
    assert_401(*await raw_exchange(door_port, data[:-10], data[-10:]), "several Authorization headers")


async def test_every_route_but_health_needs_the_key(door_port: int) -> None:
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{door_port}") as client:
        for path in ("/health", "/healthz"):
            response = await client.get(path)
            assert response.status_code == 200 and response.json() == {"status": "ok"}
        for method, path in [("GET", "/v1/models"), ("GET", "/metrics"), ("POST", "/v1/chat/completions"),
                             ("GET", "/v1/completions"), ("GET", "/nowhere"), ("DELETE", "/v1/models")]:
            response = await client.request(method, path)
            assert_401(response.status_code, response.headers, response.content, "no API key")
        models = await client.get("/v1/models", headers=bearer(KEY))
        assert models.status_code == 200 and models.json()["data"][0]["id"] == "echo"
        metrics = await client.get("/metrics", headers=bearer(OTHER_KEY))
        assert metrics.status_code == 200 and "pdrouter_requests_total" in metrics.text
        assert (await client.get("/nowhere", headers=bearer(KEY))).status_code == 404
        chat = await client.post("/v1/chat/completions", headers=bearer(KEY), json={
            "model": "echo", "messages": [{"role": "user", "content": "x"}], "max_tokens": 1})
        assert chat.status_code == 200


async def test_the_official_client_gets_an_authentication_error(door_port: int) -> None:
    import openai

    base = f"http://127.0.0.1:{door_port}/v1"
    async with openai.AsyncOpenAI(base_url=base, api_key=WRONG_KEY, max_retries=0) as wrong:
        with pytest.raises(openai.AuthenticationError) as raised:
            await wrong.completions.create(model="echo", prompt="hi", max_tokens=1)
        assert raised.value.code == "invalid_api_key"
    async with openai.AsyncOpenAI(base_url=base, api_key=KEY, max_retries=0) as right:
        result = await right.completions.create(model="echo", prompt="hi", max_tokens=2)
        assert result.choices[0].text == "hi"


async def test_without_keys_the_door_is_open_and_metrics_can_move_out() -> None:
    door = HttpFrontdoor(EchoDispatcher(), TOKENIZERS, metrics=RouterMetrics(), api_keys=ApiKeys(),
                         serve_metrics=False)
    async with serving(door.app, WAIT_S) as (_, port), httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as c:
        assert (await c.post("/v1/completions", content=BODY)).status_code == 200
        assert (await c.get("/metrics")).status_code == 404


# -- the gRPC door -----------------------------------------------------------------------------


@pytest.fixture(params=DOOR_SERVERS)
async def grpc_address(request: pytest.FixtureRequest) -> AsyncIterator[str]:
    server = door_server(request.param, keys=ApiKeys([KEY, OTHER_KEY]))
    add_to_server(server, RouterServicer(EchoDispatcher(), TOKENIZERS, metrics=RouterMetrics()))
    await server.start()
    yield server.address
    await server.stop(0)


GENERATE = router_pb2.GenerateRequest(model="echo", text="hi", sampling=common_pb2.SamplingParams(max_tokens=2))


async def test_grpc_calls_need_the_key(grpc_address: str) -> None:
    async with grpc.aio.insecure_channel(grpc_address) as channel:
        stub = router_pb2_grpc.RouterStub(channel)
        for metadata, words in [((), "no API key"), ((("authorization", f"Bearer {WRONG_KEY}"),), "invalid API key"),
                                ((("authorization", KEY),), "no API key"),
                                ((("authorization", f"Bearer {KEY}"), ("authorization", f"Bearer {KEY}")),
                                 "several authorization")]:
            with pytest.raises(grpc.aio.AioRpcError) as raised:
                [m async for m in stub.Generate(GENERATE, metadata=metadata, timeout=WAIT_S)]
            assert raised.value.code() == grpc.StatusCode.UNAUTHENTICATED
            assert words in (raised.value.details() or "")
            with pytest.raises(grpc.aio.AioRpcError) as raised:
                await stub.ListModels(router_pb2.ListModelsRequest(), metadata=metadata, timeout=WAIT_S)
            assert raised.value.code() == grpc.StatusCode.UNAUTHENTICATED
        for key in (KEY, OTHER_KEY):
            messages = [m async for m in stub.Generate(GENERATE, metadata=(("authorization", f"Bearer {key}"),),
                                                       timeout=WAIT_S)]
            assert "".join(m.text for m in messages) == "hi"
        models = await stub.ListModels(router_pb2.ListModelsRequest(), metadata=(("authorization", f"bearer {KEY}"),))
        assert [m.id for m in models.models] == ["echo"]
    assert await check_health(grpc_address) and await check_health(grpc_address, SERVICE_NAME)


# -- the router process ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def model_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_config_folder(get_model_preset("tiny"), tmp_path_factory.mktemp("models") / "tiny")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def test_a_short_key_stops_the_router_before_it_starts(model_folder: Path, capsys: pytest.CaptureFixture[str],
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    argv = ["router", "--model", str(model_folder), "--workers", "127.0.0.1:1", "--http-port", "0",
            "--grpc-port", "0"]
    assert main([*argv, "--api-key", "hunter2"]) == 2
    err = capsys.readouterr().err
    assert err == ("pdrouter router: error: an API key from --api-key has 7 characters: keys need at least 16 "
                   "(make one with: python -c 'import secrets; print(secrets.token_urlsafe(24))')\n")
    monkeypatch.setenv("PDROUTER_API_KEYS", f"{KEY},hunter2")
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "PDROUTER_API_KEYS has 7 characters" in err and "hunter2" not in err


def test_the_router_process_asks_for_the_key_and_serves_metrics_apart(model_folder: Path, tmp_path: Path) -> None:
    key_file = tmp_path / "keys"
    key_file.write_text(f"# rotated in on Monday\n{OTHER_KEY}\n")
    metrics_port = free_port()
    env = {"PDROUTER_API_KEYS": KEY}  # and the file's key: the router accepts both
    argv = ["router", "--model", str(model_folder), "--workers", "127.0.0.1:1", "--http-port", "0",
            "--grpc-port", "0", "--api-key-file", str(key_file), "--metrics-port", str(metrics_port),
            "--log-level", "INFO"]
    with ManagedProcess("router", argv, env=env) as router:
        http = router.wait_ready(timeout=60)
        with httpx.Client(base_url=f"http://{http}", timeout=WAIT_S) as client:
            assert client.get("/health").status_code == 200
            assert client.post("/v1/completions", content=BODY).status_code == 401
            assert client.get("/v1/models", headers=bearer(WRONG_KEY)).status_code == 401
            for key in (KEY, OTHER_KEY):
                models = client.get("/v1/models", headers=bearer(key))
                assert models.status_code == 200 and models.json()["data"][0]["id"] == "tiny"
            assert client.get("/metrics").status_code == 401
            assert client.get("/metrics", headers=bearer(KEY)).status_code == 404  # served on its own port
        metrics = httpx.get(f"http://127.0.0.1:{metrics_port}/metrics", timeout=WAIT_S)
        assert metrics.status_code == 200 and "pdrouter_requests_total" in metrics.text
        assert router.grpc_address is not None
        assert asyncio.run(_list_models(router.grpc_address, None)) == grpc.StatusCode.UNAUTHENTICATED
        assert asyncio.run(_list_models(router.grpc_address, OTHER_KEY)) == grpc.StatusCode.OK
        assert asyncio.run(check_health(router.grpc_address))
        output = "\n".join(router.tail)
    assert KEY not in output and OTHER_KEY not in output and "API keys: 2" in output
    assert KEY not in " ".join(router.args)


async def _list_models(address: str, key: str | None) -> grpc.StatusCode:
    async with grpc.aio.insecure_channel(address) as channel:
        metadata = () if key is None else (("authorization", f"Bearer {key}"),)
        try:
            await router_pb2_grpc.RouterStub(channel).ListModels(router_pb2.ListModelsRequest(), metadata=metadata,
                                                                 timeout=WAIT_S)
        except grpc.aio.AioRpcError as exc:
            return exc.code()
        return grpc.StatusCode.OK


@pytest.mark.parametrize(("host", "keys", "warned"), [
    ("0.0.0.0", ApiKeys(), True), ("0.0.0.0", ApiKeys([KEY]), False), ("127.0.0.1", ApiKeys(), False)])
async def test_open_doors_on_a_public_host_are_a_warning(model_folder: Path, caplog: pytest.LogCaptureFixture,
                                                         host: str, keys: ApiKeys, warned: bool) -> None:
    router = RouterProcess(RouterConfig(model_dir=model_folder, static_workers=("127.0.0.1:1",), host=host,
                                        http_port=0, grpc_port=0, api_keys=keys))
    with caplog.at_level(logging.WARNING, logger="pdrouter.router.server"):
        await router.start()
        await router.stop(grace=0.5)
    warnings = [r.getMessage() for r in caplog.records if "front doors" in r.getMessage()]
    assert len(warnings) == (1 if warned else 0), warnings
    if warned:
        assert warnings[0].startswith("no API keys: the HTTP and gRPC front doors on 0.0.0.0 are open")
