"""Run one long-lived component until SIGINT / SIGTERM, then stop it gracefully."""

from __future__ import annotations

import asyncio
import logging
import signal
from collections.abc import Callable
from typing import Protocol


class Service(Protocol):
    async def start(self) -> None: ...

    async def stop(self) -> None: ...


def configure_logging(level: str) -> None:
    logging.basicConfig(level=level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")


def serve_until_signal(service: Service, ready_line: Callable[[], str]) -> None:
    """Start ``service``, print ``ready_line()`` (the line ``local_cluster`` waits for), stop on a signal."""

    async def main() -> None:
        loop = asyncio.get_running_loop()
        stop = asyncio.Event()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        await service.start()
        print(ready_line(), flush=True)
        await stop.wait()
        await service.stop()

    asyncio.run(main())
