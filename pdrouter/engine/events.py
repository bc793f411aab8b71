"""Block events: how the engine tells the outside world which prefix blocks it holds.

The block manager calls a :class:`BlockEventSink` synchronously, inside engine calls (under the
engine's lock, often from the step thread). A sink must therefore be quick and must not call back
into the engine: a Redis publisher should enqueue and publish from its own task or thread.

* ``blocks_stored(hashes)``: these chained block hashes became available for prefix reuse
  (their KV is complete in this worker's pool).
* ``blocks_removed(hashes)``: these hashes were evicted; their blocks now hold something else.

A hash is stored at most once until it is removed; every removed hash was stored before.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal, Protocol

from pdrouter.core.ids import BlockHash


class BlockEventSink(Protocol):
    """Receives prefix-cache membership changes (see the module docstring for the contract)."""

    def blocks_stored(self, hashes: Sequence[BlockHash]) -> None: ...

    def blocks_removed(self, hashes: Sequence[BlockHash]) -> None: ...


class NullBlockEventSink:
    """Drops every event (the default when nobody listens)."""

    def blocks_stored(self, hashes: Sequence[BlockHash]) -> None:
        return None

    def blocks_removed(self, hashes: Sequence[BlockHash]) -> None:
        return None


@dataclass
class RecordingBlockEventSink:
    """Keeps every event in order, and the set of hashes currently stored (for tests and debugging)."""

    events: list[tuple[Literal["stored", "removed"], tuple[BlockHash, ...]]] = field(default_factory=list)
    live: set[BlockHash] = field(default_factory=set)

    def blocks_stored(self, hashes: Sequence[BlockHash]) -> None:
        self.events.append(("stored", tuple(hashes)))
        self.live.update(hashes)

    def blocks_removed(self, hashes: Sequence[BlockHash]) -> None:
        self.events.append(("removed", tuple(hashes)))
        self.live.difference_update(hashes)
