"""``ColocatedWorker.Generate``: the same engine runs prefill (chunked) and decode.

The role programs against the engine contract (``pdrouter.worker.engine_contract.ServingEngine``),
so the same servicer serves the project's engine and vLLM."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import aclosing

import grpc

from pdrouter.core.errors import InvalidRequestError
from pdrouter.core.ids import RequestId
from pdrouter.core.tracing import Tracing
from pdrouter.wire.convert import prompt_from_pb, sampling_from_pb
from pdrouter.wire.grpc_util import grpc_errors
from pdrouter.wire.trace_context import traced
from pdrouter.wire.v1 import common_pb2, worker_pb2, worker_pb2_grpc
from pdrouter.worker.engine_contract import ServingEngine
from pdrouter.worker.role import RoleContext, Service
from pdrouter.worker.token_chunks import chunk_sink, token_chunks


class ColocatedServicer(worker_pb2_grpc.ColocatedWorkerServicer):
    """``ColocatedWorker.Generate``: prefill and decode on this worker's engine, every token streamed
    (``whole``: every token in one chunk at the end)."""

    def __init__(self, engine: ServingEngine, tracing: Tracing | None = None) -> None:
        """``tracing``: the process's tracer (each call continues its caller's trace, and the engine
        gets the context: vLLM's own spans join it)."""
        self.engine = engine
        self.tracing = tracing

    @traced("pdrouter.v1.ColocatedWorker/Generate")
    @grpc_errors
    async def Generate(self, request: worker_pb2.WorkerGenerateRequest,
                       context: grpc.aio.ServicerContext) -> AsyncIterator[common_pb2.TokenChunk]:
        if not request.request_id:
            raise InvalidRequestError("request_id is required")
        sampling = sampling_from_pb(request.sampling)
        prompt = prompt_from_pb(request)
        # aclosing: a cancelled call closes the stream at once, which aborts the engine request.
        trace = self.tracing.headers() if self.tracing is not None else None
        # Over the lane, a streamed token's chunk leaves as the engine delivers it (``chunk_sink``).
        sink = None if request.whole else chunk_sink(request.request_id, context)
        async with aclosing(self.engine.generate(RequestId(request.request_id), prompt, sampling,
                                                 cache_salt=request.cache_salt, trace_headers=trace,
                                                 priority=request.priority, whole=request.whole,
                                                 sink=sink)) as outputs:
            async for chunk in token_chunks(request.request_id, outputs, whole=request.whole):
                yield chunk


class ColocatedRole:
    """A colocated worker: the ``ColocatedWorker`` service; it holds no KV transport."""

    kv_address = ""

    def __init__(self, servicer: ColocatedServicer) -> None:
        self.servicer = servicer

    def services(self) -> list[Service]:
        return [Service(worker_pb2_grpc.add_ColocatedWorkerServicer_to_server, self.servicer,
                        "pdrouter.v1.ColocatedWorker")]

    async def close(self) -> None:
        return None


async def build_colocated_role(ctx: RoleContext) -> ColocatedRole:
    return ColocatedRole(ColocatedServicer(ctx.engine, ctx.tracing))
