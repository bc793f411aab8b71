"""What a minimal Python design of the KV transport reaches for one block, beside the raw socket.

``kv_transfer_bench.py`` compares one 2 MiB block moved by the transport (with its MACs) to the raw
socket moving the same bytes. This benchmark answers the question behind that ratio: how close can a
transport written in Python, with the transport's threads and MACs, come to the raw socket on this
machine? It moves the same block (Llama-3-8B geometry, 16 tokens: 32 layers × K|V ranges of
32 KiB, read from and written into a pool laid out ``[layer, K|V, block, ...]``) between two
processes in three ways, in turn, round by round:

- ``raw``: ``sendmsg`` of the block's ranges in 256 KiB gathers; the receiver scatters them into
  its pool with ``recvmsg_into(MSG_WAITALL)`` and answers one byte (the bound);
- ``floor``: a 100-byte header in the first write and a 16-byte tag behind the last, each 256 KiB
  hashed with AES-GMAC after it is written (as the transport does) and by the receiver after it is
  read, and a 60-byte answer that the sender's own reader thread receives and hands to the waiting
  caller through a ``threading.Condition`` (the transport's hand-off);
- ``floor_direct``: the same, but the caller reads the answer itself (one thread wake-up fewer).

Nothing else: no frame plan, no expectations, no checks, no credit. It is not a transport; it is the
cost of the parts that no transport with these threads and MACs can leave out.

Figures (``name: value unit``; ``--json`` prints one object): ``raw_one_block_latency_ms``,
``floor_one_block_latency_ms``, ``floor_direct_one_block_latency_ms`` (medians) and
``floor_vs_raw_ratio`` / ``floor_direct_vs_raw_ratio`` (the median of the rounds' ratios).
``--quick`` runs 200 rounds instead of 600. TCP congestion control: reno where the kernel allows it
(``docs/benchmarks.md``: the host's BBR paces loopback connections by luck), else the host's.

    python benchmarks/kv_block_floor.py [--quick] [--json]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import socket
import statistics
import threading
import time
from multiprocessing.connection import Connection
from pathlib import Path

from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes

LAYERS, HALF_BLOCK, BLOCKS = 32, 32 << 10, 72
"""32 layers; one block's K (or V) in one layer: 16 tokens × 8 heads × 128 × 2 bytes; a pool of 72 blocks."""
POOL_BYTES = LAYERS * 2 * BLOCKS * HALF_BLOCK
PER_WRITE = 8
"""Ranges per ``sendmsg`` (8 × 32 KiB = 256 KiB, the transport's piece)."""
HEADER, TAG, ANSWER = 100, 16, 60
KEY = bytes(range(32))


def _ranges(memory: memoryview, block: int) -> list[memoryview]:
    """The block's 64 ranges (each layer's K, then V) in payload order."""
    out = []
    for layer in range(LAYERS):
        for kv in (0, 1):
            start = ((layer * 2 + kv) * BLOCKS + block) * HALF_BLOCK
            out.append(memory[start:start + HALF_BLOCK])
    return out


def _tune(sock: socket.socket, congestion: str | None) -> None:
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    if congestion:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_CONGESTION, congestion.encode())
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4 << 20)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4 << 20)


def _gmac() -> object:
    return Cipher(algorithms.AES(KEY), modes.GCM(bytes(12))).encryptor()


def _serve(conn: socket.socket, ranges: list[memoryview], framed: bool, congestion: str | None) -> None:
    _tune(conn, congestion)
    header, tag = bytearray(HEADER), bytearray(TAG)
    halves = (ranges[:len(ranges) // 2], ranges[len(ranges) // 2:])
    while True:
        if framed:
            if conn.recv_into(header, HEADER, socket.MSG_WAITALL) < HEADER:
                return
            mac = _gmac()
            for i, half in enumerate(halves):  # 1 MiB, hashed once read; the tag comes with the last
                conn.recvmsg_into([*half, memoryview(tag)] if i else half, 0, socket.MSG_WAITALL)
                for piece in half:
                    mac.authenticate_additional_data(piece)  # type: ignore[attr-defined]
            mac.finalize()  # type: ignore[attr-defined]
            conn.sendall(bytes(ANSWER))
        else:
            for half in halves:
                if conn.recvmsg_into(half, 0, socket.MSG_WAITALL)[0] == 0:
                    return
            conn.sendall(b"k")


def _receiver(pipe: Connection, congestion: str | None) -> None:
    pool = bytearray(POOL_BYTES)
    pool[:] = b"\x01" * POOL_BYTES  # fault the pages in
    ranges = _ranges(memoryview(pool), 0)
    listener = socket.create_server(("127.0.0.1", 0))
    pipe.send(listener.getsockname()[1])
    for framed in (False, True, True):
        conn, _ = listener.accept()
        threading.Thread(target=_serve, args=(conn, ranges, framed, congestion), daemon=True).start()
    pipe.recv()


class _Sender:
    def __init__(self, port: int, congestion: str | None) -> None:
        pool = bytearray(POOL_BYTES)
        pool[:] = b"\x02" * POOL_BYTES
        self._pool = pool
        self.ranges = _ranges(memoryview(pool), 0)
        self.socks = []
        for _ in range(3):
            sock = socket.create_connection(("127.0.0.1", port))
            _tune(sock, congestion)
            self.socks.append(sock)
            time.sleep(0.05)  # accepted in this order
        self._cv = threading.Condition()
        self._answers = 0
        threading.Thread(target=self._reader, daemon=True).start()

    def _reader(self) -> None:
        buf = bytearray(ANSWER)
        while self.socks[1].recv_into(buf, ANSWER, socket.MSG_WAITALL) == ANSWER:
            with self._cv:
                self._answers += 1
                self._cv.notify_all()

    def raw(self) -> float:
        sock = self.socks[0]
        start = time.perf_counter()
        for i in range(0, len(self.ranges), PER_WRITE):
            sock.sendmsg(self.ranges[i:i + PER_WRITE])
        sock.recv(1)
        return time.perf_counter() - start

    def floor(self, direct: bool) -> float:
        sock = self.socks[2 if direct else 1]
        start = time.perf_counter()
        with self._cv:
            wanted = self._answers + 1
        mac = _gmac()
        last = len(self.ranges) - PER_WRITE
        for i in range(0, len(self.ranges), PER_WRITE):
            batch = self.ranges[i:i + PER_WRITE]
            sock.sendmsg(([bytes(HEADER)] if i == 0 else []) + batch + ([bytes(TAG)] if i == last else []))
            for piece in batch:
                mac.authenticate_additional_data(piece)  # type: ignore[attr-defined]
        mac.finalize()  # type: ignore[attr-defined]
        if direct:
            sock.recv_into(bytearray(ANSWER), ANSWER, socket.MSG_WAITALL)
        else:
            with self._cv:
                self._cv.wait_for(lambda: self._answers >= wanted)
        return time.perf_counter() - start


def _congestion() -> str | None:
    try:
        allowed = Path("/proc/sys/net/ipv4/tcp_allowed_congestion_control").read_text().split()
    except OSError:
        return None
    return "reno" if "reno" in allowed else None


def run(rounds: int) -> dict[str, float]:
    congestion = _congestion()
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_receiver, args=(child, congestion), daemon=True)
    proc.start()
    try:
        sender = _Sender(parent.recv(), congestion)
        runs = {"raw": sender.raw, "floor": lambda: sender.floor(False), "floor_direct": lambda: sender.floor(True)}
        times: dict[str, list[float]] = {name: [] for name in runs}
        order = list(runs)
        for i in range(rounds + 20):
            order = order[1:] + order[:1]
            for name in order:
                elapsed = runs[name]()
                if i >= 20:  # warm-up rounds dropped
                    times[name].append(elapsed)
        figures = {f"{name}_one_block_latency_ms": statistics.median(t) * 1e3 for name, t in times.items()}
        for name in ("floor", "floor_direct"):
            figures[f"{name}_vs_raw_ratio"] = statistics.median(
                a / b for a, b in zip(times[name], times["raw"], strict=True))
        figures["reno"] = float(congestion == "reno")
        return figures
    finally:
        parent.send("quit")
        proc.join(10)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="200 rounds instead of 600 (< 30 s)")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of lines")
    args = parser.parse_args()
    figures = run(200 if args.quick else 600)
    if args.json:
        print(json.dumps({k: round(v, 4) for k, v in figures.items()}))
    else:
        for name, value in figures.items():
            unit = "bool" if name == "reno" else "x" if name.endswith("ratio") else "ms"
            print(f"{name}: {value:.3f} {unit}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
