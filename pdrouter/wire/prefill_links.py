"""The decode worker's connections to prefill workers, one per address, opened on first use.

A link goes over the prefill worker's lane when the route names one, else over gRPC, and is kept.
Links to workers that left are closed once more than ``max_links`` are open (least recently used
first), so a churning fleet does not pile them up. Which routes may be called at all is the decode
role's decision (``pdrouter.worker.roles.prefill_routes``).
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any, Protocol

import grpc

from pdrouter.core.aio import BackgroundTasks
from pdrouter.core.errors import InvalidRequestError
from pdrouter.wire.grpc_util import CHANNEL_OPTIONS
from pdrouter.wire.lane import LaneChannel, PrefillLane
from pdrouter.wire.v1 import worker_pb2_grpc


class RouteAddress(Protocol):
    """Where a prefill route points (a ``PrefillRoute`` message has these fields)."""

    @property
    def worker_id(self) -> str: ...

    @property
    def address(self) -> str: ...

    @property
    def lane_address(self) -> str: ...


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
        self._closing = BackgroundTasks()  # a failed close leaves nothing to do

    def __len__(self) -> int:
        return len(self._links)

    @staticmethod
    def key(route: RouteAddress) -> tuple[str, str]:
        """How ``route`` is reached: ``("lane" | "grpc", address)``; InvalidRequestError when it names none."""
        if route.lane_address:
            return "lane", route.lane_address
        if route.address:
            return "grpc", route.address
        raise InvalidRequestError(f"prefill route {route.worker_id!r} names neither an address nor a lane")

    def stub(self, route: RouteAddress) -> Any:
        key = self.key(route)
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
        self._closing.spawn(link.closable.close())

    async def close(self) -> None:
        links, self._links = list(self._links.values()), OrderedDict()
        for link in links:
            self._close_later(link)
        await self._closing.wait()
