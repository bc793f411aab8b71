"""Prefill → decode through the connector gives the colocated engine's greedy tokens, from transferred KV."""

from __future__ import annotations

import pytest
from vllm.sampling_params import RequestOutputKind

from pdrouter.transfer.vllm.host import LocalPrefill, Placement

from .conftest import BLOCK, PdPair, prompt_of

pytestmark = [pytest.mark.vllm, pytest.mark.asyncio(loop_scope="session")]

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
        assert result.chunks == (NEW_TOKENS if kind is RequestOutputKind.DELTA else 1)
        assert result.sent is not None and result.landed is not None
        assert result.landed.nbytes == result.sent.nbytes == blocks(len(prompt)) * block_bytes, f"{len(prompt)} tokens"
    # vLLM's own count of the decode engine's prompt tokens: all from the transfer, at most one per
    # request computed there (the last one, whose logits give the first token).
    assert pd.decode.stats.computed - computed <= len(LENGTHS)
    assert pd.decode.stats.external - external == sum(LENGTHS)
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
