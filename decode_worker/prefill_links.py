"""The decode worker's connections to prefill workers (``DecodeWorker.Serve`` calls them itself).

A link is opened on first use of an address and kept: over the prefill worker's lane when the
route names one, else over gRPC. Links to workers that left are closed once more than
``max_links`` are open (least recently used first), so a churning fleet does not pile them up.
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from typing import Any

import grpc

from pdcommon.errors import InvalidRequestError
from pdrouter.grpc_util import CHANNEL_OPTIONS
from pdrouter.lane import LaneChannel, PrefillLane
from pdrouter.v1 import worker_pb2, worker_pb2_grpc


class _Link:
    __slots__ = ("closable", "stub")

    def __init__(self, closable: LaneChannel | grpc.aio.Channel, stub: Any) -> None:
        self.closable = closable
        self.stub = stub


class PrefillLinks:
    """``stub(route)`` → a ``PrefillWorker`` stub (``Prefill(request, timeout=…)``) for that worker."""

    def __init__(self, max_links: int = 256, connect_timeout_s: float = 2.0) -> None:
        if max_links <= 0:
            raise ValueError("max_links must be > 0")
        self.max_links = max_links
        self.connect_timeout_s = connect_timeout_s
        self._links: OrderedDict[tuple[str, str], _Link] = OrderedDict()
        self._closing: set[asyncio.Task[None]] = set()

    def __len__(self) -> int:
        return len(self._links)

    def stub(self, route: worker_pb2.PrefillRoute) -> Any:
        if route.lane_address:
            key = ("lane", route.lane_address)
        elif route.address:
            key = ("grpc", route.address)
        else:
            raise InvalidRequestError(f"prefill route {route.worker_id!r} names neither an address nor a lane")
        link = self._links.get(key)
        if link is None:
            link = self._open(*key)
            self._links[key] = link
            while len(self._links) > self.max_links:
                _, old = self._links.popitem(last=False)
                self._close_later(old)
        else:
            self._links.move_to_end(key)
        return link.stub

    def _open(self, kind: str, address: str) -> _Link:
        if kind == "lane":
            lane = LaneChannel(address, connect_timeout_s=self.connect_timeout_s)
            return _Link(lane, PrefillLane(lane))
        channel = grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS)
        return _Link(channel, worker_pb2_grpc.PrefillWorkerStub(channel))

    def _close_later(self, link: _Link) -> None:
        task = asyncio.ensure_future(link.closable.close())
        self._closing.add(task)
        task.add_done_callback(self._closing.discard)

    async def close(self) -> None:
        links, self._links = list(self._links.values()), OrderedDict()
        for link in links:
            self._close_later(link)
        if self._closing:
            await asyncio.gather(*self._closing, return_exceptions=True)
