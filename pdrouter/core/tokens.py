"""What a token stream carries, from a worker through the router to a front door.

A stream is a sequence of ``TokenDelta``: new token ids, and on the last one the reason it ended
and the request's ``Usage``. The wire layer turns worker messages into these; the front doors
turn them into their protocol's chunks.
"""

from __future__ import annotations

import enum
import struct
import sys
from array import array
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import overload

from pdrouter.core.errors import InvalidRequestError

if array("I").itemsize != 4:  # pragma: no cover - every platform CPython supports has a 32-bit C int
    raise ImportError("pdrouter packs token ids as 32-bit C unsigned ints; this platform's are not 4 bytes")
_SWAP = sys.byteorder != "little"


class PackedPrompt(Sequence[int]):
    """Token ids kept as ``pack_token_ids`` bytes (``packed``, with the largest id, ``largest``) until
    something reads them one by one: unpacked then, once; a slice unpacks only its own ids. The
    router needs a prompt's length and its packed form (for the block hashes and the workers), not
    its ids; a worker checks it against its vocabulary (``largest``), hashes its blocks and sends it
    on from these, and a simulated step needs only counts. A prompt's thousands of ints made, walked
    by the collector and freed again were a large share of their work a request
    (``docs/benchmarks.md``). Compares equal to the tuple of its ids, and hashes like it."""

    __slots__ = ("_ids", "largest", "packed")

    def __init__(self, packed: bytes, largest: int) -> None:
        if len(packed) % 4:
            raise ValueError(f"packed token ids are 4 bytes each: got {len(packed)} bytes")
        self.packed = packed
        self.largest = largest
        self._ids: tuple[int, ...] | None = None

    def ids(self) -> tuple[int, ...]:
        """The ids as a tuple (unpacked at the first call)."""
        ids = self._ids
        if ids is None:
            ids = self._ids = struct.unpack(f"<{len(self.packed) >> 2}I", self.packed)
        return ids

    def __len__(self) -> int:
        return len(self.packed) >> 2

    @overload
    def __getitem__(self, index: int) -> int: ...

    @overload
    def __getitem__(self, index: slice) -> tuple[int, ...]: ...

    def __getitem__(self, index: int | slice) -> int | tuple[int, ...]:
        ids = self._ids
        if ids is None and type(index) is slice and index.step is None:
            start, stop, _ = index.indices(len(self.packed) >> 2)
            return struct.unpack_from(f"<{stop - start}I", self.packed, 4 * start) if stop > start else ()
        return (self.ids() if ids is None else ids)[index]

    def __iter__(self) -> Iterator[int]:
        return iter(self.ids())

    def __eq__(self, other: object) -> bool:
        if isinstance(other, PackedPrompt):
            return self.packed == other.packed
        if isinstance(other, tuple):
            return self.ids() == other
        return NotImplemented

    def __hash__(self) -> int:
        return hash(self.ids())

    def __repr__(self) -> str:
        return f"PackedPrompt({len(self)} ids)"


def packed_byte_ids(data: bytes, first: int | None = None) -> PackedPrompt:
    """The ids of a byte-level tokenizer, packed as ``pack_token_ids`` packs them: ``first`` (its BOS,
    when given), then each byte of ``data`` as its own id. Each byte goes into the low byte of its
    4-byte slot with one strided copy, where packing a list of ids converts them one by one."""
    head = () if first is None else (first,)
    packed = bytearray(4 * (len(head) + len(data)))
    packed[:4 * len(head)] = pack_token_ids(head)
    packed[4 * len(head)::4] = data
    return PackedPrompt(bytes(packed), max(-1, *head, _largest_byte(data)))


def _largest_byte(data: bytes) -> int:
    """The largest byte of ``data`` (-1 when empty): looked for from the top, one ``memchr`` a value,
    a few for text (``max`` would make an int of every byte); at worst 256 scans of ``data``."""
    if not data:
        return -1
    for value in range(127 if data.isascii() else 255, -1, -1):
        if value in data:
            return value
    raise AssertionError("unreachable: a non-empty bytes holds some value")  # pragma: no cover


def pack_token_ids(ids: Sequence[int]) -> bytes:
    """``ids`` as little-endian uint32s, 4 bytes each: how the worker protocol's ``prompt_token_bytes``
    and the chained block hashes take a prompt. InvalidRequestError when an id is not an integer in
    [0, 2^32)."""
    if type(ids) is PackedPrompt:
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


class TokenSink:
    """A streamed request's shortcut for its token chunks, from the worker's connection to the client's.

    A front door that writes each chunk of a stream as it comes (an HTTP door's SSE response) sets
    ``deliver`` once its consumer has taken the stream's first delta, and ``flush``. The worker call's
    reader then offers ``deliver`` each chunk of plain tokens (no finish, no report) that arrives while
    the consumer waits with nothing queued, so that the chain of iterators between the two is not
    woken once a token; ``deliver`` says whether it takes the chunk (False changes nothing: e.g. the
    client's connection cannot take a write now). After the chunks that came in one read (those the
    stream would have merged into one delta), the reader calls ``flush``: the consumer's own work for
    them as one delta (its text, its metrics, its write). Neither may raise; what ``flush`` could not do
    it keeps in ``error``, which the stream raises to its consumer. ``deliver`` None: every chunk goes
    by the stream."""

    __slots__ = ("deliver", "error", "flush")

    def __init__(self) -> None:
        self.deliver: Callable[[tuple[int, ...]], bool] | None = None
        self.flush: Callable[[], None] | None = None
        self.error: BaseException | None = None
