"""The event loop of long-lived processes: uvloop when installed (the default), asyncio's on request.

The router and the workers run on it (``pdrouter.cli.serve``), and the load generator (``pdrouter bench``);
these tests run the worker lane, the router's HTTP door transport and a loop choice error on it.
"""

from __future__ import annotations

import asyncio

import pytest
import uvloop

from pdrouter.core.aio import event_loop_factory
from pdrouter.core.errors import ConfigError
from pdrouter.wire.lane import DecodeLane, LaneChannel, LaneServer, serve_servicer
from pdrouter.wire.v1 import common_pb2, worker_pb2

from .test_lane import FakeDecode


def test_the_choice_of_loop(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PDROUTER_EVENT_LOOP", raising=False)
    assert event_loop_factory() is uvloop.new_event_loop  # installed: the default
    assert event_loop_factory("uvloop") is uvloop.new_event_loop
    assert event_loop_factory("asyncio") is None
    monkeypatch.setenv("PDROUTER_EVENT_LOOP", "asyncio")
    assert event_loop_factory() is None
    with pytest.raises(ConfigError, match="must be auto, uvloop or asyncio, not 'trio'"):
        event_loop_factory("trio")


def test_the_lane_on_uvloop() -> None:
    async def main() -> tuple[list[list[int]], str]:
        server = LaneServer()
        serve_servicer(server, FakeDecode())
        await server.start()
        channel = LaneChannel(server.address)
        stub = DecodeLane(channel)
        try:
            request = worker_pb2.DecodeRequest(request_id="u", sampling=common_pb2.SamplingParams(max_tokens=3))
            chunks = [list(c.token_ids) async for c in stub.Generate(request)]
            resp = await stub.Allocate(worker_pb2.AllocateRequest(request_id="a", prompt_token_ids=[1, 2]))
            return chunks, f"{resp.num_blocks} {type(asyncio.get_running_loop()).__module__}"
        finally:
            await channel.close()
            await server.stop(grace=0.1)

    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        chunks, what = runner.run(main())
    assert chunks == [[0], [1], [2], []]
    assert what == "2 uvloop"
