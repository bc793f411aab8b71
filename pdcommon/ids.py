"""Typed identifiers shared by every component."""

from __future__ import annotations

import uuid
from typing import NewType

WorkerId = NewType("WorkerId", str)
"""A worker's stable name in the registry, e.g. ``prefill-0``."""

RequestId = NewType("RequestId", str)
"""One inference request, end to end (router, prefill and decode legs share it)."""

BlockHash = NewType("BlockHash", bytes)
"""A chained 16-byte hash of one full KV block and everything before it."""

Epoch = NewType("Epoch", int)
"""A worker process incarnation; a restart takes a new, larger epoch."""


def new_request_id() -> RequestId:
    """A fresh, globally unique request id (``req-`` + 32 hex digits)."""
    return RequestId(f"req-{uuid.uuid4().hex}")
