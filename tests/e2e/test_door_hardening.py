"""Both front doors of a real router process under hostile clients. HTTP: requests decided on
their head before any body byte is held, bodies of aborted requests freed at once, a malformed
``Content-Length`` and a wrong ``Content-Type`` answered cleanly, and a budget of unauthenticated
connections that keyed clients never run into. gRPC: calls without a key refused before their
message is read, however large or slow, and handshakes held to their deadline.

The router runs as ``pdrouter router`` with an API key and no workers (what is probed here happens
before any request reaches a worker); its memory is read from ``/proc`` through psutil. Assertions
are on outcomes (status codes, what the router still holds), never on how long something took.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import secrets
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path

import psutil
import pytest

from pdrouter.cli.local_cluster import ManagedProcess
from pdrouter.router.frontdoor.auth import ENV_VAR
from pdrouter.testing.grpc_probe import probe

KEY = secrets.token_urlsafe(24)
WAIT_S = 30.0  # hang guard, not a latency bound
MiB = 1 << 20
BODY_BYTES = 12 * MiB
"""An aborted or refused body's size, as the probes that found the leak sent them."""


class Door:
    """A ``pdrouter router`` process: its HTTP port, its memory, its output."""

    def __init__(self, proc: ManagedProcess) -> None:
        self.proc = proc
        address = proc.wait_ready()
        self.port = int(address.rpartition(":")[2])
        assert proc.grpc_address is not None
        self.grpc_port = int(proc.grpc_address.rpartition(":")[2])
        self.process = psutil.Process(proc.proc.pid)

    def rss(self) -> int:
        return int(self.process.memory_info().rss)

    def output(self) -> str:
        return "\n".join(self.proc.tail)


@pytest.fixture
def start_door(tiny_model: Path, redis_url: str) -> Iterator[Callable[..., Door]]:
    procs: list[ManagedProcess] = []

    def start(*flags: str) -> Door:
        proc = ManagedProcess("router", ["router", "--model", str(tiny_model), "--redis", redis_url,
                                         "--http-port", "0", "--grpc-port", "0", "--log-level", "WARNING",
                                         *flags], env={ENV_VAR: KEY})
        procs.append(proc)
        return Door(proc)

    yield start
    for proc in procs:
        proc.stop()


def head(path: str = "/v1/completions", *, length: int, key: str | None = None,
         content_type: str | None = "application/json", extra: str = "") -> bytes:
    lines = [f"POST {path} HTTP/1.1", "host: router", f"content-length: {length}"]
    if key is not None:
        lines.append(f"authorization: Bearer {key}")
    if content_type is not None:
        lines.append(f"content-type: {content_type}")
    return ("\r\n".join(lines) + "\r\n" + extra + "\r\n").encode()


async def read_answer(reader: asyncio.StreamReader) -> tuple[int, dict[str, str], bytes]:
    raw = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), WAIT_S)
    status_line, *lines = raw.decode("latin-1").rstrip("\r\n").split("\r\n")
    headers = {name.lower(): value for name, _, value in (line.partition(": ") for line in lines)}
    body = await asyncio.wait_for(reader.readexactly(int(headers.get("content-length", "0"))), WAIT_S)
    return int(status_line.split(" ")[1]), headers, body


@contextlib.asynccontextmanager
async def connection(port: int) -> AsyncIterator[tuple[asyncio.StreamReader, asyncio.StreamWriter]]:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        yield reader, writer
    finally:
        writer.close()
        with contextlib.suppress(OSError):
            await writer.wait_closed()


async def settle(door: Door, baseline: int) -> int:
    """The router's memory growth over ``baseline`` once it has had a moment to free what it frees."""
    growth = door.rss() - baseline
    for _ in range(20):
        await asyncio.sleep(0.1)
        growth = min(growth, door.rss() - baseline)
    return growth


async def test_a_request_without_a_key_is_refused_on_its_head(start_door: Callable[..., Door]) -> None:
    """The 401 comes before the body: the client has sent its head and a first piece of a 12 MiB
    body, and gets its answer without sending the rest (the body deadline is far away)."""
    door = start_door("--http-body-timeout", "300")
    for key in (None, "w" * 32):
        async with connection(door.port) as (reader, writer):
            writer.write(head(length=BODY_BYTES, key=key) + b"x" * 65536)
            await writer.drain()
            status, headers, body = await read_answer(reader)
            assert status == 401 and headers["www-authenticate"] == "Bearer"
            assert json.loads(body)["error"]["code"] == "invalid_api_key"
            assert headers["connection"] == "close"


async def test_bodies_without_a_key_are_never_held(start_door: Callable[..., Door]) -> None:
    """Ten clients without a key each push a whole 12 MiB body at once: the router holds none of them."""
    door = start_door()
    baseline = door.rss()

    async def push() -> int | None:
        """The answer's status; None when the connection was reset before the client read it (it kept
        sending past the second the router drains a refused connection for, on a loaded machine)."""
        async with connection(door.port) as (reader, writer):
            answer = asyncio.ensure_future(read_answer(reader))  # read while sending, as HTTP clients do
            writer.write(head(length=BODY_BYTES))
            sent = 0
            with contextlib.suppress(ConnectionError):
                while sent < BODY_BYTES and not answer.done():
                    writer.write(b"x" * MiB)
                    sent += MiB
                    await writer.drain()
            try:
                status, _, _ = await answer
            except ConnectionError:
                return None
            return status

    statuses = await asyncio.gather(*(push() for _ in range(10)))
    assert set(statuses) <= {401, None} and 401 in statuses, statuses
    assert await settle(door, baseline) < 40 * MiB


async def test_aborted_bodies_are_freed_at_once(start_door: Callable[..., Door]) -> None:
    """Keyed clients send 12 MiB of a 16 MiB body and hang up, ten at a time, three rounds: each
    body is freed as its connection goes (it used to stay until a full collection of the heap)."""
    door = start_door()
    baseline = door.rss()
    for _ in range(3):
        writers = []
        for _ in range(10):
            _, writer = await asyncio.open_connection("127.0.0.1", door.port)
            writer.write(head(length=16 * MiB, key=KEY) + b"x" * BODY_BYTES)
            writers.append(writer)
        for writer in writers:
            await writer.drain()
        await asyncio.sleep(0.5)  # the router reads what came
        for writer in writers:
            writer.transport.abort()
    assert await settle(door, baseline) < 40 * MiB
    assert "Traceback" not in door.output()


async def test_a_content_length_of_5000_digits_gets_a_clean_400(start_door: Callable[..., Door]) -> None:
    door = start_door()
    for key in (None, KEY):
        async with connection(door.port) as (reader, writer):
            writer.write(b"POST /v1/completions HTTP/1.1\r\nhost: router\r\n"
                         + (b"" if key is None else f"authorization: Bearer {key}\r\n".encode())
                         + b"content-length: " + b"9" * 5000 + b"\r\n\r\n")
            status, _, _ = await read_answer(reader)
            assert status == 400
    assert "Traceback" not in door.output()


async def test_generation_bodies_must_be_json(start_door: Callable[..., Door]) -> None:
    door = start_door()
    body = json.dumps({"model": "tiny", "prompt": "hi", "max_tokens": 1}).encode()
    for content_type in ("text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x"):
        async with connection(door.port) as (reader, writer):
            writer.write(head(length=len(body), key=KEY, content_type=content_type) + body)
            status, headers, answer = await read_answer(reader)
            assert status == 415, content_type
            error = json.loads(answer)["error"]
            assert error["code"] == "unsupported_media_type" and "application/json" in error["message"]
            assert headers["content-type"] == "application/json"
    async with connection(door.port) as (reader, writer):  # without a key, the key is what is missing
        writer.write(head(length=len(body), content_type="text/plain") + body)
        assert (await read_answer(reader))[0] == 401


async def test_unauthenticated_connections_cannot_lock_keyed_clients_out(
        start_door: Callable[..., Door]) -> None:
    """More idle connections without a key than the door's connection cap: a keyed client that was
    already connected keeps its connection, and one that connects now still gets in."""
    door = start_door("--http-max-connections", "32", "--http-header-timeout", "120")
    models = b"GET /v1/models HTTP/1.1\r\nhost: router\r\nauthorization: Bearer " + KEY.encode() + b"\r\n\r\n"
    async with connection(door.port) as (kept_reader, kept_writer):
        kept_writer.write(models)
        assert (await read_answer(kept_reader))[0] == 200
        idle = [await asyncio.open_connection("127.0.0.1", door.port) for _ in range(48)]
        try:
            for _, writer in idle:
                writer.write(b"GET /v1/mod")  # a head begun, never finished
            await asyncio.sleep(0.5)
            kept_writer.write(models)
            assert (await read_answer(kept_reader))[0] == 200
            async with connection(door.port) as (reader, writer):
                writer.write(models)
                assert (await read_answer(reader))[0] == 200
        finally:
            for _, writer in idle:
                writer.close()


@pytest.mark.parametrize("server", ["builtin", "grpcio"])
async def test_grpc_calls_without_a_key_are_refused_before_their_message(start_door: Callable[..., Door],
                                                                         server: str) -> None:
    """Calls announcing 60 MiB, sent as fast as flow control lets them or a byte every half second,
    without a key or with a wrong one: each is refused UNAUTHENTICATED with most of its message
    unsent, and the router holds nothing of them (on either of the door's servers)."""
    door = start_door("--grpc-server", server)
    baseline = door.rss()
    probes = [probe("127.0.0.1", door.grpc_port, kind, metadata=metadata, wait_s=WAIT_S)
              for kind in ("huge", "slow") for metadata in ((), (("authorization", "Bearer " + "w" * 32),))
              for _ in range(2)]
    for result in await asyncio.gather(*probes):
        assert (result.outcome, result.status) == ("ended", 16), result
        assert result.sent < 8 * MiB
    assert await settle(door, baseline) < 40 * MiB


async def test_grpc_handshakes_have_a_deadline(start_door: Callable[..., Door]) -> None:
    """A connection that never finishes its HTTP/2 preface, silent or trickling it, is closed at the
    handshake deadline (grpc's own default would hold it two minutes)."""
    door = start_door()
    silent, trickled = await asyncio.gather(
        probe("127.0.0.1", door.grpc_port, "silent", wait_s=WAIT_S),
        probe("127.0.0.1", door.grpc_port, "slow-preface", trickle_s=0.2, wait_s=WAIT_S))
    assert (silent.outcome, trickled.outcome) == ("closed", "closed")
