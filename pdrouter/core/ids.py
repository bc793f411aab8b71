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


class RequestIdSource:
    """Fresh, globally unique request ids (``req-`` + 32 hex digits) without a system call per id.

    The first 20 digits are random per source (``uuid4`` would read the kernel's random source for
    every id), the last 12 count its ids. A forked child draws a new random part, so parent and
    child never hand out the same id.
    """

    __slots__ = ("_counter", "_prefix")

    def __init__(self) -> None:
        self._prefix = ""
        self._counter = itertools.count()
        self.reseed()
        os.register_at_fork(after_in_child=self.reseed)

    def reseed(self) -> None:
        """80 new random bits, and the counter from 0."""
        self._prefix = os.urandom(10).hex()
        self._counter = itertools.count()

    def new(self) -> RequestId:
        return RequestId(f"req-{self._prefix}{next(self._counter) & 0xFFFFFFFFFFFF:012x}")


new_request_id = RequestIdSource().new
"""A fresh request id from this process's source (see :class:`RequestIdSource`)."""
