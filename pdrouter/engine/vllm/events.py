"""vLLM's KV cache events, read in either of their encodings and translated into the project's block hashes.

vLLM publishes batches of ``BlockStored`` / ``BlockRemoved`` / ``AllBlocksCleared`` (msgpack, one
batch per ZMQ message; ``pdrouter.engine.vllm.subscriber`` receives them). A batch is always a
positional array ``[ts, events, dp_rank?]``; an event has been encoded two ways:

* **positional arrays** (vLLM up to late 2025): the tag first, then the fields in declaration
  order: ``["BlockStored", block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium…]``,
  ``["BlockRemoved", block_hashes, medium…]``, ``["AllBlocksCleared"]``;
* **maps** (vLLM 0.32, 2026): ``{"type": "BlockStored", "block_hashes": …, "parent_block_hash": …,
  "token_ids": …, "block_size": …, …}``, defaults left out.

Both are read (:func:`parse_event`); fields a version adds later are ignored, and an event type
this module does not know is skipped. vLLM's block hashes (ints or bytes, depending on the
version and its hash function) serve only as keys here: :class:`KvEventTranslator` recomputes the
project's own chained hashes (``pdrouter.core.hashing``) from each event's token ids and its
parent, and keeps a map from vLLM's hash to the project's for every block vLLM holds, which is
what ``BlockRemoved`` names. vLLM's hash is never reproduced, so a change of its hash function
(or of ``PYTHONHASHSEED``) changes nothing here.

Blocks whose content is more than their tokens (a LoRA adapter's, multimodal or salted ones:
``lora_id`` / ``lora_name`` / ``extra_keys`` set) and blocks of another tier than the engine's
own pool (``medium`` other than ``GPU``, e.g. an offloading tier) are not indexed: the router's
hashes are of plain token blocks in the worker's pool. Pure Python; ``msgspec`` (a vLLM
dependency) only in :func:`decode_batch`.
"""

from __future__ import annotations

import logging
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import Any

from pdrouter.core.hashing import BlockHasher
from pdrouter.core.ids import BlockHash
from pdrouter.engine.events import BlockEventSink

log = logging.getLogger(__name__)

ENGINE_MEDIUM = "GPU"
"""The ``medium`` vLLM gives blocks of the engine's own KV pool (on every platform, the CPU's included)."""


@dataclass(frozen=True, slots=True)
class StoredBlocks:
    """``BlockStored``: consecutive full blocks now cached, the first chained on ``parent``."""

    block_hashes: tuple[Hashable, ...]
    parent: Hashable | None
    token_ids: tuple[int, ...]
    block_size: int
    plain: bool = True
    """Their content is their tokens alone (no LoRA, multimodal or salt keys)."""
    medium: str | None = None


@dataclass(frozen=True, slots=True)
class RemovedBlocks:
    """``BlockRemoved``: these blocks were evicted."""

    block_hashes: tuple[Hashable, ...]
    medium: str | None = None


@dataclass(frozen=True, slots=True)
class AllCleared:
    """``AllBlocksCleared``: the engine dropped its whole prefix cache."""


KvEvent = StoredBlocks | RemovedBlocks | AllCleared

_STORED_FIELDS = ("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium", "lora_name",
                  "extra_keys")
"""``BlockStored``'s fields in their declaration order: the positions of the array encoding."""
_REMOVED_FIELDS = ("block_hashes", "medium")


def _key(value: Any) -> Hashable:
    return bytes(value) if isinstance(value, bytearray | memoryview) else value


def _tag(raw: Any) -> str | None:
    if isinstance(raw, dict):
        tag = raw.get("type")
    elif isinstance(raw, list | tuple) and raw:
        tag = raw[0]
    else:
        return None
    return tag if isinstance(tag, str) else None


def _fields(raw: Any, names: Sequence[str]) -> dict[str, Any]:
    """The fields of one event by name, from either encoding."""
    return raw if isinstance(raw, dict) else dict(zip(names, raw[1:], strict=False))


def parse_event(raw: Any) -> KvEvent | None:
    """One decoded event (a list or a dict, see the module docstring); None for a type not handled.

    ValueError (or KeyError / TypeError) for a known type whose fields are not what vLLM sends."""
    tag = _tag(raw)
    if tag == "BlockStored":
        f = _fields(raw, _STORED_FIELDS)
        parent = f.get("parent_block_hash")
        plain = not (f.get("lora_id") or f.get("lora_name") or any(f.get("extra_keys") or ()))
        return StoredBlocks(tuple(_key(h) for h in f["block_hashes"]), None if parent is None else _key(parent),
                            tuple(int(t) for t in f["token_ids"]), int(f["block_size"]), plain, f.get("medium"))
    if tag == "BlockRemoved":
        f = _fields(raw, _REMOVED_FIELDS)
        return RemovedBlocks(tuple(_key(h) for h in f["block_hashes"]), f.get("medium"))
    if tag == "AllBlocksCleared":
        return AllCleared()
    return None


def decode_batch(payload: bytes) -> tuple[list[KvEvent], float]:
    """The events of one published batch (msgpack ``[ts, [event, …], dp_rank?]``), in order, and its
    timestamp (the publisher's wall clock)."""
    import msgspec

    batch = msgspec.msgpack.decode(payload)
    if not isinstance(batch, list | tuple) or len(batch) < 2 or not isinstance(batch[1], list | tuple):
        raise ValueError(f"not a KV event batch: {type(batch).__name__}")
    out: list[KvEvent] = []
    for raw in batch[1]:
        event = parse_event(raw)
        if event is not None:
            out.append(event)
    return out, float(batch[0])


class KvEventTranslator:
    """Applies vLLM's KV events to a ``BlockEventSink`` in the project's block hashes.

    Keeps ``vLLM hash → project hash`` for every indexed block vLLM holds. A stored block whose
    parent is not known here (its event was lost, or it is not indexed) cannot be chained and is
    skipped, and so are its children: the index then misses a prefix the engine holds, which costs
    a hit, never a wrong answer (the engine matches exactly).
    """

    def __init__(self, sink: BlockEventSink, hasher: BlockHasher) -> None:
        self.sink = sink
        self.hasher = hasher
        self._ours: dict[Hashable, BlockHash] = {}
        self.skipped_blocks = 0
        """Stored blocks not indexed (unknown parent, other block size, LoRA/multimodal, other tier)."""

    @property
    def num_blocks(self) -> int:
        """Blocks indexed now."""
        return len(self._ours)

    def apply(self, events: Sequence[KvEvent]) -> None:
        for event in events:
            if isinstance(event, StoredBlocks):
                self._stored(event)
            elif isinstance(event, RemovedBlocks):
                self._removed(event)
            else:
                self.clear()

    def _stored(self, event: StoredBlocks) -> None:
        n = len(event.block_hashes)
        parent: BlockHash | None = None
        if event.parent is not None:
            parent = self._ours.get(event.parent)
        usable = (event.plain and event.medium in (None, ENGINE_MEDIUM) and event.block_size == self.hasher.block_size
                  and len(event.token_ids) == n * event.block_size and (event.parent is None or parent is not None))
        if not usable:
            self.skipped_blocks += n
            return
        hashes = self.hasher.hash_blocks(event.token_ids, parent)
        new: list[BlockHash] = []
        for theirs, ours in zip(event.block_hashes, hashes, strict=True):
            if theirs not in self._ours:
                self._ours[theirs] = ours
                new.append(ours)
        if new:
            self.sink.blocks_stored(new)

    def _removed(self, event: RemovedBlocks) -> None:
        if event.medium not in (None, ENGINE_MEDIUM):
            return
        gone = [ours for theirs in event.block_hashes if (ours := self._ours.pop(theirs, None)) is not None]
        if gone:
            self.sink.blocks_removed(gone)

    def clear(self) -> None:
        """Everything indexed is gone (``AllBlocksCleared``, or the engine restarted)."""
        if self._ours:
            gone = list(self._ours.values())
            self._ours.clear()
            self.sink.blocks_removed(gone)
