"""How tokens leave a worker and reach the router: ``whole`` requests in two chunks, merged deltas.

* ``whole_outputs`` / ``token_chunks(whole=True)`` (pure logic): every token in one chunk with the
  finish (or in chunks of at most ``WHOLE_CHUNK_TOKENS``), the first by itself before them when
  asked, the same tokens, reason and usage as one chunk per engine output;
* the driver (a simulated engine behind it): a ``whole`` request's outputs merged at their source,
  the first with tokens at once and the rest at the finish, so its caller wakes twice, not once a
  step; the same tokens, reason and usage;
* real worker processes: a colocated ``Generate`` with ``whole`` set sends one chunk, a decode
  worker's ``Serve`` (remote and local prefill) two (the first token with the report, then the
  rest), the same tokens and usage as without it;
* the router's ``TokenStream``: chunks already there when one is read become one delta over a lane
  (the same tokens, a failure after them still comes after them, closing it early is clean); over
  gRPC every chunk stays a delta of its own.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Sequence

import grpc
import pytest

from pdrouter.core.errors import NotFoundError, UnavailableError
from pdrouter.core.gpu import get_gpu_preset
from pdrouter.core.ids import RequestId
from pdrouter.core.model_spec import get_model_preset
from pdrouter.core.sampling import SamplingParams
from pdrouter.core.tokens import FinishReason, TokenDelta, TokenSink
from pdrouter.engine.outputs import FinishReason as EngineFinish
from pdrouter.engine.outputs import RequestOutput
from pdrouter.engine.sim.config import BYTE_TEXT_TOKENS, SimEngineConfig
from pdrouter.engine.sim.engine import SimEngine
from pdrouter.wire.convert import sampling_to_pb
from pdrouter.wire.grpc_util import grpc_errors
from pdrouter.wire.lane import ColocatedLane, LaneChannel, LaneServer, serve_servicer
from pdrouter.wire.v1 import common_pb2, worker_pb2, worker_pb2_grpc
from pdrouter.wire.worker_client import TokenStream
from pdrouter.worker.driver import EngineDriver, _Outputs
from pdrouter.worker.token_chunks import token_chunks
from pdrouter.worker.whole_outputs import WHOLE_CHUNK_TOKENS, whole_outputs

from .conftest import SpawnWorker

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
PROMPT = [257, *b"the quick brown fox jumps over the lazy dog"]


# -- the worker's merging, pure logic ---------------------------------------------------------
def outputs(n: int, finished: bool = True, prompt: int = 5, cached: int = 3) -> list[RequestOutput]:
    """``n`` engine outputs of one token each (token i is 100 + i); the last finished (LENGTH)."""
    return [RequestOutput(RequestId("r"), (100 + i,), finished and i == n - 1,
                          EngineFinish.LENGTH if finished and i == n - 1 else None, prompt, i + 1, cached)
            for i in range(n)]


async def replay(items: Sequence[RequestOutput]) -> AsyncIterator[RequestOutput]:
    for item in items:
        yield item


async def merged(items: Sequence[RequestOutput], **kw: object) -> list[RequestOutput]:
    return [out async for out in whole_outputs(replay(items), **kw)]  # type: ignore[arg-type]


async def test_whole_outputs_are_one_with_the_finish() -> None:
    got = await merged(outputs(10))
    assert [out.new_token_ids for out in got] == [tuple(range(100, 110))]
    last = got[-1]
    assert last.finished and (last.finish_reason, last.num_prompt_tokens, last.num_output_tokens,
                              last.num_cached_tokens) == (EngineFinish.LENGTH, 5, 10, 3)
    # The first by itself (Serve: its chunk carries the prefill report), then the rest.
    got = await merged(outputs(10), first_alone=True)
    assert [out.new_token_ids for out in got] == [(100,), tuple(range(101, 110))]
    assert [out.finished for out in got] == [False, True]
    # One token in all: passed on as it is.
    assert await merged(outputs(1)) == await merged(outputs(1), first_alone=True) == outputs(1)


async def test_whole_outputs_bound_their_size_and_keep_an_unfinished_tail() -> None:
    got = await merged(outputs(10), limit=4)
    assert [out.new_token_ids for out in got] == [(100, 101, 102, 103), (104, 105, 106, 107), (108, 109)]
    assert [out.finished for out in got] == [False, False, True]
    got = await merged(outputs(10), first_alone=True, limit=4)
    assert [out.new_token_ids for out in got] == [(100,), (101, 102, 103, 104), (105, 106, 107, 108), (109,)]
    # A stream that ends without finishing (an abort) still hands on what it had, unfinished.
    got = await merged(outputs(6, finished=False))
    assert [out.new_token_ids for out in got] == [(100, 101, 102, 103, 104, 105)]
    assert not any(out.finished for out in got)
    assert WHOLE_CHUNK_TOKENS >= 256


async def test_token_chunks_whole_is_one_chunk_with_the_same_usage() -> None:
    one_by_one = [c async for c in token_chunks("r", replay(outputs(40)), cached_tokens=16)]
    whole = [c async for c in token_chunks("r", replay(outputs(40)), cached_tokens=16, whole=True)]
    assert len(one_by_one) == 40 and len(whole) == 1
    assert list(whole[0].token_ids) == [t for c in one_by_one for t in c.token_ids]
    assert whole[0].finish_reason == one_by_one[-1].finish_reason == common_pb2.FINISH_REASON_LENGTH
    assert whole[0].usage == one_by_one[-1].usage and whole[0].usage.cached_tokens == 16


# -- real workers -------------------------------------------------------------------------------
async def chunks_of(call: AsyncIterator[common_pb2.TokenChunk]) -> list[common_pb2.TokenChunk]:
    return [chunk async for chunk in call]


def tokens(chunks: Sequence[common_pb2.TokenChunk]) -> list[int]:
    return [t for c in chunks for t in c.token_ids]


def generate(stub: worker_pb2_grpc.ColocatedWorkerStub | ColocatedLane, rid: str, whole: bool,
             params: SamplingParams = GREEDY) -> AsyncIterator[common_pb2.TokenChunk]:
    return stub.Generate(worker_pb2.WorkerGenerateRequest(  # type: ignore[return-value]
        request_id=rid, prompt_token_ids=PROMPT, sampling=sampling_to_pb(params), whole=whole))


def drained(channel: _Outputs) -> list[object]:
    items = list(channel.items)
    channel.items.clear()
    return items


def test_a_whole_channel_passes_the_first_tokens_then_holds_the_rest_for_the_finish() -> None:
    sentinel = object()
    channel = _Outputs(whole=True)
    steps = outputs(10)
    for out in steps[:9]:
        channel.put(out)
    assert drained(channel) == [steps[0]]  # the first at once; the next eight held
    channel.put(steps[9])
    (last,) = drained(channel)
    assert isinstance(last, RequestOutput) and last.finished and last.new_token_ids == tuple(range(101, 110))
    assert last._replace(new_token_ids=()) == steps[9]._replace(new_token_ids=())  # its counts and reason
    many = outputs(2 * WHOLE_CHUNK_TOKENS + 3)
    channel = _Outputs(whole=True)
    for out in many:
        channel.put(out)
    sizes = [len(o.new_token_ids) for o in drained(channel)]  # type: ignore[attr-defined]
    assert sizes == [1, WHOLE_CHUNK_TOKENS, WHOLE_CHUNK_TOKENS, 2] and sum(sizes) == len(many)
    channel = _Outputs(whole=True)
    channel.put(steps[0])
    channel.put(steps[1])
    channel.put(sentinel)  # an abort or a failed engine is not held
    assert drained(channel) == [steps[0], sentinel]
    streamed = _Outputs()
    for out in steps:
        streamed.put(out)
    assert drained(streamed) == steps


async def test_a_sink_takes_outputs_only_while_the_consumer_waits_with_nothing_queued() -> None:
    taken: list[RequestOutput] = []
    accept = True

    def sink(out: RequestOutput) -> bool:
        if accept:
            taken.append(out)
        return accept

    steps = outputs(6)
    channel = _Outputs(sink=sink)
    channel.put(steps[0])  # nobody waits: queued
    channel.waiter = asyncio.get_running_loop().create_future()
    channel.put(steps[1])  # somebody waits, but an output is queued before it: queued too
    assert taken == [] and drained(channel) == steps[:2] and channel.waiter is None
    waiter = channel.waiter = asyncio.get_running_loop().create_future()
    channel.put(steps[2])  # the consumer waits with nothing queued: the sink takes it, the consumer sleeps on
    assert taken == [steps[2]] and not channel.items and not waiter.done()
    accept = False
    channel.put(steps[3])  # refused: queued, and the consumer woken
    assert drained(channel) == [steps[3]] and waiter.done()
    accept = True
    channel.waiter = asyncio.get_running_loop().create_future()
    failed = steps[4]._replace(finish_reason=EngineFinish.ERROR, finished=True, error="boom")
    channel.put(failed)  # a failure is never the sink's
    channel.waiter = asyncio.get_running_loop().create_future()
    channel.put(steps[5])  # nor the finish
    assert taken == [steps[2]] and drained(channel) == [failed, steps[5]]
    leaving = channel.waiter = asyncio.get_running_loop().create_future()
    leaving.cancel()  # the consumer was cancelled while it waited
    channel.put(steps[1])
    assert taken == [steps[2]] and drained(channel) == [steps[1]]
    whole = _Outputs(whole=True, sink=sink)
    whole.waiter = asyncio.get_running_loop().create_future()
    whole.put(steps[0])  # a whole request has no sink
    assert taken == [steps[2]] and drained(whole) == [steps[0]]


@pytest.mark.parametrize("refuse_every", [0, 2, 3])
async def test_a_streams_outputs_through_its_sink_and_the_stream_are_in_order(refuse_every: int) -> None:
    """A driver's stream with a sink: the outputs the sink took and those the stream yielded, in the order
    they arrived, are the outputs of a stream without one (the finish always yielded), whichever the sink
    refuses."""
    sampling = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    arrived: list[tuple[str, RequestOutput]] = []
    offered = 0

    def sink(out: RequestOutput) -> bool:
        nonlocal offered
        offered += 1
        if refuse_every and offered % refuse_every == 0:
            return False
        arrived.append(("sink", out))
        return True

    got: dict[bool, list[RequestOutput]] = {}
    for with_sink in (False, True):
        driver = EngineDriver(SimEngine(SimEngineConfig(spec=get_model_preset("tiny"), gpu=get_gpu_preset("h100"),
                                                        time_scale=0.0, num_blocks=64, token_range=BYTE_TEXT_TOKENS)))
        try:
            stream = driver.generate(RequestId("r"), PROMPT, sampling, sink=sink if with_sink else None)
            yielded = []
            async for out in stream:
                yielded.append(out)
                arrived.append(("stream", out))
                await asyncio.sleep(0.001)  # a slow consumer: some outputs find it busy
            got[with_sink] = yielded
        finally:
            await driver.close()
    plain = got[False]
    in_order = [out for _, out in arrived[len(plain):]]
    assert in_order == plain
    assert arrived[-1] == ("stream", plain[-1]) and plain[-1].finished
    assert any(where == "sink" for where, _ in arrived)


@pytest.mark.parametrize("max_tokens", [1, 2, 12])
async def test_the_driver_merges_a_whole_request_at_its_source(max_tokens: int) -> None:
    """``whole``: the caller gets at most two outputs, the same tokens, reason and usage as one per step."""
    sampling = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    got: dict[bool, list[RequestOutput]] = {}
    for whole in (False, True):
        driver = EngineDriver(SimEngine(SimEngineConfig(spec=get_model_preset("tiny"), gpu=get_gpu_preset("h100"),
                                                        time_scale=0.0, num_blocks=64, token_range=BYTE_TEXT_TOKENS)))
        try:
            got[whole] = [out async for out in driver.generate(RequestId("r"), PROMPT, sampling, whole=whole)]
        finally:
            await driver.close()
    per_step, at_source = got[False], got[True]
    assert len(per_step) == max_tokens and len(at_source) == min(2, max_tokens)
    assert [t for o in at_source for t in o.new_token_ids] == [t for o in per_step for t in o.new_token_ids]
    assert at_source[-1]._replace(new_token_ids=()) == per_step[-1]._replace(new_token_ids=())
    assert await merged(at_source) == await merged(per_step)  # what the caller makes of them is the same


async def test_colocated_worker_sends_whole_requests_in_one_chunk(spawn_worker: SpawnWorker) -> None:
    worker = spawn_worker("worker")
    async with grpc.aio.insecure_channel(worker.address or "") as channel:
        info = await worker_pb2_grpc.WorkerInfoServiceStub(channel).GetInfo(worker_pb2.GetInfoRequest())
        lane = LaneChannel(info.lane_address)
        try:
            for i, stub in enumerate((worker_pb2_grpc.ColocatedWorkerStub(channel), ColocatedLane(lane))):
                streamed = await chunks_of(generate(stub, f"s{i}", whole=False))
                whole = await chunks_of(generate(stub, f"w{i}", whole=True))
                assert len(streamed) == GREEDY.max_tokens and len(whole) == 1
                assert tokens(whole) == tokens(streamed)
                assert whole[-1].finish_reason == streamed[-1].finish_reason == common_pb2.FINISH_REASON_LENGTH
                # (the second request finds the prompt in the prefix cache: cached tokens differ)
                assert (whole[-1].usage.prompt_tokens, whole[-1].usage.completion_tokens) == \
                    (streamed[-1].usage.prompt_tokens, streamed[-1].usage.completion_tokens) == \
                    (len(PROMPT), GREEDY.max_tokens)
                # One token: one chunk either way.
                single = await chunks_of(generate(stub, f"one{i}", whole=True, params=SamplingParams(max_tokens=1)))
                assert len(single) == 1 and len(single[0].token_ids) == 1 and single[0].finish_reason
        finally:
            await lane.close()


async def test_decode_serve_sends_whole_requests_in_two_chunks(spawn_worker: SpawnWorker, redis_url: str) -> None:
    prefill = spawn_worker("prefill", redis_url=redis_url)
    decode = spawn_worker("decode", redis_url=redis_url)
    async with grpc.aio.insecure_channel(prefill.address or "") as p_channel, \
            grpc.aio.insecure_channel(decode.address or "") as d_channel:
        p_info = await worker_pb2_grpc.WorkerInfoServiceStub(p_channel).GetInfo(worker_pb2.GetInfoRequest())
        d_info = await worker_pb2_grpc.WorkerInfoServiceStub(d_channel).GetInfo(worker_pb2.GetInfoRequest())
        stub = worker_pb2_grpc.DecodeWorkerStub(d_channel)
        route = worker_pb2.PrefillRoute(worker_id=p_info.worker_id, address=p_info.address)

        def serve(rid: str, whole: bool, local: bool) -> AsyncIterator[common_pb2.TokenChunk]:
            return stub.Serve(worker_pb2.ServeRequest(
                request_id=rid, prompt_token_ids=PROMPT, sampling=sampling_to_pb(GREEDY),
                model_compat_hash=d_info.model_compat_hash, local_prefill_tokens=1000 if local else 0,
                prefill=[] if local else [route], whole=whole))

        for local in (False, True):
            streamed = await chunks_of(serve(f"s-{local}", whole=False, local=local))
            whole = await chunks_of(serve(f"w-{local}", whole=True, local=local))
            assert len(streamed) == GREEDY.max_tokens and len(whole) == 2
            # The report rides on the first chunk, with the first token, as without ``whole``.
            assert whole[0].HasField("prefill") and whole[0].prefill.local == local
            assert len(whole[0].token_ids) == 1 and not whole[1].HasField("prefill")
            assert tokens(whole) == tokens(streamed)
            assert whole[-1].finish_reason == streamed[-1].finish_reason == common_pb2.FINISH_REASON_LENGTH
            assert (whole[-1].usage.prompt_tokens, whole[-1].usage.completion_tokens) == \
                (len(PROMPT), GREEDY.max_tokens)


# -- the router's side: merged deltas ----------------------------------------------------------------
class Burst(worker_pb2_grpc.ColocatedWorkerServicer):
    """Sends ``max_tokens`` one-token chunks at once (no wait between them), then the finish; a
    request id starting with ``fail`` ends with NOT_FOUND instead of finishing, ``hold`` never ends,
    ``paced`` waits 5 ms before each chunk (its consumer waits for each)."""

    def __init__(self) -> None:
        self.closed: list[str] = []

    @grpc_errors
    async def Generate(self, request: worker_pb2.WorkerGenerateRequest,
                       context: object) -> AsyncIterator[common_pb2.TokenChunk]:
        rid = request.request_id
        try:
            n = request.sampling.max_tokens
            for i in range(n - 1):
                if rid.startswith("paced"):
                    await asyncio.sleep(0.005)
                yield common_pb2.TokenChunk(request_id=rid, token_ids=[i])
            if rid.startswith("fail"):
                raise NotFoundError("gone")
            if rid.startswith("hold"):
                yield common_pb2.TokenChunk(request_id=rid, token_ids=[n - 1])
                await asyncio.sleep(30)
            yield common_pb2.TokenChunk(request_id=rid, token_ids=[n - 1], finish_reason=common_pb2.FINISH_REASON_STOP,
                                        usage=common_pb2.Usage(prompt_tokens=3, completion_tokens=n, cached_tokens=2))
        finally:
            self.closed.append(rid)


def burst_request(rid: str, n: int) -> worker_pb2.WorkerGenerateRequest:
    return worker_pb2.WorkerGenerateRequest(request_id=rid, prompt_token_ids=[1, 2, 3],
                                            sampling=common_pb2.SamplingParams(max_tokens=n))


async def deltas_after_a_pause(stream: TokenStream) -> list[TokenDelta]:
    """Every delta, pausing after the first so that the rest of the chunks are all there."""
    got: list[TokenDelta] = []
    async for delta in stream:
        got.append(delta)
        if len(got) == 1:
            await asyncio.sleep(0.2)
    return got


@pytest.fixture
async def burst_lane() -> AsyncIterator[tuple[Burst, ColocatedLane]]:
    """A lane server of ``Burst`` and a client stub on it."""
    server = LaneServer()
    servicer = Burst()
    serve_servicer(server, servicer)
    await server.start()
    channel = LaneChannel(server.address)
    try:
        yield servicer, ColocatedLane(channel)
    finally:
        await channel.close()
        await server.stop(grace=0.1)


async def test_token_stream_merges_the_chunks_already_there_on_a_lane(burst_lane: tuple[Burst, ColocatedLane]) -> None:
    servicer, lane = burst_lane
    got = await deltas_after_a_pause(TokenStream(lane.Generate(burst_request("r", 50)), "r", 3))
    assert [t for d in got for t in d.token_ids] == list(range(50))
    assert len(got) < 10  # the chunks that waited came as one (or a few) deltas
    assert got[-1].finish_reason is FinishReason.STOP
    assert got[-1].usage is not None and (got[-1].usage.completion_tokens, got[-1].usage.cached_tokens) == (50, 2)
    # A failure after some chunks: their tokens first, then the error.
    stream = TokenStream(lane.Generate(burst_request("fail", 20)), "fail", 3)
    seen: list[int] = []
    with pytest.raises(NotFoundError):
        async for delta in stream:
            seen.extend(delta.token_ids)
            await asyncio.sleep(0.1)
    assert seen == list(range(19))
    # Left early while a read is pending: closing is clean and the worker's handler ends.
    call = lane.Generate(burst_request("hold", 5))
    stream = TokenStream(call, "hold", 3)
    iterator = stream.__aiter__()
    seen = []
    while len(seen) < 5:
        seen.extend((await asyncio.wait_for(anext(iterator), 5)).token_ids)
        await asyncio.sleep(0.05)
    assert seen == list(range(5))
    await iterator.aclose()  # type: ignore[attr-defined]  # a read of the next chunk is pending
    stream.cancel()
    for _ in range(200):
        if "hold" in servicer.closed:
            break
        await asyncio.sleep(0.01)
    assert "hold" in servicer.closed


async def test_a_token_sink_takes_the_chunks_that_come_while_the_consumer_waits(
        burst_lane: tuple[Burst, ColocatedLane]) -> None:
    """``TokenStream(sink=...)`` over a lane: once the consumer arms the sink (after its first delta), each
    chunk of plain tokens that arrives while it waits goes to ``deliver``; what the sink refuses, and
    the finish, come by the stream, every token once and in order, the usage counting them all. A
    ``deliver`` that raises fails the stream with its error, and the lane serves on."""
    _, lane = burst_lane

    async def run(rid: str, deliver: Callable[[tuple[int, ...]], bool]) -> tuple[list[tuple[str, int]], TokenDelta]:
        """The tokens as the consumer sees them: ("stream", t) from the stream, ("sink", t) when flushed."""
        seen: list[tuple[str, int]] = []
        taken: list[int] = []
        sink = TokenSink()

        def logged(ids: tuple[int, ...]) -> bool:
            took = deliver(ids)
            taken.extend(ids if took else ())
            return took

        def flush() -> None:
            assert taken  # only after chunks it took
            seen.extend(("sink", t) for t in taken)
            taken.clear()

        sink.flush = flush
        last = None
        async for delta in TokenStream(lane.Generate(burst_request(rid, 20)), rid, 3, sink=sink):
            assert not taken  # flushed before the stream's next delta
            seen.extend(("stream", t) for t in delta.token_ids)
            sink.deliver, last = logged, delta
        assert last is not None
        return seen, last

    seen, last = await run("paced-all", lambda ids: True)
    assert [t for _, t in seen] == list(range(20))
    assert seen[0] == ("stream", 0) and seen[-1] == ("stream", 19)  # the first and the finish: the stream's
    assert sum(how == "sink" for how, _ in seen) >= 10
    assert last.finish_reason is FinishReason.STOP and last.usage is not None
    assert last.usage.completion_tokens == 20
    seen, last = await run("paced-odd", lambda ids: ids[0] % 2 == 0)  # odd tokens refused
    assert [t for _, t in seen] == list(range(20))
    assert all(how == "stream" for how, t in seen if t % 2)
    assert last.usage is not None and last.usage.completion_tokens == 20

    def broken(ids: tuple[int, ...]) -> bool:
        raise RuntimeError("the writer broke")

    with pytest.raises(RuntimeError, match="the writer broke"):
        await run("paced-broken", broken)
    seen, _ = await run("paced-after", lambda ids: True)  # the same connection serves on
    assert [t for _, t in seen] == list(range(20))


async def test_token_stream_over_grpc_keeps_one_delta_per_chunk() -> None:
    server = grpc.aio.server()
    worker_pb2_grpc.add_ColocatedWorkerServicer_to_server(Burst(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = worker_pb2_grpc.ColocatedWorkerStub(channel)
            got = await deltas_after_a_pause(TokenStream(stub.Generate(burst_request("g", 20)), "g", 3))
            assert [d.token_ids for d in got] == [(i,) for i in range(20)]
            assert got[-1].usage is not None and got[-1].usage.completion_tokens == 20
            # A failure is the worker's status, as before.
            with pytest.raises(NotFoundError):
                [d async for d in TokenStream(stub.Generate(burst_request("fail", 3)), "fail", 3)]
    finally:
        await server.stop(0)


async def test_token_stream_that_ends_unfinished_is_unavailable() -> None:
    class Unfinished:
        def __aiter__(self) -> AsyncIterator[common_pb2.TokenChunk]:
            return self._chunks()

        async def _chunks(self) -> AsyncIterator[common_pb2.TokenChunk]:
            yield common_pb2.TokenChunk(token_ids=[1])

        def cancel(self) -> None:
            return None

    got: list[TokenDelta] = []
    with pytest.raises(UnavailableError):
        async for delta in TokenStream(Unfinished(), "u", 1):
            got.append(delta)
    assert [d.token_ids for d in got] == [(1,)]
