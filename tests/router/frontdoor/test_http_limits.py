"""The HTTP doors' slow-client and overload limits (``pdrouter.router.frontdoor.limits.HttpLimits``), over real
sockets to the router's HTTP server on a free port: trickled heads and bodies closed at their
deadlines (file descriptors and buffers released), idle kept-alive connections closed, oversized
heads answered 431, connections and requests past their caps answered 503 with ``Retry-After``.

Deadlines are small so that the tests run fast; the assertions are on outcomes (what the client
read, what the server still holds), never on how long something took.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import json
import os
import weakref
from collections.abc import Mapping, MutableMapping
from typing import Any

import pytest
import uvicorn
import uvloop

from pdrouter.cli.limits_flags import add_http_limit_flags, http_limits_from_args
from pdrouter.core.errors import ConfigError
from pdrouter.router.frontdoor.http_cycle import Handler, Receive, RequestHead, Send
from pdrouter.router.frontdoor.http_server import OnDisconnect
from pdrouter.router.frontdoor.limits import HttpLimits
from pdrouter.testing import http as testing_http

WAIT_S = 30.0  # hang guard, not a latency bound


class App:
    """An ASGI application (served by uvicorn's cycle) with fast routes (served by the server's own
    cycle). Paths ending in ``slow`` wait for :attr:`release`; every answer is the body's length."""

    def __init__(self) -> None:
        self.release = asyncio.Event()
        self.started = 0
        self.finished = 0

    async def __call__(self, scope: MutableMapping[str, Any], receive: Receive, send: Send) -> None:
        assert scope["type"] == "http"
        body = b""
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            body += message.get("body", b"")
            if not message.get("more_body", False):
                break
        await self._answer(scope["path"], body, send)

    def fast_handlers(self, on_disconnect: OnDisconnect) -> Mapping[bytes, tuple[Handler, int]]:
        def handler(path: str) -> Handler:
            async def handle(receive: Receive, send: Send, head: RequestHead) -> None:
                message = await receive()
                await self._answer(path, message.get("body", b""), send)
            return handle

        return {b"/fast": (handler("/fast"), 16 << 20), b"/fast-slow": (handler("/fast-slow"), 16 << 20)}

    async def _answer(self, path: str, body: bytes, send: Send) -> None:
        self.started += 1
        if path.endswith("slow"):
            await self.release.wait()
        payload = b"%d" % len(body)
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"text/plain"), (b"content-length", b"%d" % len(payload))]})
        await send({"type": "http.response.body", "body": payload})
        self.finished += 1


def serving(app: Any, limits: HttpLimits) -> contextlib.AbstractAsyncContextManager[tuple[uvicorn.Server, int]]:
    return testing_http.serving(app, WAIT_S, limits)


def get(path: str = "/x", extra: bytes = b"") -> bytes:
    return b"GET %s HTTP/1.1\r\nhost: x\r\n%s\r\n" % (path.encode(), extra)


def post(path: str, body: bytes, extra: bytes = b"") -> bytes:
    return b"POST %s HTTP/1.1\r\nhost: x\r\n%scontent-length: %d\r\n\r\n%s" % (path.encode(), extra, len(body), body)


async def read_response(reader: asyncio.StreamReader) -> tuple[int, dict[str, str], bytes]:
    """One response with a ``content-length``: ``(status, headers, body)``."""
    head = await reader.readuntil(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = {}
    for line in lines[1:]:
        if line:
            name, _, value = line.partition(":")
            headers[name.strip().lower()] = value.strip()
    body = await reader.readexactly(int(headers.get("content-length", "0")))
    return int(lines[0].split()[1]), headers, body


async def until_closed(reader: asyncio.StreamReader) -> bytes:
    """Everything the server sends until it closes the connection."""
    got = b""
    with contextlib.suppress(ConnectionError):
        while chunk := await reader.read(65536):
            got += chunk
    return got


def parse(raw: bytes) -> tuple[int, dict[str, str], dict[str, Any]]:
    head, _, body = raw.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = {n.strip().lower(): v.strip() for n, _, v in (line.partition(":") for line in lines[1:])}
    return int(lines[0].split()[1]), headers, json.loads(body)


async def eventually(predicate: Any, timeout: float = WAIT_S) -> None:
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout
    while not predicate():
        assert loop.time() < end, "condition not met in time"
        await asyncio.sleep(0.02)


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def assert_error(raw: bytes, status: int, code: str, retry_after: bool = False) -> dict[str, Any]:
    got_status, headers, body = parse(raw)
    assert got_status == status, raw[:200]
    assert headers["connection"] == "close" and headers["content-type"] == "application/json"
    assert ("retry-after" in headers) is retry_after
    assert set(body["error"]) == {"message", "type", "param", "code"} and body["error"]["code"] == code
    return body["error"]


# -- deadlines ----------------------------------------------------------------------------------


async def trickle(port: int, first: bytes, more: bytes, every_s: float) -> bytes:
    """Send ``first``, then ``more`` every ``every_s`` until the server answers; what it sent before closing."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(first)
    got = b""
    try:
        while True:
            try:
                chunk = await asyncio.wait_for(reader.read(65536), every_s)
            except TimeoutError:
                if not got:
                    writer.write(more)
                continue
            if not chunk:
                return got
            got += chunk
    except ConnectionError:
        return got
    finally:
        writer.close()


async def test_trickled_heads_are_closed_at_the_header_deadline() -> None:
    limits = HttpLimits(header_timeout_s=0.5)
    async with asyncio.timeout(WAIT_S), serving(App(), limits) as (server, port):
        before = open_fds()
        answers = await asyncio.gather(*(trickle(port, b"GET /x HTTP/1.1\r\nhost: x\r\n", b"x-more: 1\r\n", 0.1)
                                         for _ in range(150)))
        assert len(answers) == 150
        for raw in answers:  # every one answered 408 and closed, although its bytes kept coming
            assert "--http-header-timeout" in assert_error(raw, 408, "request_timeout")["message"]
        await eventually(lambda: not server.server_state.connections)
        await eventually(lambda: open_fds() <= before)  # both ends' descriptors are gone


async def test_a_connection_that_sends_nothing_is_closed_at_the_header_deadline() -> None:
    async with asyncio.timeout(WAIT_S), serving(App(), HttpLimits(header_timeout_s=0.3)) as (server, port):
        readers = [await asyncio.open_connection("127.0.0.1", port) for _ in range(20)]
        # (Not waiting for the server to hold all 20 at once: on a loaded machine the first can reach
        # its deadline before the last is accepted.)
        for reader, writer in readers:
            assert await until_closed(reader) == b""  # closed without a word: there was no request
            writer.close()
        await eventually(lambda: not server.server_state.connections)


async def test_an_idle_kept_alive_connection_is_closed_at_the_idle_timeout() -> None:
    limits = HttpLimits(idle_timeout_s=0.3, header_timeout_s=60)
    async with asyncio.timeout(WAIT_S), serving(App(), limits) as (server, port):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        for request in (get(), post("/fast", b"abc")):  # uvicorn's cycle, then the server's own
            writer.write(request)
            status, headers, _ = await read_response(reader)
            assert status == 200 and headers.get("connection") != "close"
        assert await until_closed(reader) == b""  # the header deadline (60 s) is not what closed it
        writer.close()
        await eventually(lambda: not server.server_state.connections)


@pytest.mark.parametrize("path", ["/x", "/fast"])  # uvicorn's cycle reading the body, the server's own cycle
async def test_partial_large_bodies_are_dropped_at_the_body_deadline(path: str) -> None:
    limits = HttpLimits(body_timeout_s=0.5, body_min_rate_bps=64 << 20, header_timeout_s=60)
    app = App()
    async with asyncio.timeout(WAIT_S), serving(app, limits) as (server, port):
        head = b"POST %s HTTP/1.1\r\nhost: x\r\ncontent-length: 12000000\r\n\r\n" % path.encode()
        tasks = [asyncio.ensure_future(trickle(port, head + b"x" * (1 << 20), b"x" * 1024, 0.05)) for _ in range(10)]
        await eventually(lambda: len(server.server_state.connections) == 10 or all(t.done() for t in tasks))
        held = [weakref.ref(c) for c in server.server_state.connections]
        assert len(held) == 10
        answers = await asyncio.gather(*tasks)
        for raw in answers:
            error = assert_error(raw, 408, "request_timeout")
            assert "body" in error["message"]
        await eventually(lambda: not server.server_state.connections)
        gc.collect()
        assert [ref for ref in held if ref() is not None] == []  # nothing of the partial bodies is held
        assert app.finished == 0
        # A body that arrives in time is served.
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(post(path, b"y" * 100_000))
        status, _, body = await read_response(reader)
        assert (status, body) == (200, b"100000")
        writer.close()


async def test_a_body_that_keeps_the_minimum_rate_is_not_cut() -> None:
    """Past the body timeout, a body keeps going while it averages the minimum rate."""
    limits = HttpLimits(body_timeout_s=0.3, body_min_rate_bps=64 * 1024, header_timeout_s=60)
    async with asyncio.timeout(WAIT_S), serving(App(), limits) as (_, port):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        size = 256 * 1024
        writer.write(b"POST /fast HTTP/1.1\r\nhost: x\r\ncontent-length: %d\r\n\r\n" % size)
        for _ in range(8):  # ~320 KiB/s, 5x the minimum rate, for longer than the body timeout
            writer.write(b"z" * (size // 8))
            await asyncio.sleep(0.1)
        status, _, body = await read_response(reader)
        assert (status, body) == (200, b"%d" % size)
        writer.close()


# -- sizes and caps -----------------------------------------------------------------------------


@pytest.mark.parametrize("path", ["/x", "/fast"])
async def test_a_head_over_the_cap_is_answered_431(path: str) -> None:
    limits = HttpLimits(max_header_bytes=4096)
    async with asyncio.timeout(WAIT_S), serving(App(), limits) as (server, port):
        big = b"x-big: " + b"a" * 5000 + b"\r\n"
        for request in (post(path, b"{}", big), get(path, big)):  # whole in one read
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(request)
            assert_error(await until_closed(reader), 431, "request_header_fields_too_large")
            writer.close()
        # Trickled, the head never completing: answered once it outgrows the cap.
        raw = await trickle(port, b"GET %s HTTP/1.1\r\n" % path.encode(), b"x-h: " + b"b" * 500 + b"\r\n", 0.01)
        assert_error(raw, 431, "request_header_fields_too_large")
        # Just under the cap is fine.
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(post(path, b"{}", b"x-ok: " + b"c" * 3000 + b"\r\n"))
        assert (await read_response(reader))[0] == 200
        writer.close()
        await eventually(lambda: not server.server_state.connections or len(server.server_state.connections) <= 1)


async def test_connections_past_the_cap_get_503_with_retry_after() -> None:
    async with asyncio.timeout(WAIT_S), serving(App(), HttpLimits(max_connections=3)) as (server, port):
        kept = []
        for _ in range(3):
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(get())
            assert (await read_response(reader))[0] == 200
            kept.append((reader, writer))
        for _ in range(5):
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(post("/fast", b"x" * 100_000))
            error = assert_error(await until_closed(reader), 503, "overloaded", retry_after=True)
            assert "connections" in error["message"]
            writer.close()
        assert len(server.server_state.connections) == 3  # the refused ones were never served
        kept.pop()[1].close()
        await eventually(lambda: len(server.server_state.connections) == 2)
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(get())
        assert (await read_response(reader))[0] == 200
        writer.close()
        for _, w in kept:
            w.close()


async def test_requests_past_the_inflight_cap_get_503_while_the_first_complete() -> None:
    app = App()
    async with asyncio.timeout(WAIT_S), serving(app, HttpLimits(max_inflight=2)) as (server, port):
        first = []
        for request in (get("/slow"), post("/fast-slow", b"abc")):
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(request)
            first.append((reader, writer))
        await eventually(lambda: app.started == 2)
        for request in (get("/x"), post("/fast", b"abc"), post("/x", b"abc")):
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(request)
            error = assert_error(await until_closed(reader), 503, "overloaded", retry_after=True)
            assert "requests at once" in error["message"]
            writer.close()
        reader, writer = await asyncio.open_connection("127.0.0.1", port)  # liveness probes are not refused
        writer.write(get("/health"))
        assert (await read_response(reader))[0] == 200
        writer.close()
        app.release.set()
        for (reader, writer), length in zip(first, (b"0", b"3"), strict=True):  # the first two complete
            status, _, body = await read_response(reader)
            assert (status, body) == (200, length)
            writer.write(get())  # and their connections go on
            assert (await read_response(reader))[0] == 200
            writer.close()
        await eventually(lambda: not server.server_state.connections)
        reader, writer = await asyncio.open_connection("127.0.0.1", port)  # every slot is free again
        for _ in range(3):
            writer.write(post("/fast", b"abc"))
            assert (await read_response(reader))[0] == 200
        writer.close()


def test_the_limits_on_uvloop() -> None:
    """The router runs on uvloop (``pdrouter.cli.serve``): its transports half-close and read alike."""
    async def on_uvloop() -> str:
        return type(asyncio.get_running_loop()).__module__

    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        assert runner.run(on_uvloop()) == "uvloop"
        runner.run(test_trickled_heads_are_closed_at_the_header_deadline())
        runner.run(test_an_idle_kept_alive_connection_is_closed_at_the_idle_timeout())
        runner.run(test_partial_large_bodies_are_dropped_at_the_body_deadline("/fast"))
        runner.run(test_a_head_over_the_cap_is_answered_431("/x"))
        runner.run(test_connections_past_the_cap_get_503_with_retry_after())
        runner.run(test_requests_past_the_inflight_cap_get_503_while_the_first_complete())


# -- configuration ------------------------------------------------------------------------------


def test_flags_build_the_limits_and_refuse_bad_values_in_one_line() -> None:
    parser = argparse.ArgumentParser()
    add_http_limit_flags(parser)
    assert http_limits_from_args(parser.parse_args([])) == HttpLimits()
    args = parser.parse_args(["--http-header-timeout", "2", "--http-body-timeout", "7.5", "--http-idle-timeout",
                              "1", "--http-max-header-bytes", "8192", "--http-max-connections", "10",
                              "--http-max-inflight", "4", "--http-body-min-rate", "1000"])
    assert http_limits_from_args(args) == HttpLimits(header_timeout_s=2, body_timeout_s=7.5, idle_timeout_s=1,
                                                     max_header_bytes=8192, max_connections=10, max_inflight=4,
                                                     body_min_rate_bps=1000)
    for flag, value in (("--http-header-timeout", "0"), ("--http-max-connections", "-1"),
                        ("--http-max-header-bytes", "10"), ("--http-idle-timeout", "nan"),
                        ("--http-max-unauthenticated-connections", "0"),
                        ("--http-max-unauthenticated-connections", "5000")):
        with pytest.raises(ConfigError) as info:
            http_limits_from_args(parser.parse_args([flag, value]))
        assert flag in info.value.message and "\n" not in info.value.message
    # The budget of unauthenticated connections: half the cap unless given, never above it.
    assert HttpLimits(max_connections=10).max_unauthenticated_connections == 5
    budget = http_limits_from_args(parser.parse_args(["--http-max-connections", "10",
                                                      "--http-max-unauthenticated-connections", "3"]))
    assert budget.max_unauthenticated_connections == 3
