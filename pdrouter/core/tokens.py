"""What a token stream carries, from a worker through the router to a front door.

A stream is a sequence of ``TokenDelta``: new token ids, and on the last one the reason it ended
and the request's ``Usage``. The wire layer turns worker messages into these; the front doors
turn them into their protocol's chunks.
"""

from __future__ import annotations

import enum
import sys
from array import array
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from pdrouter.core.errors import InvalidRequestError

if array("I").itemsize != 4:  # pragma: no cover - every platform CPython supports has a 32-bit C int
    raise ImportError("pdrouter packs token ids as 32-bit C unsigned ints; this platform's are not 4 bytes")
_SWAP = sys.byteorder != "little"


class PackedTokenIds(tuple[int, ...]):
    """Token ids unpacked from ``pack_token_ids`` bytes (``unpack_token_ids``): a tuple of plain ints
    in [0, 2^32) by construction, which also keeps the bytes it came from (``packed``) and its largest
    id (``largest``, -1 when empty). A worker checks a prompt against its vocabulary, hashes its
    blocks and sends it on from these, with no pass over the ids in Python."""

    packed: bytes
    largest: int

    @classmethod
    def of(cls, ids: Iterable[int], packed: bytes, largest: int) -> PackedTokenIds:
        """``ids`` with the bytes ``pack_token_ids`` makes of them and their largest id (the caller's word)."""
        out = tuple.__new__(cls, ids)  # as ``cls(ids)``, without a Python-level call on the way
        out.packed = packed
        out.largest = largest
        return out


def pack_token_ids(ids: Sequence[int]) -> bytes:
    """``ids`` as little-endian uint32s, 4 bytes each: how the worker protocol's ``prompt_token_bytes``
    and the chained block hashes take a prompt. InvalidRequestError when an id is not an integer in
    [0, 2^32)."""
    if type(ids) is PackedTokenIds:
        return ids.packed
    try:
        packed = array("I", ids)
    except (OverflowError, TypeError) as exc:
        raise InvalidRequestError(f"token ids must be integers in [0, 2^32): {exc}") from None
    if _SWAP:  # pragma: no cover - big-endian hosts
        packed.byteswap()
    return packed.tobytes()


class FinishReason(enum.Enum):
    STOP = "stop"        # eos or a stop token / string
    LENGTH = "length"    # max_tokens or the context window
    ABORT = "abort"      # cancelled


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


@dataclass(slots=True)
class TokenDelta:
    """New tokens of a stream; the last delta has ``finish_reason`` and ``usage``.

    Built for every chunk a stream delivers, so a plain slotted dataclass (a frozen one sets each
    field through ``object.__setattr__``, three times the cost): treat it as a value.
    """

    token_ids: tuple[int, ...]
    finish_reason: FinishReason | None = None
    usage: Usage | None = None
