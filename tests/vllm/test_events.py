"""vLLM's KV events → the project's block hashes: both encodings, replay on connect and on a gap, a restarted publisher.

The map encoding is written by vLLM's own event classes (``vllm.distributed.kv_events``, vLLM
0.32); the positional one by structs declared as vLLM declared its events before (``array_like``,
tag first, fields in order). The subscriber tests run vLLM's own ZMQ publisher (its replay buffer
and sequence numbers), without an engine.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from pdrouter.core.hashing import BlockHasher
from pdrouter.engine.events import RecordingBlockEventSink
from pdrouter.engine.vllm.events import AllCleared, KvEventTranslator, RemovedBlocks, StoredBlocks, decode_batch
from pdrouter.engine.vllm.subscriber import KvEventSubscriber

from .conftest import wait_until

BS = 4


def tokens(n_blocks: int, start: int = 0) -> list[int]:
    return list(range(start, start + n_blocks * BS))


def map_batch(events: list[Any]) -> bytes:
    """A batch in vLLM 0.32's encoding (maps with a ``type`` tag), written by vLLM's own classes."""
    import msgspec
    from vllm.distributed.kv_events import KVEventBatch

    return msgspec.msgpack.Encoder().encode(KVEventBatch(ts=time.time(), events=events))


def stored(hashes: list[Any], parent: Any, toks: list[int], **kw: Any) -> Any:
    from vllm.distributed.kv_events import BlockStored

    return BlockStored(block_hashes=hashes, parent_block_hash=parent, token_ids=toks, block_size=BS,
                       lora_id=kw.pop("lora_id", None), medium=kw.pop("medium", "GPU"),
                       lora_name=kw.pop("lora_name", None), **kw)


def removed(hashes: list[Any], medium: str = "GPU") -> Any:
    from vllm.distributed.kv_events import BlockRemoved

    return BlockRemoved(block_hashes=hashes, medium=medium)


def array_batch(events: list[list[Any]]) -> bytes:
    """A batch in the positional encoding of earlier vLLM versions: ``[ts, [[tag, field, …], …]]``."""
    import msgspec

    class OldStored(msgspec.Struct, array_like=True, tag="BlockStored"):  # type: ignore[call-arg]
        block_hashes: list[int]
        parent_block_hash: int | None
        token_ids: list[int]
        block_size: int
        lora_id: int | None

    class OldRemoved(msgspec.Struct, array_like=True, tag="BlockRemoved"):  # type: ignore[call-arg]
        block_hashes: list[int]

    class OldCleared(msgspec.Struct, array_like=True, tag="AllBlocksCleared"):  # type: ignore[call-arg]
        pass

    kinds = {"stored": OldStored, "removed": OldRemoved, "cleared": OldCleared}
    built = [kinds[kind](*fields) for kind, *fields in events]
    return msgspec.msgpack.encode([time.time(), built])


def test_the_map_encoding_is_read() -> None:
    events, ts = decode_batch(map_batch([stored([b"h1", b"h2"], None, tokens(2)), removed([b"h1"]),
                                         stored([7], b"h2", tokens(1, 100))]))
    assert ts > 0
    assert events == [StoredBlocks((b"h1", b"h2"), None, tuple(tokens(2)), BS, True, "GPU"),
                      RemovedBlocks((b"h1",), "GPU"), StoredBlocks((7,), b"h2", tuple(tokens(1, 100)), BS, True, "GPU")]
    from vllm.distributed.kv_events import AllBlocksCleared

    assert decode_batch(map_batch([AllBlocksCleared()]))[0] == [AllCleared()]


def test_the_array_encoding_is_read() -> None:
    events, _ = decode_batch(array_batch([["stored", [11, 12], None, tokens(2), BS, None],
                                          ["removed", [11]], ["cleared"]]))
    assert events == [StoredBlocks((11, 12), None, tuple(tokens(2)), BS, True, None), RemovedBlocks((11,), None),
                      AllCleared()]


@pytest.mark.parametrize("encode", ["map", "array"])
def test_the_index_gets_the_projects_own_chained_hashes(encode: str) -> None:
    hasher = BlockHasher(BS, seed=0)
    sink = RecordingBlockEventSink()
    translator = KvEventTranslator(sink, hasher)
    first, second = tokens(2), tokens(1, 50)
    if encode == "map":
        payloads = [map_batch([stored([b"a", b"b"], None, first)]), map_batch([stored([b"c"], b"b", second)]),
                    map_batch([removed([b"c", b"zz"])])]
    else:
        payloads = [array_batch([["stored", [1, 2], None, first, BS, None]]),
                    array_batch([["stored", [3], 2, second, BS, None]]), array_batch([["removed", [3, 99]]])]
    for payload in payloads[:2]:
        translator.apply(decode_batch(payload)[0])
    want = hasher.hash_blocks(first + second)  # the router's hashes of the whole prefix
    assert sink.live == set(want) and translator.num_blocks == 3
    translator.apply(decode_batch(payloads[2])[0])  # the child is evicted; an unknown hash is ignored
    assert sink.live == set(want[:2])
    translator.clear()
    assert sink.live == set() and sink.events[-1] == ("removed", tuple(want[:2]))


def test_blocks_that_are_not_plain_token_blocks_are_not_indexed() -> None:
    sink = RecordingBlockEventSink()
    translator = KvEventTranslator(sink, BlockHasher(BS))
    translator.apply(decode_batch(map_batch([
        stored([b"l"], None, tokens(1), lora_id=3, lora_name="adapter"),   # a LoRA adapter's KV
        stored([b"s"], None, tokens(1, 9), extra_keys=[("salt",)]),          # salted / multimodal
        stored([b"o"], None, tokens(1, 20), medium="CPU"),                   # an offloading tier
        stored([b"orphan"], b"never-seen", tokens(1, 30)),                   # its parent is unknown
    ]))[0])
    assert sink.events == [] and translator.skipped_blocks == 4


@pytest.fixture
def endpoints(tmp_path: Path) -> tuple[str, str]:
    return f"ipc://{tmp_path}/events", f"ipc://{tmp_path}/replay"


@pytest.fixture
def publishers() -> Iterator[list[Any]]:
    made: list[Any] = []
    yield made
    for publisher in made:
        publisher.shutdown()


def publisher(endpoints: tuple[str, str], made: list[Any]) -> Any:
    from vllm.distributed.kv_events import ZmqEventPublisher

    pub = ZmqEventPublisher(data_parallel_rank=0, endpoint=endpoints[0], replay_endpoint=endpoints[1])
    made.append(pub)
    return pub


def publish(pub: Any, events: list[Any]) -> None:
    from vllm.distributed.kv_events import KVEventBatch

    pub.publish(KVEventBatch(ts=time.time(), events=events))


def test_a_late_subscriber_gets_the_earlier_batches_by_replay(endpoints: tuple[str, str],
                                                             publishers: list[Any]) -> None:
    pub = publisher(endpoints, publishers)
    hasher = BlockHasher(BS)
    publish(pub, [stored([b"a"], None, tokens(1))])
    publish(pub, [stored([b"b"], b"a", tokens(1, 4))])
    time.sleep(0.3)  # published before anyone subscribed: only the replay has them
    sink = RecordingBlockEventSink()
    sub = KvEventSubscriber(*endpoints, KvEventTranslator(sink, hasher), poll_ms=20)
    sub.start()
    try:
        wait_until(lambda: len(sink.live) == 2, "the replayed blocks indexed")
        publish(pub, [stored([b"c"], b"b", tokens(1, 8))])
        wait_until(lambda: len(sink.live) == 3, "a live batch indexed after the replay")
        assert sink.live == set(hasher.hash_blocks(tokens(3)))
        assert sub.batches == 3 and sub.replays == 1
    finally:
        sub.stop()


def test_a_restarted_publisher_starts_an_empty_cache(endpoints: tuple[str, str], publishers: list[Any]) -> None:
    hasher = BlockHasher(BS)
    sink = RecordingBlockEventSink()
    sub = KvEventSubscriber(*endpoints, KvEventTranslator(sink, hasher), poll_ms=20)
    pub = publisher(endpoints, publishers)
    sub.start()
    try:
        time.sleep(0.3)  # the subscription reaches the publisher
        for i in range(3):
            publish(pub, [stored([f"old{i}".encode()], None, tokens(1, 100 * i))])
        wait_until(lambda: len(sink.live) == 3, "the first engine's blocks indexed")
        pub.shutdown()
        publishers.remove(pub)
        time.sleep(0.2)
        restarted = publisher(endpoints, publishers)  # a new engine: its batches count from 0 again
        time.sleep(0.3)
        publish(restarted, [stored([b"new"], None, tokens(1, 7))])
        wait_until(lambda: sub.restarts == 1 and len(sink.live) == 1, "the old blocks forgotten, the new one indexed")
        assert sink.live == set(hasher.hash_blocks(tokens(1, 7)))
    finally:
        sub.stop()
