"""The floor of a Python HTTP router: a request relayed to a worker and its answer relayed back, nothing else.

``router_peers.py`` measures it beside the routers (system ``python-relay``) to show what a router
written in Python costs here before it does any routing work: it reads a ``POST`` (HTTP/1.1,
keep-alive, parsed by ``httptools``, the parser pd-router's HTTP door uses), writes the body
unchanged to a worker over a kept-open connection, reads the worker's answer the same way and
writes it back, on uvloop when installed (the loop pd-router runs on). It does not parse the JSON,
tokenize, hash, look anything up, admit, or rewrite the answer. One pool (``--workers``): the
workers in turn. PD (``--prefill`` and ``--decode``): each request goes to a prefill worker first
(with vLLM's ``kv_transfer_params.do_remote_decode`` spliced into the body as bytes, the one
change it makes), then, once that answered, to a decode worker, whose answer is relayed: the two
hops of a vLLM-style PD router, without reading either answer.

    python benchmarks/_python_relay.py --port N (--workers URL ... | --prefill URL ... --decode URL ...)
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
from collections import deque
from typing import cast
from urllib.parse import urlsplit

import httptools
from _instant_worker import serve_until_stopped

from pdrouter.core.aio import event_loop_factory

_REMOTE_DECODE = b'"kv_transfer_params":{"do_remote_decode":true},'


class Upstream(asyncio.Protocol):
    """One kept-open connection to a worker: one request at a time, its answer's status and body."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self._parser = httptools.HttpResponseParser(self)
        self._body: list[bytes] = []
        self._waiter: asyncio.Future[tuple[int, bytes]] | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's is not asyncio's class

    def data_received(self, data: bytes) -> None:
        self._parser.feed_data(data)

    def on_body(self, body: bytes) -> None:
        self._body.append(body)

    def on_message_complete(self) -> None:
        body, self._body = b"".join(self._body), []
        waiter, self._waiter = self._waiter, None
        if waiter is not None and not waiter.done():
            waiter.set_result((self._parser.get_status_code(), body))

    def connection_lost(self, exc: Exception | None) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_exception(ConnectionError("the worker closed the connection"))

    def send(self, head: bytes, body: bytes) -> asyncio.Future[tuple[int, bytes]]:
        assert self.transport is not None
        self._waiter = asyncio.get_running_loop().create_future()
        self.transport.write(head + str(len(body)).encode() + b"\r\n\r\n" + body)
        return self._waiter


class Pool:
    """Kept-open connections to the workers of one role, taken in turn."""

    def __init__(self, urls: list[str]) -> None:
        self.addresses = [(u.hostname or "127.0.0.1", u.port or 80) for u in map(urlsplit, urls)]
        self._turn = itertools.cycle(range(len(self.addresses)))
        self._idle: list[deque[Upstream]] = [deque() for _ in self.addresses]

    async def call(self, path: bytes, body: bytes) -> tuple[int, bytes]:
        i = next(self._turn)
        idle = self._idle[i]
        if idle:
            conn = idle.pop()
        else:
            host, port = self.addresses[i]
            _, conn = await asyncio.get_running_loop().create_connection(Upstream, host, port)
        head = (b"POST " + path + b" HTTP/1.1\r\nHost: w\r\nContent-Type: application/json\r\n"
                b"Content-Length: ")
        answer = await conn.send(head, body)
        idle.append(conn)
        return answer


class Downstream(asyncio.Protocol):
    """One client connection: requests relayed one at a time, in order."""

    def __init__(self, relay: Relay) -> None:
        self.relay = relay
        self.transport: asyncio.Transport | None = None
        self._parser = httptools.HttpRequestParser(self)
        self._url = b""
        self._body: list[bytes] = []
        self._tasks: set[asyncio.Future[None]] = set()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's is not asyncio's class

    def data_received(self, data: bytes) -> None:
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserError:
            assert self.transport is not None
            self.transport.close()

    def on_url(self, url: bytes) -> None:
        self._url = url

    def on_body(self, body: bytes) -> None:
        self._body.append(body)

    def on_message_complete(self) -> None:
        body, self._body = b"".join(self._body), []
        method = self._parser.get_method()
        task = asyncio.ensure_future(self._answer(method, self._url, body))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _answer(self, method: bytes, url: bytes, body: bytes) -> None:
        if method == b"POST":
            status, answer = await self.relay.forward(url, body)
        else:
            status, answer = 200, b'{"object":"list","data":[]}'
        assert self.transport is not None
        if not self.transport.is_closing():
            self.transport.write(b"HTTP/1.1 %d OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n"
                                 % (status, len(answer)) + answer)


class Relay:
    def __init__(self, workers: list[str], prefill: list[str], decode: list[str]) -> None:
        self.pool = Pool(workers) if workers else None
        self.prefill = Pool(prefill) if prefill else None
        self.decode = Pool(decode) if decode else None

    async def forward(self, path: bytes, body: bytes) -> tuple[int, bytes]:
        if self.pool is not None:
            return await self.pool.call(path, body)
        assert self.prefill is not None and self.decode is not None
        first = await self.prefill.call(path, b"{" + _REMOTE_DECODE + body[1:])
        if first[0] != 200:
            return first
        return await self.decode.call(path, body)


async def serve(args: argparse.Namespace) -> None:
    relay = Relay(args.workers, args.prefill, args.decode)
    await serve_until_stopped(lambda: Downstream(relay), args.port)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--workers", nargs="*", default=[], metavar="URL")
    parser.add_argument("--prefill", nargs="*", default=[], metavar="URL")
    parser.add_argument("--decode", nargs="*", default=[], metavar="URL")
    args = parser.parse_args()
    if not args.workers and not (args.prefill and args.decode):
        parser.error("give --workers, or --prefill and --decode")
    factory = event_loop_factory()
    with contextlib.suppress(KeyboardInterrupt):
        if factory is None:
            asyncio.run(serve(args))
        else:
            with asyncio.Runner(loop_factory=factory) as runner:
                runner.run(serve(args))


if __name__ == "__main__":
    main()
