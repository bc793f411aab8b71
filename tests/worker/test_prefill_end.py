"""``PrefillWorker.Prefill``'s end, on fakes: however the call ends, the engine gets the request's
blocks back, and only once the transfer no longer reads them.

No processes: a fake engine driver and KV sender. The whole request over real workers is in
``test_pd_workers.py`` and ``test_decode_serve.py``.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Sequence
from typing import Any

import pytest

from pdrouter.core.errors import InvalidRequestError
from pdrouter.core.ids import RequestId
from pdrouter.core.kv_layout import KvLayout
from pdrouter.core.sampling import SamplingParams
from pdrouter.engine.outputs import PrefillResult
from pdrouter.transfer.target import TransferTarget
from pdrouter.wire.convert import sampling_to_pb
from pdrouter.wire.v1 import common_pb2, worker_pb2
from pdrouter.worker.roles.prefill import PrefillServicer

LAYOUT = KvLayout(num_layers=2, num_kv_heads=1, head_dim=4, block_size=16, num_blocks=8, dtype="float32")
PROMPT = list(range(40))  # 3 blocks


class FakeDriver:
    def __init__(self) -> None:
        self.ended: list[tuple[str, RequestId]] = []

    async def prefill(self, rid: RequestId, prompt: Sequence[int], sampling: SamplingParams, *,
                      cache_salt: bytes = b"", priority: int = 0) -> PrefillResult:
        return PrefillResult(rid, tuple(prompt), (1, 2, 3), (), 7, 0, None)

    def release(self, rid: RequestId) -> None:
        self.ended.append(("release", rid))

    def abort(self, rid: RequestId) -> None:
        self.ended.append(("abort", rid))


class StuckTransfer:
    """Never finishes; its abort holds the calling thread until ``let_abort_return`` is set."""

    def __init__(self) -> None:
        self.aborting = threading.Event()
        self.let_abort_return = threading.Event()
        self.aborted = False

    def announce(self) -> None:
        pass

    def send_layers(self, block_ids: Sequence[int], layers: Any = None) -> None:
        pass

    async def finish_async(self, timeout: float | None = None) -> None:
        await asyncio.Event().wait()

    def abort(self, reason: str) -> None:
        self.aborting.set()
        assert self.let_abort_return.wait(10)
        self.aborted = True


class FakeSender:
    def __init__(self, transfer: StuckTransfer) -> None:
        self.transfer = transfer

    def open_transfer_if_connected(self, target: TransferTarget) -> StuckTransfer:
        return self.transfer


class Context:
    """What ``grpc_errors`` needs of a servicer context: an abort that ends the call."""

    async def abort(self, code: object, message: str) -> None:
        raise AssertionError(f"the call failed: {code} {message}")


class AnyTarget:
    async def refusal(self, worker_id: str, target: TransferTarget) -> None:
        return None


def request() -> worker_pb2.PrefillRequest:
    target = common_pb2.TransferTarget(transfer_id="t-1", address="127.0.0.1:9", dst_block_ids=[4, 5, 6],
                                       layer_start=0, layer_end=LAYOUT.num_layers, epoch=3)
    return worker_pb2.PrefillRequest(request_id="r-1", prompt_token_ids=PROMPT, target=target,
                                     sampling=sampling_to_pb(SamplingParams(max_tokens=4)))


@pytest.mark.parametrize("cancels", [1, 2])
async def test_a_cancelled_call_frees_the_blocks_after_the_transfer_stopped(cancels: int) -> None:
    """Cancelled once (the transfer is aborted), or again while that abort runs: the engine aborts
    the request, after the transfer's abort returned."""
    driver, transfer = FakeDriver(), StuckTransfer()
    servicer = PrefillServicer(driver, FakeSender(transfer), LAYOUT, "", AnyTarget())  # type: ignore[arg-type]
    call = asyncio.ensure_future(servicer.Prefill(request(), Context()))  # type: ignore[arg-type]
    await asyncio.sleep(0.05)  # waiting on the transfer
    call.cancel()
    assert await asyncio.to_thread(transfer.aborting.wait, 5)
    if cancels == 2:
        call.cancel()  # the caller gives up on the abort too
        await asyncio.sleep(0.05)
    assert driver.ended == []  # the transfer may still read the blocks
    transfer.let_abort_return.set()
    with pytest.raises(asyncio.CancelledError):
        await call
    for _ in range(100):
        if driver.ended:
            break
        await asyncio.sleep(0.02)
    assert transfer.aborted
    assert driver.ended == [("abort", RequestId("r-1"))]


class QuickTransfer:
    """Finishes at once; records what the servicer did with it."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    def announce(self) -> None:
        self.calls.append("announce")

    def send_layers(self, block_ids: Sequence[int], layers: Any = None) -> None:
        self.calls.append("send_layers")

    async def finish_async(self, timeout: float | None = None) -> None:
        self.calls.append("finish")

    def abort(self, reason: str) -> None:
        self.calls.append(f"abort: {reason}")


class SlowDriver(FakeDriver):
    """Computes for ``seconds``, then answers (or raises ``error``)."""

    def __init__(self, seconds: float, error: BaseException | None = None) -> None:
        super().__init__()
        self.seconds = seconds
        self.error = error

    async def prefill(self, rid: RequestId, prompt: Sequence[int], sampling: SamplingParams, *,
                      cache_salt: bytes = b"", priority: int = 0) -> PrefillResult:
        await asyncio.sleep(self.seconds)
        if self.error is not None:
            raise self.error
        return await super().prefill(rid, prompt, sampling, cache_salt=cache_salt, priority=priority)


@pytest.mark.parametrize(("seconds", "announced"), [(0.0, False), (0.05, True)], ids=["quick", "slow"])
async def test_a_transfer_is_announced_while_a_slow_prompt_computes(seconds: float, announced: bool) -> None:
    """The transfer is opened before the prompt computes; a prompt that takes longer than
    ``ANNOUNCE_AFTER_S`` has it announced meanwhile, a quick one sends the BEGIN with its first layer."""
    driver, transfer = SlowDriver(seconds), QuickTransfer()
    servicer = PrefillServicer(driver, FakeSender(transfer), LAYOUT, "", AnyTarget())  # type: ignore[arg-type]
    response = await servicer.Prefill(request(), Context())  # type: ignore[arg-type]
    assert response.first_token_id == 7
    assert transfer.calls == (["announce"] if announced else []) + ["send_layers", "finish"]
    assert driver.ended == [("release", RequestId("r-1"))]


async def test_a_prompt_that_fails_abandons_its_opened_transfer() -> None:
    """The engine refused the prompt after the transfer was opened (and announced): the transfer is
    aborted, so the receiver hears of it, the engine's own error is what the caller gets, and no
    blocks were held to give back."""
    driver, transfer = SlowDriver(0.05, InvalidRequestError("the prompt is too long")), QuickTransfer()
    servicer = PrefillServicer(driver, FakeSender(transfer), LAYOUT, "", AnyTarget())  # type: ignore[arg-type]
    aborted: list[str] = []

    class Refusing(Context):
        async def abort(self, code: object, message: str) -> None:
            aborted.append(message)
            raise RuntimeError("the call ended")

    with pytest.raises(RuntimeError, match="the call ended"):
        await servicer.Prefill(request(), Refusing())  # type: ignore[arg-type]
    assert aborted and "the prompt is too long" in aborted[0]
    assert transfer.calls == ["announce", "abort: the prompt was not computed"]
    assert driver.ended == []
