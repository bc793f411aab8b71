"""The connector's parts without an engine: the scheduler side's bookkeeping, the orders, the side
channel, and vLLM-shaped pools moved by the real transfer layer over loopback."""

from __future__ import annotations

import asyncio
import os
from dataclasses import dataclass
from typing import Any

import pytest
import torch

from pdrouter.core.errors import ConfigError, InvalidRequestError
from pdrouter.transfer import Backend, KvReceiver, KvSender, TransferConfig, new_epoch
from pdrouter.transfer.errors import ChecksumError
from pdrouter.transfer.target import TransferTarget
from pdrouter.transfer.vllm.channel import (
    ChannelError,
    Hello,
    Local,
    Outcome,
    Ready,
    Received,
    Reserved,
    Retry,
    Sent,
    Welcome,
    decode,
    encode,
    read_message,
    write_message,
)
from pdrouter.transfer.vllm.host import ConnectorHost, LocalPrefill, Placement
from pdrouter.transfer.vllm.orders import ReceiveOrder, SendOrder, order_from_params, target_to_dict
from pdrouter.transfer.vllm.paged_pool import PagedKvLayout, PagedPool
from pdrouter.transfer.vllm.reports import Reports
from pdrouter.transfer.vllm.scheduler_side import SchedulerSide
from pdrouter.transfer.vllm.step_plan import Cancel, LocalPlan, ReceivePlan, SendPlan

pytestmark = pytest.mark.vllm

TOKEN = "connector-parts-token-0123456789"


@dataclass
class FakeRequest:
    """What the scheduler side reads of vLLM's Request (pure bookkeeping under test)."""

    request_id: str
    num_prompt_tokens: int
    kv_transfer_params: dict[str, Any] | None = None
    num_computed_tokens: int = 0


def target(blocks: tuple[int, ...] = (5, 6, 7), skip: int = 0) -> TransferTarget:
    return TransferTarget(transfer_id="t", peer="127.0.0.1:9", dst_block_ids=blocks, compat_hash="c", epoch=1,
                          layer_start=0, layer_end=3, skip_blocks=skip)


def config(backend: Backend = Backend.TCP) -> TransferConfig:
    return TransferConfig(auth_token=TOKEN, epoch=new_epoch(), backend=backend)


def layout(*, num_blocks: int = 12, layers: int = 3, arrangement: str = "cpu|LBHNC") -> PagedKvLayout:
    return PagedKvLayout(num_layers=layers, num_kv_heads=2, head_dim=8, block_size=4, num_blocks=num_blocks,
                         dtype="bfloat16", arrangement=arrangement)


def paged(lay: PagedKvLayout, *, block_major: bool = False,
          seed: int | None = None) -> tuple[PagedPool, list[torch.Tensor]]:
    """vLLM's allocation of ``lay``: one int8 buffer, a ``[blocks, heads, slots, 2 × head_dim]`` view per
    layer (layer-major, as on the CPU backend, or block-major: other layers' pages between a layer's blocks)."""
    page_elems = lay.num_kv_heads * lay.block_size * 2 * lay.head_dim
    buf = torch.zeros(lay.num_layers * lay.num_blocks * page_elems * 2, dtype=torch.int8)
    if seed is not None:
        buf.random_(-128, 127, generator=torch.Generator().manual_seed(seed))
    flat = buf.view(torch.bfloat16)
    shape = (lay.num_blocks, lay.num_kv_heads, lay.block_size, 2 * lay.head_dim)
    views = []
    for layer in range(lay.num_layers):
        if block_major:
            stride0, offset = lay.num_layers * page_elems, layer * page_elems
        else:
            stride0, offset = page_elems, layer * lay.num_blocks * page_elems
        views.append(flat.as_strided(shape, (stride0, *torch.empty(shape[1:]).stride()), offset))
    return PagedPool(views, lay), views


def pages(views: list[torch.Tensor]) -> torch.Tensor:
    """A copy of every layer's pages, ``[layer, block, ...]``, as bit patterns (random bits make NaNs)."""
    return torch.stack([v.view(torch.int16) for v in views])


# -- scheduler side -------------------------------------------------------------------------------------
def test_a_receive_reserves_the_uncached_prompt_once() -> None:
    side = SchedulerSide(block_size=4)
    req = FakeRequest("r1", 10, ReceiveOrder("key-1", timeout_s=5).params())
    assert side.matched_tokens(req, 4) == (6, True)
    assert side.matched_tokens(req, 4) == (6, True)  # asked again (no room yet): no side effect
    side.after_alloc(req, [9, 3, 7, 11], 6)  # vLLM may hand more blocks than the prompt's three
    plan = side.build({}, lambda _: [])
    assert plan.receives == (ReceivePlan("r1", "key-1", (9, 3, 7), 1, 5.0),)
    side.after_alloc(req, [9, 3, 7], 0)  # the second call, after the load: nothing new
    assert side.build({}, lambda _: []).empty
    assert side.matched_tokens(req, 0) == (0, False)  # preempted later: computed here


def test_a_mostly_cached_prompt_is_computed_here() -> None:
    side = SchedulerSide(block_size=4)
    req = FakeRequest("r1", 10, ReceiveOrder("key-1", local_prefill_tokens=2).params())
    assert side.matched_tokens(req, 8) == (0, False)
    side.after_alloc(req, [1, 2, 3], 0)
    assert side.build({}, lambda _: []).locals == (LocalPlan("key-1", 8),)


def test_a_receive_that_ends_before_its_kv_landed_is_cancelled_once() -> None:
    side = SchedulerSide(block_size=4)
    done, gone = (FakeRequest(r, 8, ReceiveOrder(f"key-{r}").params()) for r in ("done", "gone"))
    for req in (done, gone):
        side.matched_tokens(req, 0)
        side.after_alloc(req, [1, 2], 8)
    side.build({}, lambda _: [])
    side.transfers_reported({"done"})
    assert side.finished(done) is False and side.finished(gone) is False
    assert side.build({}, lambda _: []).cancels == (Cancel("gone", "key-gone"),)
    assert side.finished(gone) is False and side.build({}, lambda _: []).empty


def test_a_send_goes_out_in_the_step_that_completes_the_prompt() -> None:
    side = SchedulerSide(block_size=4)
    order = SendOrder("key-1", (target(),), hold_s=7)
    req = FakeRequest("p1", 10, order.params())
    side.after_alloc(req, [4, 5], 0)
    assert side.finished(FakeRequest("other", 3)) is False
    assert side.build({"p1": 8}, lambda _: [4, 5]).sends == ()  # a first chunk of 8 tokens
    req.num_computed_tokens = 8
    side.after_alloc(req, [4, 5, 6], 0)
    plan = side.build({"p1": 2}, lambda _: [4, 5, 6, 99])
    assert plan.sends == (SendPlan("p1", "key-1", order.targets, (4, 5, 6), 7.0),)
    assert side.finished(req) is True  # its blocks wait for the worker side's report
    assert side.finished(req) is False


def test_a_send_request_that_ends_before_its_last_chunk_frees_its_blocks_at_once() -> None:
    side = SchedulerSide(block_size=4)
    req = FakeRequest("p1", 10, SendOrder("key-1", (target(),)).params())
    side.after_alloc(req, [4, 5], 0)
    assert side.finished(req) is False
    assert side.build({"p1": 10}, lambda _: [4, 5, 6]).empty


def test_malformed_params_run_the_request_as_a_plain_one(caplog: pytest.LogCaptureFixture) -> None:
    side = SchedulerSide(block_size=4)
    req = FakeRequest("r1", 10, {"pdrouter": {"receive": {"key": ""}}})
    assert side.matched_tokens(req, 0) == (0, False)
    side.after_alloc(req, [1], 0)
    assert side.build({}, lambda _: []).empty
    assert "ignoring its kv_transfer_params" in caplog.text


# -- orders -------------------------------------------------------------------------------------------
def test_orders_round_trip_and_refuse_what_is_wrong() -> None:
    send = SendOrder("key-1", (target((1, 2), skip=1),), hold_s=3)
    assert order_from_params(send.params()) == send
    receive = ReceiveOrder("key-2", 16, 9.5)
    assert order_from_params(receive.params()) == receive
    assert order_from_params(None) is None and order_from_params({"other": 1}) is None
    for bad in ({"pdrouter": {}}, {"pdrouter": {"receive": {"key": "k", "timeout_s": 0}}},
                {"pdrouter": {"receive": {"key": "k", "local_prefill_tokens": -1}}},
                {"pdrouter": {"send": {"key": "k", "targets": []}}},
                {"pdrouter": {"send": {"key": "k", "targets": [{"peer": "x"}]}}},
                {"pdrouter": {"receive": {"key": "k", "bogus": 1}}}):
        with pytest.raises(InvalidRequestError):
            order_from_params(bad)


# -- side channel -------------------------------------------------------------------------------------
def test_every_message_round_trips_and_garbage_is_refused() -> None:
    messages = [Hello(0, 2, "kv_consumer", 42), Welcome(TOKEN, 7, "tcp", "0.0.0.0", "10.0.0.1", 7000),
                Ready(1, "h:1", 100, 16, 4096, "abc"), Reserved("k", 0, 1, target_to_dict(target()), 32),
                Local("k", 0, 16), Received("k", 1, 0, Outcome.failed(ChecksumError("bad frame"), 10, 0.5)),
                Sent("k", 0, Outcome(True, 4096, 0.01)), Retry("k")]
    for message in messages:
        assert decode(encode(message)[4:]) == message
    assert TOKEN not in repr(messages[1])
    error = decode(encode(messages[5])[4:]).outcome.error()  # type: ignore[union-attr]
    assert isinstance(error, ChecksumError) and error.message == "bad frame"
    for garbage in (b"{", b'{"type": "nope"}', b'{"type": "retry"}', b"[]"):
        with pytest.raises(ChannelError):
            decode(garbage)


class FakeRank:
    """One connector rank dialling a host over its real Unix socket (the test plays the connector)."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer

    @classmethod
    async def join(cls, host: ConnectorHost, rank: int, world: int, receiver: str) -> FakeRank:
        reader, writer = await asyncio.open_unix_connection(host.socket_path)
        await write_message(writer, Hello(rank, world, host.kv_role, os.getpid()))
        welcome = await read_message(reader)
        assert isinstance(welcome, Welcome) and welcome.auth_token == TOKEN
        await write_message(writer, Ready(rank, receiver, 64, 4, 1024, "compat"))
        return cls(reader, writer)

    async def say(self, message: Any) -> None:
        await write_message(self.writer, message)


@pytest.fixture
async def host() -> Any:
    made = ConnectorHost(TransferConfig(auth_token=TOKEN, epoch=new_epoch()), "kv_consumer")
    await made.start()
    assert oct(os.stat(os.path.dirname(made.socket_path)).st_mode & 0o777) == "0o700"
    yield made
    await made.close()


async def test_a_receive_link_waits_for_every_rank_and_follows_retries(host: ConnectorHost) -> None:
    ranks = [await FakeRank.join(host, r, 2, f"127.0.0.1:{7000 + r}") for r in range(2)]
    pool = await host.wait_ready(5)
    assert pool.receivers == ("127.0.0.1:7000", "127.0.0.1:7001") and pool.block_bytes == 1024
    with host.receive("k") as link:
        t0, t1 = target_to_dict(target((1, 2))), target_to_dict(target((3, 4)))
        await ranks[1].say(Reserved("k", 1, 0, t1, 0))
        with pytest.raises(Exception, match="no placement"):
            await link.placement(0.2)  # rank 0 has not spoken
        await ranks[0].say(Reserved("k", 0, 0, t0, 0))
        placement = await link.placement(5)
        assert isinstance(placement, Placement) and [t.dst_block_ids for t in placement.targets] == [(1, 2), (3, 4)]
        await ranks[0].say(Received("k", 0, 0, Outcome.failed(ChecksumError("flipped"))))
        with pytest.raises(ChecksumError):
            await link.landed(5)
        link.retry()
        for rank in ranks:
            assert await asyncio.wait_for(read_message(rank.reader), 5) == Retry("k")
            await rank.say(Reserved("k", ranks.index(rank), 1, t0, 0))
        assert (await link.placement(5)).attempt == 1  # type: ignore[union-attr]
        for r, rank in enumerate(ranks):
            await rank.say(Received("k", r, 1, Outcome(True, 100, 0.1 * (r + 1))))
        landed = await link.landed(5)
        assert (landed.nbytes, landed.seconds) == (200, 0.2)
    assert host.open_links == 0


async def test_links_fail_when_the_engine_goes_away(host: ConnectorHost) -> None:
    rank = await FakeRank.join(host, 0, 1, "127.0.0.1:7000")
    await host.wait_ready(5)
    with host.receive("k") as link, host.send("s") as send:
        await rank.say(Local("k", 0, 12))
        assert await link.placement(5) == LocalPrefill(12)
        rank.writer.close()
        with pytest.raises(ChannelError, match="went away"):
            await send.sent(5)


# -- pools ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("block_major", [False, True], ids=["layer-major", "block-major"])
@pytest.mark.parametrize("backend", [Backend.TCP, Backend.GLOO])
def test_pages_land_exactly_in_the_reserved_blocks(block_major: bool, backend: Backend) -> None:
    src_pool, src_views = paged(layout(), block_major=block_major, seed=1)
    dst_pool, dst_views = paged(layout(), block_major=block_major)
    before = pages(dst_views)
    with KvReceiver(dst_pool, dst_pool.layout, config(backend)) as receiver, \
            KvSender(src_pool, src_pool.layout, config(backend)) as sender:
        handle = receiver.expect("t", [7, 8, 2, 3], skip_blocks=1, timeout_s=10)
        transfer = sender.open_transfer(handle.target)
        for layer in range(3):
            transfer.send_layers([0, 4, 5, 6], layer)
        transfer.finish(10)
        handle.wait_all(10)
        assert handle.bytes_landed == 3 * src_pool.layout.block_bytes
    src, dst = pages(src_views), pages(dst_views)
    for s, d in ((4, 8), (5, 2), (6, 3)):
        assert torch.equal(dst[:, d], src[:, s])
    untouched = [b for b in range(12) if b not in (8, 2, 3)]
    assert torch.equal(dst[:, untouched], before[:, untouched])


def test_pools_of_other_arrangements_do_not_exchange_blocks() -> None:
    assert layout().compat_hash() != layout(arrangement="cuda|LBHNC").compat_hash()
    from pdrouter.core.kv_layout import KvLayout

    plain = KvLayout(num_layers=3, num_kv_heads=2, head_dim=8, block_size=4, num_blocks=12, dtype="bfloat16")
    assert plain.compat_hash() != layout().compat_hash()


def test_received_blocks_with_a_value_that_is_not_finite_are_found() -> None:
    pool, views = paged(layout(), block_major=True)
    views[2][5, 1, 3, 7] = float("nan")
    views[0][9, 0, 0, 0] = float("-inf")
    assert pool.finite([0, 1, 2, 3, 4, 6, 7, 8, 10, 11])
    assert not pool.finite([4, 5]) and not pool.finite([9])
    assert pool.finite([])


def test_a_view_that_is_not_vllm_shaped_is_refused() -> None:
    lay = layout()
    _, views = paged(lay)
    with pytest.raises(ConfigError, match="3 layers"):
        PagedPool(views[:2], lay)
    other = torch.zeros_like(views[0])
    with pytest.raises(ConfigError, match="same allocation"):
        PagedPool([views[0], other, views[2]], lay)
    with pytest.raises(ConfigError, match="page"):
        PagedPool(views, PagedKvLayout(num_layers=3, num_kv_heads=1, head_dim=8, block_size=4,
                                            num_blocks=12, dtype="bfloat16"))


def test_reports_name_a_send_only_once_vllm_finished_it() -> None:
    reports = Reports()
    reports.sending("a")
    reports.sending("b")
    reports.sent("a")
    assert reports.take(set()).finished_sending == set()  # over, but vLLM has not finished it
    reports.received("r", failed=True)
    step = reports.take({"a", "b", "zzz"})
    assert (step.finished_sending, step.finished_recving, step.failed_recving) == ({"a"}, {"r"}, {"r"})
    reports.sent("b")
    assert reports.take(set()).finished_sending == {"b"}
    assert reports.take({"b"}).finished_sending == set() and reports.pending_sends == 0
