"""Fixtures for the KV transfer tests, and a check that every test ends with its threads and sockets closed."""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Iterator

import pytest

from pdrouter.core.kv_layout import KvLayout
from pdrouter.transfer import Backend

from .factories import Pair, make_layout, wait_until


@pytest.fixture
def make_pair() -> Iterator[Callable[..., Pair]]:
    pairs: list[Pair] = []

    def factory(layout: KvLayout | None = None, backend: Backend = Backend.TCP, seed: int = 0) -> Pair:
        pair = Pair(layout or make_layout(), backend, seed)
        pairs.append(pair)
        return pair

    yield factory
    for pair in pairs:
        pair.close()


def _socket_fds() -> set[str]:
    found = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            if os.readlink(f"/proc/self/fd/{fd}").startswith("socket:"):
                found.add(fd)
        except OSError:
            pass
    return found


@pytest.fixture(autouse=True)
def no_leaks() -> Iterator[None]:
    """Every thread and socket a test opens is closed by its end."""
    threads = set(threading.enumerate())
    sockets = _socket_fds()
    yield
    assert wait_until(lambda: not (set(threading.enumerate()) - threads), timeout=15), \
        f"threads left running: {set(threading.enumerate()) - threads}"
    assert wait_until(lambda: not (_socket_fds() - sockets), timeout=15), "sockets left open"
