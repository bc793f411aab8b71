"""The floor of a Python gRPC server: ``pdrouter.v1.Router/Generate`` on ``grpc.aio``, doing nothing else.

Each call answers the request's ``max_tokens`` token ids in one message, without reading the prompt,
admitting, placing or reaching a worker: what grpcio's asyncio server itself costs per server-streaming
call, next to which the router's gRPC door is measured (``benchmarks/router_overhead.py``). It runs on
the event loop the router runs on (``pdrouter.core.aio.event_loop_factory``: uvloop when installed),
so that the two differ by the router's work only.

    python benchmarks/_grpc_floor.py --port N
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import signal

import grpc

from pdrouter.core.aio import event_loop_factory
from pdrouter.wire.v1 import router_pb2, router_pb2_grpc


class Floor(router_pb2_grpc.RouterServicer):
    async def Generate(self, request: router_pb2.GenerateRequest,  # type: ignore[override]
                       context: grpc.aio.ServicerContext) -> None:
        await context.write(router_pb2.GenerateResponse(token_ids=list(range(request.sampling.max_tokens))))


async def serve(port: int) -> None:
    server = grpc.aio.server()
    router_pb2_grpc.add_RouterServicer_to_server(Floor(), server)
    server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    await server.stop(1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--port", type=int, required=True)
    args = parser.parse_args()
    with contextlib.suppress(KeyboardInterrupt), asyncio.Runner(loop_factory=event_loop_factory()) as runner:
        runner.run(serve(args.port))


if __name__ == "__main__":
    main()
