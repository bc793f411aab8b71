"""The router's HTTP server on a free loopback port, for tests and benchmarks of an HTTP door."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

import uvicorn

from pdrouter.router.frontdoor.http_server import bind_socket, make_server
from pdrouter.router.frontdoor.limits import HttpLimits


@contextlib.asynccontextmanager
async def serving(app: Any, stop_timeout_s: float = 10.0,
                  limits: HttpLimits | None = None) -> AsyncIterator[tuple[uvicorn.Server, int]]:
    """Serve the ASGI ``app`` (e.g. ``HttpFrontdoor.app``) as the router does, until the block ends
    (with ``limits``, or the defaults).

    Yields the server and its port; on exit the server stops gracefully (within ``stop_timeout_s``)
    and the socket is closed.
    """
    sock = bind_socket("127.0.0.1", 0)
    server = make_server(app, limits=limits)
    task = asyncio.create_task(server.serve(sockets=[sock]))
    try:
        while not server.started:
            assert not task.done(), "the server stopped before it started"
            await asyncio.sleep(0.01)
        yield server, sock.getsockname()[1]
    finally:
        server.should_exit = True
        await asyncio.wait_for(task, stop_timeout_s)
        sock.close()
