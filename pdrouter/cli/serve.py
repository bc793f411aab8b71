"""Run one long-lived component until SIGINT / SIGTERM, then stop it gracefully."""

from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
import gc
import logging
import os
import signal
from collections.abc import Callable
from typing import Protocol

from pdrouter.core.aio import run_on_event_loop


class Service(Protocol):
    async def start(self) -> None: ...

    async def stop(self) -> None: ...


def configure_logging(level: str) -> None:
    logging.basicConfig(level=level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")


_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # glibc mallopt parameters
MMAP_THRESHOLD = 1 << 20
TRIM_THRESHOLD = 8 << 20


def tune_allocator() -> bool:
    """Keep glibc from mapping and unmapping memory for every socket read; True if applied.

    asyncio receives each socket read into a fresh 256 KiB buffer and shrinks it to what arrived.
    At glibc's default (adaptive) thresholds such a buffer can come from ``mmap`` and go back with
    ``munmap``, with page faults in between, on every read (CPython issue #85451). With thousands
    of small reads a second that is a large share of the router's CPU. A fixed 1 MiB mmap threshold
    and an 8 MiB trim threshold keep these buffers on the heap (measured: about a third less router
    CPU per request at concurrency 1). Left alone when ``MALLOC_MMAP_THRESHOLD_`` is set, and on
    C libraries without ``mallopt``.
    """
    if "MALLOC_MMAP_THRESHOLD_" in os.environ:
        return False
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name) if name else None
        mallopt = getattr(libc, "mallopt", None)
    except OSError:
        return False
    if mallopt is None:
        return False
    return bool(mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD))


def freeze_startup_heap() -> int:
    """Take every object alive now out of the cyclic collector's way (``gc.freeze``); how many.

    After start-up a worker holds ~300k objects (torch, the model, grpc) and the router ~50k, all
    of them for the life of the process. A full collection walks every one: 70–80 ms in a worker
    on the reference machine, a stall of every request in flight, and a run of the router
    benchmarks saw one to three of them per worker (up to 220 ms each). Frozen, they are never
    walked again, and a full collection walks only what came after. vLLM and SGLang freeze their
    heap after start-up for the same reason.
    """
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


YOUNG_COLLECTION_THRESHOLD = 10_000
"""Net container allocations between two collections of the youngest generation (CPython: 700)."""


def space_young_collections() -> None:
    """Collect the youngest generation after 10,000 net container allocations instead of 700.

    A young collection walks every container allocated since the last one that is still alive: in
    a router or worker under load, mostly the objects of the requests in flight (coroutines,
    futures, prompts), which die within milliseconds by reference counting alone, and which a
    collection every few dozen requests walked again and again for almost nothing found (measured
    in ``docs/benchmarks.md``, "What CPython 3.11 does behind the router's code"). The older
    generations keep CPython's ratios, so a full collection comes as rarely relative to young
    ones as before.
    """
    _, older, oldest = gc.get_threshold()
    gc.set_threshold(YOUNG_COLLECTION_THRESHOLD, older, oldest)


def serve_until_signal(service: Service, ready_line: Callable[[], str]) -> None:
    """Start ``service``, print ``ready_line()`` (the line ``local_cluster`` waits for), stop on a signal."""
    tune_allocator()

    async def main() -> None:
        loop = asyncio.get_running_loop()
        stop = asyncio.Event()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        await service.start()
        freeze_startup_heap()
        space_young_collections()
        print(ready_line(), flush=True)
        await stop.wait()
        await service.stop()

    run_on_event_loop(main())
