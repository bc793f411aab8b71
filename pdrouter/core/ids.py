"""Typed identifiers shared by every component."""

from __future__ import annotations

import itertools
import os
from typing import NewType

WorkerId = NewType("WorkerId", str)
"""A worker's stable name in the registry, e.g. ``prefill-0``."""

RequestId = NewType("RequestId", str)
"""One inference request, end to end (router, prefill and decode legs share it)."""

BlockHash = NewType("BlockHash", bytes)
"""A chained 16-byte hash of one full KV block and everything before it."""

Epoch = NewType("Epoch", int)
"""A worker process incarnation; a restart takes a new, larger epoch."""


_id_prefix = ""
_id_counter = itertools.count()


def _new_id_prefix() -> None:
    """80 random bits per process (and again in a forked child), then a counter."""
    global _id_prefix, _id_counter
    _id_prefix = os.urandom(10).hex()
    _id_counter = itertools.count()


_new_id_prefix()
os.register_at_fork(after_in_child=_new_id_prefix)


def new_request_id() -> RequestId:
    """A fresh, globally unique request id (``req-`` + 32 hex digits).

    The first 20 digits are random per process, the last 12 count its requests: unique without a
    system call per id (``uuid4`` reads the kernel's random source for each one).
    """
    return RequestId(f"req-{_id_prefix}{next(_id_counter) & 0xFFFFFFFFFFFF:012x}")
