"""Typed identifiers shared by every component."""

from __future__ import annotations

import os
from collections import deque
from typing import NewType

WorkerId = NewType("WorkerId", str)
"""A worker's stable name in the registry, e.g. ``prefill-0``."""

RequestId = NewType("RequestId", str)
"""One inference request, end to end (router, prefill and decode legs share it). Always made by the
router (:func:`new_request_id`); what a client calls its request is a label beside it, never this."""

BlockHash = NewType("BlockHash", bytes)
"""A chained 16-byte hash of one full KV block and everything before it."""

Epoch = NewType("Epoch", int)
"""A worker process incarnation; a restart takes a new, larger epoch."""


_ID_BATCH = 256
"""Ids drawn from the kernel at once (16 random bytes each)."""
_ids: deque[str] = deque()


def new_request_id() -> RequestId:
    """A fresh request id: ``req-`` + 32 hex digits, 128 bits from the kernel's random source.

    Workers key live requests by this id, and a client sees its own (``x-request-id``, the response
    ids). Each one is 16 bytes of its own from ``os.urandom``, so knowing any number of them tells
    nothing of the next: no client can name another's request. The bytes are drawn for 256 ids at
    a time (one system call instead of one an id); a forked child drops what its parent had drawn.
    Safe from any thread: ``popleft`` and ``extend`` are atomic, and two threads that both find the
    batch empty draw two batches.
    """
    try:
        return RequestId(_ids.popleft())
    except IndexError:
        return RequestId(_draw())


def _draw() -> str:
    digits = os.urandom(16 * _ID_BATCH).hex()
    batch = ["req-" + digits[at:at + 32] for at in range(0, len(digits), 32)]
    first = batch.pop()
    _ids.extend(batch)
    return first


os.register_at_fork(after_in_child=_ids.clear)
