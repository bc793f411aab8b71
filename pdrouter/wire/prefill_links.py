"""The decode worker's calls to prefill workers, in dataclasses, over one connection per address.

``PrefillLinks.prefill(route, …)`` is ``PrefillWorker.Prefill``: it builds the request from plain
values (``SamplingParams``, the ``TransferTarget`` the decode worker invites the KV with) and gives
back a ``PrefillOutcome`` (``pdrouter.core.disaggregation``); a failed call raises the matching
``pdrouter.core.errors`` type, never ``grpc.RpcError``, and cancelling the awaiting task cancels the
call (the prefill worker drops its share). The decode role's logic
(``pdrouter.worker.roles.decode_serve``) sees no protobuf.

A link goes over the prefill worker's lane when the route names one, else over gRPC, and is kept.
Links to workers that left are closed once more than ``max_links`` are open (least recently used
first), so a churning fleet does not pile them up. Which routes may be called at all is the decode
role's decision (``pdrouter.worker.roles.prefill_routes``).
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any, Protocol

import grpc

from pdrouter.core.aio import BackgroundTasks
from pdrouter.core.disaggregation import PrefillOutcome
from pdrouter.core.errors import InvalidRequestError
from pdrouter.core.sampling import SamplingParams
from pdrouter.core.tokens import pack_token_ids
from pdrouter.core.tracing import Tracing
from pdrouter.transfer.target import TransferTarget
from pdrouter.wire.convert import sampling_to_pb
from pdrouter.wire.grpc_util import CHANNEL_OPTIONS, RPC_ERRORS, from_rpc_error
from pdrouter.wire.kv_convert import target_to_pb
from pdrouter.wire.lane import LaneChannel, PrefillLane
from pdrouter.wire.security import OPEN, PeerSecurity
from pdrouter.wire.v1 import worker_pb2, worker_pb2_grpc


class RouteAddress(Protocol):
    """Where a prefill route points (``pdrouter.core.disaggregation.PrefillRoute`` and its message have these)."""

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
    """``prefill(route, …)``: one ``PrefillWorker.Prefill`` call; ``stub(route)``: that worker's stub."""

    def __init__(self, max_links: int = 256, connect_timeout_s: float = 2.0, security: PeerSecurity = OPEN,
                 tracing: Tracing | None = None) -> None:
        """``security``: the credentials each call to a prefill worker presents (internal secret, TLS);
        ``tracing``: the process's tracer (each call is a client span of the current trace, its
        context sent with the call)."""
        if max_links <= 0:
            raise ValueError("max_links must be > 0")
        self.tracing = tracing
        self.security = security
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

    async def prefill(self, route: RouteAddress, request_id: str, prompt_token_ids: Sequence[int],
                      sampling: SamplingParams, target: TransferTarget, decode_worker_id: str,
                      model_compat_hash: str, timeout: float | None, cache_salt: bytes = b"",
                      priority: int = 0) -> PrefillOutcome:
        """Have ``route``'s worker compute the prompt and push its KV to ``target`` (on ``decode_worker_id``).

        Raises the ``pdrouter.core.errors`` type of the call's status (``UnavailableError`` when the
        worker cannot be reached or its connection closed); a cancelled task cancels the call.
        """
        msg = worker_pb2.PrefillRequest(request_id=request_id, prompt_token_bytes=pack_token_ids(prompt_token_ids),
                                        sampling=sampling_to_pb(sampling),
                                        target=target_to_pb(target, decode_worker_id),
                                        model_compat_hash=model_compat_hash, cache_salt=cache_salt,
                                        priority=priority)
        tracing, span = self.tracing, None
        if tracing is None:
            call = self.stub(route).Prefill(msg, timeout=timeout)
        else:
            span = tracing.span("pdrouter.v1.PrefillWorker/Prefill", kind=tracing.CLIENT, attributes={
                "rpc.system": "grpc", "rpc.service": "pdrouter.v1.PrefillWorker", "rpc.method": "Prefill",
                "pdrouter.prefill_worker": route.worker_id, "server.address": self.key(route)[1]})
            call = self.stub(route).Prefill(msg, timeout=timeout, metadata=list(tracing.headers(span).items()))
        try:
            resp = await call
        except BaseException as exc:
            if isinstance(exc, asyncio.CancelledError):
                call.cancel()
            if span is not None:
                assert tracing is not None
                tracing.failed(span, exc)
            if isinstance(exc, RPC_ERRORS):
                raise from_rpc_error(exc) from None
            raise
        finally:
            if span is not None:
                span.end()
        stats = resp.stats
        return PrefillOutcome(first_token=resp.first_token_id, cached_tokens=stats.cached_tokens,
                              compute_ms=stats.compute_ms, transfer_ms=stats.transfer_ms, bytes_sent=stats.bytes_sent)

    def stub(self, route: RouteAddress) -> Any:
        """A ``PrefillWorker`` stub for ``route``'s worker (``Prefill(request, timeout=…)``), opened on first use."""
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
            lane = LaneChannel(address, connect_timeout_s=self.connect_timeout_s, token=self.security.lane_token,
                               ssl=self.security.client_ssl())
            return _Link(lane, PrefillLane(lane))
        channel = self.security.channel(address, CHANNEL_OPTIONS)
        return _Link(channel, worker_pb2_grpc.PrefillWorkerStub(channel))

    def _close_later(self, link: _Link) -> None:
        self._closing.spawn(link.closable.close())

    async def close(self) -> None:
        links, self._links = list(self._links.values()), OrderedDict()
        for link in links:
            self._close_later(link)
        await self._closing.wait()
