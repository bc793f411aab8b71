"""Faults on the transfer between two real vLLM engines: no stranded block, never an answer from partial KV.

Each fault lands on the transfer's TCP stream through a relay in front of the decode engine's
receiver. Afterwards both engines hold no block (their prefix caches reset, which vLLM refuses
while any block is in use) and no side-channel link is open; the decode engine computed the
prompt itself and answered exactly the colocated tokens.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Iterator

import pytest

from pdrouter.core.errors import CancelledError, DeadlineExceededError
from pdrouter.transfer.errors import ChecksumError, PeerLostError
from pdrouter.transfer.vllm.host import Placement

from ...transfer.factories import FaultyProxy
from .conftest import PdPair, prompt_of, via

pytestmark = [pytest.mark.vllm, pytest.mark.asyncio(loop_scope="session")]

NEW_TOKENS = 8


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


async def test_cancels_at_random_points_strand_nothing(pd: PdPair) -> None:
    rng = random.Random(7)
    gate = asyncio.Semaphore(6)
    outcomes = {"cancelled": 0, "done": 0}

    async def one(index: int) -> None:
        async with gate:
            prompt = prompt_of(rng.randrange(1, 1500), seed=100 + index)
            task = asyncio.ensure_future(pd.generate(prompt, rng.randrange(1, 48)))
            done, _ = await asyncio.wait({task}, timeout=rng.uniform(0.0, 1.5))
            if not done:
                task.cancel()
            try:
                await task
                outcomes["done"] += 1
            except asyncio.CancelledError:
                outcomes["cancelled"] += 1

    await asyncio.gather(*(one(i) for i in range(200)))
    assert outcomes["cancelled"] >= 50, outcomes  # the cancels land at every stage, not only after the end
    await pd.idle()
