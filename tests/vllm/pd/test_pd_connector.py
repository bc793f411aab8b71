"""pd-router's KV connector between two real vLLM engines, driven directly (no router): what it moves, and its faults.

Prefill → decode through the connector gives the colocated engine's greedy tokens, from transferred
KV: vLLM's own counters say the decode engine computed none of the prompt, and the bytes are the
prompt's blocks × the block's bytes. Faults land on the transfer's TCP stream through a relay in
front of the decode engine's receiver (a corrupted payload or header, a connection cut mid-message,
a stalled stream): the decode engine then computes the prompt itself and answers exactly the
colocated tokens, never from partial KV, and afterwards both engines hold no block (their prefix
caches reset, which vLLM refuses while any block is in use) and no side-channel link is open.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from vllm.sampling_params import RequestOutputKind

from pdrouter.core.errors import CancelledError, DeadlineExceededError
from pdrouter.transfer.errors import ChecksumError, PeerLostError
from pdrouter.transfer.vllm.host import LocalPrefill, Placement

from ...transfer.factories import FaultyProxy
from .conftest import BLOCK, PdPair, prompt_of, via

pytestmark = [pytest.mark.vllm, pytest.mark.asyncio(loop_scope="module")]

LENGTHS = [1, 2, 31, 127, 128, 129, 200, 255, 256, 257, 383, 384, 385, 511, 640, 777, 1000, 1023, 1024, 1025,
           1279, 1280, 1281, 1499, 1500]
"""On and off the 128-token block boundaries, 1 to 1,500 tokens."""
NEW_TOKENS = 8


def blocks(tokens: int) -> int:
    return -(-tokens // BLOCK)


async def test_pd_tokens_equal_colocated_and_come_from_transferred_kv(pd: PdPair) -> None:
    prompts = [prompt_of(n) for n in LENGTHS]
    references = [await pd.reference(p, NEW_TOKENS) for p in prompts]
    await pd.idle()  # the prefill engine computes every prompt afresh below
    computed, external = pd.decode.stats.computed, pd.decode.stats.external
    block_bytes = pd.decode.pool.block_bytes
    for index, (prompt, reference) in enumerate(zip(prompts, references, strict=True)):
        kind = RequestOutputKind.DELTA if index % 2 else RequestOutputKind.FINAL_ONLY
        result = await pd.generate(prompt, NEW_TOKENS, kind=kind)
        assert result.failure is None
        assert isinstance(result.placement, Placement) and result.placement.cached_tokens == 0
        assert result.tokens == reference, f"{len(prompt)} tokens"
        assert result.chunks > 1 if kind is RequestOutputKind.DELTA else result.chunks == 1  # streamed or not
        assert result.sent is not None and result.landed is not None
        assert result.landed.nbytes == result.sent.nbytes == blocks(len(prompt)) * block_bytes, f"{len(prompt)} tokens"
    # vLLM's own count of the decode engine's prompt tokens: from the transfer, but for at most one per
    # request computed there (the last one, whose logits give the first token).
    grew = pd.decode.stats.computed - computed
    assert grew <= len(LENGTHS)
    assert grew + pd.decode.stats.external - external == sum(LENGTHS)
    await pd.idle()


async def test_blocks_the_decode_engine_holds_are_not_sent(pd: PdPair) -> None:
    prompt = prompt_of(700, seed=1)
    reference = await pd.reference(prompt, NEW_TOKENS)
    await pd.idle()
    await pd.local(prompt[:3 * BLOCK + 5])  # the decode engine now holds the first three blocks
    result = await pd.generate(prompt, NEW_TOKENS)
    assert isinstance(result.placement, Placement)
    assert result.placement.cached_tokens == 3 * BLOCK
    assert result.tokens == reference
    assert result.landed is not None
    assert result.landed.nbytes == (blocks(700) - 3) * pd.decode.pool.block_bytes
    await pd.idle()


async def test_a_prompt_mostly_cached_on_the_decode_engine_is_computed_there(pd: PdPair) -> None:
    short = prompt_of(50, seed=2)
    prompt = prompt_of(500, seed=3)
    references = [await pd.reference(short, NEW_TOKENS), await pd.reference(prompt, NEW_TOKENS)]
    await pd.idle()
    await pd.local(prompt[:3 * BLOCK])
    computed = pd.decode.stats.computed
    results = [await pd.generate(p, NEW_TOKENS, local_prefill_tokens=BLOCK) for p in (short, prompt)]
    assert [r.tokens for r in results] == references
    assert [r.placement for r in results] == [LocalPrefill(0), LocalPrefill(3 * BLOCK)]
    assert all(r.sent is None and r.landed is None for r in results)
    assert pd.decode.stats.computed - computed == 50 + (500 - 3 * BLOCK)
    await pd.idle()



@pytest.fixture
def relays() -> Iterator[list[FaultyProxy]]:
    made: list[FaultyProxy] = []
    yield made
    for relay in made:
        relay.close()


def receiver_of(pd: PdPair) -> str:
    return pd.decode.pool.receivers[0]


@pytest.mark.parametrize(("fault", "error"), [
    ({"flip": (3, 4000)}, ChecksumError),   # a byte of the first DATA frame's payload
    ({"flip": (3, 60)}, ChecksumError),     # a byte of its header (past the length fields)
    ({"cut": (3, 4000)}, PeerLostError),    # the connection cut in the middle of it
], ids=["corrupted-payload", "corrupted-header", "cut-mid-message"])
async def test_a_broken_transfer_is_computed_on_the_decode_engine(pd: PdPair, relays: list[FaultyProxy],
                                                                   fault: dict[str, tuple[int, int]],
                                                                   error: type[Exception]) -> None:
    prompt = prompt_of(600, seed=11)
    reference = await pd.reference(prompt, NEW_TOKENS)
    await pd.idle()
    relays.append(relay := FaultyProxy(receiver_of(pd), **fault))
    computed = pd.decode.stats.computed
    result = await pd.generate(prompt, NEW_TOKENS, through=via(relay.address))
    assert relay.fired.is_set()
    assert isinstance(result.placement, Placement)
    assert isinstance(result.failure, error), result.failure
    assert result.send_failure is not None and result.sent is None
    assert result.tokens == reference
    assert pd.decode.stats.computed - computed == len(prompt)  # the decode engine computed it all
    await pd.idle()


async def test_a_stalled_transfer_ends_at_its_deadline_on_both_engines(pd: PdPair, relays: list[FaultyProxy]) -> None:
    prompt = prompt_of(600, seed=12)
    reference = await pd.reference(prompt, NEW_TOKENS)
    await pd.idle()
    relays.append(relay := FaultyProxy(receiver_of(pd), stall=(3, 4000)))
    result = await pd.generate(prompt, NEW_TOKENS, through=via(relay.address), kv_timeout_s=10.0, hold_s=10.0)
    assert relay.fired.is_set()
    assert isinstance(result.failure, DeadlineExceededError | CancelledError | PeerLostError), result.failure
    assert result.send_failure is not None and result.sent is None
    assert result.tokens == reference
    relay.close()  # the stalled connection goes; the prefill engine's blocks went at its deadline already
    await pd.idle()
