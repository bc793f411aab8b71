"""Typed identifiers shared by every component."""

from __future__ import annotations

import secrets
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


def new_request_id() -> RequestId:
    """A fresh request id: ``req-`` + 32 hex digits, 128 bits from the kernel's random source.

    Workers key live requests by this id, and a client sees its own (``x-request-id``, the response
    ids). Each one is drawn alone, so knowing any number of them tells nothing of the next: no
    client can name another's request. (About 1 µs an id, as much as the router spends on a
    few dictionary updates.)
    """
    return RequestId("req-" + secrets.token_hex(16))
