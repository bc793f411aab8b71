"""Helpers for the engine tests (a plain module: the top-level ``conftest`` name is taken)."""

from __future__ import annotations

import itertools
import random
from collections.abc import Callable

from pdrouter.core.ids import RequestId
from pdrouter.engine.batch_engine import BatchEngine
from pdrouter.engine.torch_engine import TorchEngine

EngineFactory = Callable[..., TorchEngine]
"""Builds torch engines (``make_engine``)."""
AnyEngineFactory = Callable[..., BatchEngine]
"""Builds the torch or the simulated engine (``make_any_engine``: the contract suite)."""

_ids = itertools.count()


def rid(prefix: str = "req") -> RequestId:
    """A fresh request id."""
    return RequestId(f"{prefix}-{next(_ids)}")


def random_prompt(rng: random.Random, length: int, vocab: int = 256) -> list[int]:
    """``length`` token ids drawn from the byte range (no specials, so no early eos)."""
    return [rng.randrange(vocab) for _ in range(length)]


def assert_no_leak(engine: BatchEngine) -> None:
    """Every block back in the pool, no request left, nothing in flight."""
    stats = engine.stats()
    assert stats.num_free_blocks == stats.num_blocks
    assert (stats.num_waiting, stats.num_running, stats.num_held, stats.num_awaiting_kv) == (0, 0, 0, 0)
    assert not engine.has_unfinished_requests()
    assert all(engine.block_manager.ref_count(b) == 0 for b in range(stats.num_blocks))
