"""The ``WorkerInfoService`` every worker serves: its record, model geometry and KV layout, and its live load."""

from __future__ import annotations

from collections.abc import Callable

import grpc

from pdrouter.core.workers import WorkerLoad, WorkerRecord
from pdrouter.wire.convert import load_to_pb, record_to_pb
from pdrouter.wire.v1 import common_pb2, worker_pb2, worker_pb2_grpc


class WorkerInfoServicer(worker_pb2_grpc.WorkerInfoServiceServicer):
    """``GetInfo`` / ``GetLoad`` from the worker's record and a live load callback."""

    def __init__(self, info: Callable[[], WorkerRecord], load: Callable[[], WorkerLoad],
                 geometry: common_pb2.ModelGeometry, kv_layout: common_pb2.KvLayout) -> None:
        self._info = info
        self._load = load
        self._geometry = geometry
        self._kv_layout = kv_layout

    async def GetInfo(self, request: worker_pb2.GetInfoRequest,
                      context: grpc.aio.ServicerContext) -> common_pb2.WorkerInfo:
        msg = record_to_pb(self._info())
        msg.model.CopyFrom(self._geometry)
        msg.kv_layout.CopyFrom(self._kv_layout)
        return msg

    async def GetLoad(self, request: worker_pb2.GetLoadRequest,
                      context: grpc.aio.ServicerContext) -> common_pb2.WorkerLoad:
        return load_to_pb(self._load())
