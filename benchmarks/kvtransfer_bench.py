"""KV transfer throughput and latency on loopback, between two processes.

Figures (one per line, ``name: value unit``; ``--json`` prints one JSON object instead):

- ``raw_socket_gbps``: a plain TCP socket moving the same bytes from the same pool memory, with
  the transport's system-call pattern (``sendall`` of 256 KiB pieces, ``recv_into(MSG_WAITALL)``
  of 1 MiB pieces, which beat multi-MiB pieces on loopback) and socket options, but no framing
  and no checksum: the physical baseline of this machine.
- ``tcp_layerwise_gbps``: ``KvSender`` → ``KvReceiver`` over TCP, one request of Llama-3-8B-like
  geometry (32 layers, 8 KV heads, head_dim 128, bf16, block 16: 128 KiB per token) sent layer by
  layer, from ``open_transfer`` to ``finish`` returning (checksums on).
- ``tcp_vs_raw_ratio``: the two above divided (target >= 0.85).
- ``tcp_no_checksum_gbps``: the same TCP transfer with per-frame checksums turned off (what they cost).
- ``gloo_layerwise_gbps``: the same request through the gloo backend.
- ``tcp_one_block_latency_ms`` / ``gloo_one_block_latency_ms``: median time to move one block
  (16 tokens, all 32 layers: 2 MiB) on a warm connection.

Each throughput figure is the median of several repetitions, run interleaved (raw, tcp, tcp
without checksums, gloo, raw, ...) after one warm-up each, so that noise from other work on the
machine hits them alike. The receiving side runs in a separate process; both pools are CPU
tensors; the last transfer is checked bit for bit. ``--quick`` moves 128 MiB instead of 512.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import socket
import statistics
import time
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

import torch

from pdrouter.core.kv_layout import KvLayout
from pdrouter.transfer import Backend, KvReceiver, KvSender, TransferConfig, TransferTarget, new_epoch
from pdrouter.transfer.pool_view import checksum

TOKEN = "kvtransfer-bench"
SEND_PIECE = 256 << 10
RECV_PIECE = 1 << 20
SOCKET_BUFFER = 4 << 20


@dataclass(frozen=True)
class Plan:
    tokens: int
    reps: int
    latency_reps: int

    @property
    def blocks(self) -> int:
        return self.tokens // 16

    def layout(self) -> KvLayout:
        return KvLayout(num_layers=32, num_kv_heads=8, head_dim=128, block_size=16,
                        num_blocks=self.blocks + 8, dtype="bfloat16")

    def transfer_bytes(self) -> int:
        return self.blocks * self.layout().block_bytes


# -- receiving process --------------------------------------------------------------------------

def _tune(sock: socket.socket) -> None:
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SOCKET_BUFFER)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, SOCKET_BUFFER)


def _raw_sink(listener: socket.socket, memory: memoryview, nbytes: int) -> None:
    conn, _ = listener.accept()
    listener.close()
    _tune(conn)
    with conn:
        while True:
            for start in range(0, nbytes, RECV_PIECE):
                view = memory[start:min(start + RECV_PIECE, nbytes)]
                while len(view):
                    got = conn.recv_into(view, 0, socket.MSG_WAITALL)
                    if not got:
                        return
                    view = view[got:]
            conn.sendall(b"k")


def receiver_main(pipe: Connection, plan: Plan) -> None:
    import threading

    layout = plan.layout()
    pool = torch.zeros(layout.shape, dtype=torch.bfloat16)
    pool.view(torch.uint8).view(-1).fill_(1)  # fault the pages in before timing anything
    receivers = {b: KvReceiver(pool, layout, TransferConfig(auth_token=TOKEN, epoch=new_epoch(), backend=b,
                                                            socket_buffer_bytes=SOCKET_BUFFER))
                 for b in (Backend.TCP, Backend.GLOO)}
    handles: dict[str, Any] = {}
    try:
        while True:
            cmd, *args = pipe.recv()
            if cmd == "raw":
                listener = socket.create_server(("127.0.0.1", 0))
                memory = pool.view(-1).view(torch.uint8).numpy().data
                threading.Thread(target=_raw_sink, args=(listener, memory, args[0]), daemon=True).start()
                pipe.send(listener.getsockname()[1])
            elif cmd == "expect":
                backend, tid, blocks = args
                handle = receivers[backend].expect(tid, blocks, timeout_s=120)
                handles[tid] = handle
                pipe.send(handle.target)
            elif cmd == "wait":
                handle = handles.pop(args[0])
                handle.wait_all(60)
                pipe.send(handle.state.value)
            elif cmd == "digest":
                blocks = args[0]
                pipe.send(checksum(pool[:, :, b].contiguous().view(torch.uint8).numpy().data for b in blocks))
            elif cmd == "quit":
                return
    finally:
        for receiver in receivers.values():
            receiver.close()


# -- sending process ----------------------------------------------------------------------------

class Bench:
    def __init__(self, plan: Plan) -> None:
        self.plan = plan
        self.layout = plan.layout()
        self.pool = torch.empty(self.layout.shape, dtype=torch.bfloat16)
        self.pool.view(torch.int16).random_()
        ctx = mp.get_context("spawn")
        self.pipe, child = ctx.Pipe()
        self.child = ctx.Process(target=receiver_main, args=(child, plan), daemon=True)
        self.child.start()
        self.senders = {b: KvSender(self.pool, self.layout, TransferConfig(
            auth_token=TOKEN, epoch=new_epoch(), backend=b, socket_buffer_bytes=SOCKET_BUFFER))
            for b in (Backend.TCP, Backend.GLOO)}
        self.unchecked = KvSender(self.pool, self.layout, TransferConfig(
            auth_token=TOKEN, epoch=new_epoch(), socket_buffer_bytes=SOCKET_BUFFER, checksums=False))
        self.blocks = list(range(plan.blocks))
        self._seq = 0
        self.raw = socket.create_connection(("127.0.0.1", self.call("raw", plan.transfer_bytes())))
        _tune(self.raw)

    def call(self, *msg: Any) -> Any:
        self.pipe.send(msg)
        return self.pipe.recv()

    def raw_round(self) -> float:
        nbytes = self.plan.transfer_bytes()
        memory = self.pool.view(-1).view(torch.uint8).numpy().data
        start = time.perf_counter()
        for offset in range(0, nbytes, SEND_PIECE):
            self.raw.sendall(memory[offset:min(offset + SEND_PIECE, nbytes)])
        if self.raw.recv(1) != b"k":
            raise RuntimeError("the raw sink went away")
        return time.perf_counter() - start

    def transfer(self, backend: Backend, blocks: list[int], layerwise: bool, checksums: bool = True) -> float:
        self._seq += 1
        tid = f"bench-{self._seq}"
        target: TransferTarget = self.call("expect", backend, tid, blocks)
        sender = self.senders[backend] if checksums else self.unchecked
        start = time.perf_counter()
        transfer = sender.open_transfer(target)
        if layerwise:
            for layer in range(self.layout.num_layers):
                transfer.send_layers(blocks, layer)
        else:
            transfer.send_layers(blocks)
        transfer.finish(60)
        elapsed = time.perf_counter() - start
        state = self.call("wait", tid)
        if state != "done":
            raise RuntimeError(f"{backend} transfer ended {state}")
        return elapsed

    def verify(self) -> None:
        """The last transfer landed bit-exact (blocks 0.. on both sides)."""
        theirs = self.call("digest", self.blocks)
        ours = checksum(self.pool[:, :, b].contiguous().view(torch.uint8).numpy().data for b in self.blocks)
        if theirs != ours:
            raise RuntimeError("received blocks differ from the sent ones")

    def close(self) -> None:
        self.raw.close()
        for sender in (*self.senders.values(), self.unchecked):
            sender.close()
        self.pipe.send(("quit",))
        self.child.join(30)


def run(plan: Plan) -> dict[str, float]:
    bench = Bench(plan)
    try:
        nbytes = plan.transfer_bytes()
        raw_times: list[float] = []
        tcp_times: list[float] = []
        unchecked_times: list[float] = []
        gloo_times: list[float] = []
        bench.raw_round()  # warm-ups: connect, fault pages in
        bench.transfer(Backend.TCP, bench.blocks, layerwise=True)
        bench.transfer(Backend.TCP, bench.blocks, layerwise=True, checksums=False)
        bench.transfer(Backend.GLOO, bench.blocks, layerwise=True)
        for _ in range(plan.reps):
            raw_times.append(bench.raw_round())
            tcp_times.append(bench.transfer(Backend.TCP, bench.blocks, layerwise=True))
            unchecked_times.append(bench.transfer(Backend.TCP, bench.blocks, layerwise=True, checksums=False))
            gloo_times.append(bench.transfer(Backend.GLOO, bench.blocks, layerwise=True))
        bench.verify()
        one_block = [bench.blocks[0]]
        tcp_lat = [bench.transfer(Backend.TCP, one_block, layerwise=False) for _ in range(plan.latency_reps)]
        gloo_lat = [bench.transfer(Backend.GLOO, one_block, layerwise=False) for _ in range(plan.latency_reps)]
    finally:
        bench.close()
    raw = nbytes / statistics.median(raw_times) / 1e9
    tcp = nbytes / statistics.median(tcp_times) / 1e9
    return {
        "transfer_mib": nbytes / (1 << 20),
        "raw_socket_gbps": raw,
        "tcp_layerwise_gbps": tcp,
        "tcp_vs_raw_ratio": tcp / raw,
        "tcp_no_checksum_gbps": nbytes / statistics.median(unchecked_times) / 1e9,
        "gloo_layerwise_gbps": nbytes / statistics.median(gloo_times) / 1e9,
        "tcp_one_block_latency_ms": statistics.median(tcp_lat) * 1e3,
        "gloo_one_block_latency_ms": statistics.median(gloo_lat) * 1e3,
    }


UNITS = {"transfer_mib": "MiB", "tcp_vs_raw_ratio": "x"}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="128 MiB and fewer repetitions (< 30 s)")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of lines")
    args = parser.parse_args(argv)
    plan = Plan(tokens=1024, reps=3, latency_reps=20) if args.quick else Plan(tokens=4096, reps=5,
                                                                               latency_reps=50)
    figures = run(plan)
    if args.json:
        print(json.dumps({k: round(v, 4) for k, v in figures.items()}))
    else:
        for name, value in figures.items():
            unit = UNITS.get(name) or ("GB/s" if name.endswith("gbps") else "ms")
            print(f"{name}: {value:.3f} {unit}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
