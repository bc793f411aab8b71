"""KV transfer throughput and latency on loopback, between two processes.

Figures (one per line, ``name: value unit``; ``--json`` prints one JSON object instead):

- ``raw_socket_gbps``: a plain TCP socket moving the same bytes from the same pool memory, with
  the transport's system-call pattern (``sendall`` of 256 KiB pieces, ``recv_into(MSG_WAITALL)``
  of 1 MiB pieces, which beat multi-MiB pieces on loopback) and socket options, but no framing
  and no MAC: the physical baseline of this machine.
- ``tcp_mac_gbps``: ``KvSender`` → ``KvReceiver`` over TCP with the default configuration, one
  request of Llama-3-8B-like geometry (32 layers, 8 KV heads, head_dim 128, bf16, block 16: 128 KiB
  per token) sent layer by layer, from ``open_transfer`` to ``finish`` returning, every frame
  carrying its MAC (AES-GMAC under the connection's keys).
- ``tcp_mac_vs_raw_ratio``: the two above divided (target >= 0.8).
- ``tcp_mac_offload_gbps`` / ``tcp_mac_inline_gbps``: the same with the payload MACs forced onto a
  helper thread beside the socket's (``mac_offload=True``), or into the socket's own thread
  (``False``); the default picks the helper with 4 cores or more: what the overlap buys here.
- ``tls_mac_gbps``: the same over mutual TLS (certificates from ``trustme``), frame MACs kept;
  ``tls_gbps``: TLS alone authenticating the payloads (``payload_macs=False``; headers keep theirs).
- ``gloo_layerwise_gbps``: the same request through the gloo backend (MACs on its control frames).
- ``tcp_one_block_latency_ms`` / ``tls_one_block_latency_ms`` / ``gloo_one_block_latency_ms``:
  median time to move one block (16 tokens, all 32 layers: 2 MiB) on a warm connection.
- ``tcp_one_block_vs_raw_ratio``: one block over TCP with its MACs ÷ the raw socket moving the same
  bytes, measured in turn, pair by pair (the median of 300 pairs, 100 with ``--quick``; ``..._p10`` /
  ``..._p90`` the spread).
- ``tcp_one_block_announced_latency_ms`` / ``tcp_one_block_announced_vs_raw_ratio``: the same pair, the
  transfer opened and announced (``OutgoingTransfer.announce``) ``ANNOUNCE_LEAD_S`` before its first
  layer, untimed, as a prefill worker does while a prompt computes (the raw socket idles as long before
  each of its rounds): from the KV being ready to the receiver's confirmation.
  ``raw_one_block_after_idle_latency_ms``: the raw socket's median in those pairs (after its idle).
- ``raw_cpu_ns_per_byte``, ``tcp_mac_cpu_ns_per_byte``, ...: CPU time both processes spent per
  byte moved (all their threads, user and system): what each variant costs, whatever else the
  machine is doing (the throughputs depend on free cores; these much less).

``--vs REV`` also moves the block with commit ``REV``'s transport, in the same processes and in
turn with this tree's and the raw socket's, so that the machine's drift hits all three alike (its
``pdrouter`` package exported with ``git archive`` under another name, ``pdrouter_vs``):
``vs_tcp_one_block_latency_ms``, ``vs_tcp_one_block_vs_raw_ratio`` and
``tcp_one_block_vs_other_ratio`` (this tree ÷ ``REV``, the median of the rounds' ratios, with its
10th and 90th percentiles).

The unkeyed xxh3 checksum the transport used before frame MACs is gone (wire version 2), so there
is no checksum figure any more; ``raw_socket_gbps`` is the bound either way.

Each throughput figure is the median of several repetitions, run interleaved (raw, tcp, tcp
inline, tls, ..., raw, ...) after one warm-up each, so that noise from other work on the machine
hits them alike. The receiving side runs in a separate process; both pools are CPU tensors; the
last transfer is checked bit for bit. ``--quick`` moves 128 MiB instead of 512.

``--tcp-congestion ALG`` sets every socket's TCP congestion control, the raw ones, the transport's
(``TransferConfig.tcp_congestion``) and ``--vs``'s alike; ``tcp_congestion`` names the one in effect
(the host's default unless set). Where the host's default is BBR, its pacing moves every figure here,
and by how much depends on each connection's own bandwidth estimate: compare trees with
``--vs REV --tcp-congestion reno`` (``docs/benchmarks.md``).

``--pin`` keeps the sending process (and every thread it starts) on one core and the receiving one
on another (``pinned`` says whether it did: it needs two cores). Unpinned, the scheduler may put
both ends of the raw socket on one core, where its copies take turns: on a 2-core machine one
block's raw time is then about 0.85 ms instead of about 0.35, and moves between the two from one
minute to the next. Pinned, the raw socket gets its physical best; the transport, whose threads
on each side then share one core, does not.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import importlib
import json
import multiprocessing as mp
import os
import re
import secrets
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import torch
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes

from pdrouter.core.errors import ConfigError
from pdrouter.core.kv_layout import KvLayout
from pdrouter.core.tls import TlsFiles
from pdrouter.testing.pki import TestCa
from pdrouter.transfer import Backend, KvReceiver, KvSender, TransferConfig, TransferTarget, new_epoch
from pdrouter.transfer.config import check_tcp_congestion, host_tcp_congestion
from pdrouter.transfer.pool_view import checksum

TOKEN = secrets.token_hex(16)
VARIANTS = ("mac", "mac_offload", "mac_inline", "tls_mac", "tls", "gloo")
"""The transports measured: name → ``TransferConfig`` fields (``variant_config``)."""
SEND_PIECE = 256 << 10
ANNOUNCE_LEAD_S = 0.001
"""How long before its first layer the announced transfer is announced (``ANNOUNCE_AFTER_S`` of
``pdrouter.worker.roles.prefill``: a prompt computing 2 ms or more)."""
RECV_PIECE = 1 << 20
SOCKET_BUFFER = 4 << 20


@dataclass(frozen=True)
class Plan:
    tokens: int
    reps: int
    latency_reps: int
    pair_reps: int = 0
    """Pairs (raw socket and transport in turn) behind each one-block ratio (0: ``latency_reps``)."""
    tcp_congestion: str | None = None
    """Every socket's TCP congestion control, raw and transport alike (None: the host's default)."""

    @property
    def blocks(self) -> int:
        return self.tokens // 16

    def layout(self) -> KvLayout:
        return KvLayout(num_layers=32, num_kv_heads=8, head_dim=128, block_size=16,
                        num_blocks=self.blocks + 8, dtype="bfloat16")

    def transfer_bytes(self) -> int:
        return self.blocks * self.layout().block_bytes


@dataclass(frozen=True)
class Pki:
    """A CA and two certificates (receiver for 127.0.0.1, sender) as PEM files (``pdrouter.testing.pki``)."""

    receiver: TlsFiles
    sender: TlsFiles

    @classmethod
    def create(cls, folder: Path) -> Pki:
        ca = TestCa(folder, "bench")
        return cls(ca.issue("receiver"), ca.issue("sender", "prefill.bench"))


def variant_config(variant: str, tls: TlsFiles, token: str, congestion: str | None = None) -> TransferConfig:
    options: dict[str, dict[str, Any]] = {
        "mac": {},
        "mac_offload": {"mac_offload": True},
        "mac_inline": {"mac_offload": False},
        "tls_mac": {"tls": tls},
        "tls": {"tls": tls, "payload_macs": False},
        "gloo": {"backend": Backend.GLOO},
    }
    return TransferConfig(auth_token=token, epoch=new_epoch(), socket_buffer_bytes=SOCKET_BUFFER,
                          tcp_congestion=congestion, **options[variant])


# -- receiving process --------------------------------------------------------------------------

def _tune(sock: socket.socket, congestion: str | None) -> None:
    if congestion:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_CONGESTION, congestion.encode())
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SOCKET_BUFFER)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, SOCKET_BUFFER)


def _gmac() -> Any:
    """An AES-GMAC context as the transport's payload MACs use (``raw_gmac``: the cost of the MAC alone)."""
    return Cipher(algorithms.AES(bytes(32)), modes.GCM(bytes(12))).encryptor()


def _raw_sink(listener: socket.socket, memory: memoryview, congestion: str | None, nbytes: int,
              mac: bool = False) -> None:
    conn, _ = listener.accept()
    listener.close()
    _tune(conn, congestion)
    with conn:
        while True:
            ctx = _gmac() if mac else None
            for start in range(0, nbytes, RECV_PIECE):
                view = memory[start:min(start + RECV_PIECE, nbytes)]
                piece = view
                while len(view):
                    got = conn.recv_into(view, 0, socket.MSG_WAITALL)
                    if not got:
                        return
                    view = view[got:]
                if ctx is not None:
                    ctx.authenticate_additional_data(piece)
            if ctx is not None:
                ctx.finalize()
            conn.sendall(b"k")


REPO = Path(__file__).resolve().parent.parent
VS_PACKAGE = "pdrouter_vs"


def export_renamed(rev: str, into: Path) -> None:
    """Commit ``rev``'s ``pdrouter`` package as ``VS_PACKAGE`` in ``into``, its imports renamed, so
    that both trees' transports load in one process."""
    archive = subprocess.run(["git", "-C", str(REPO), "archive", rev, "pdrouter"], check=True,
                             capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive, check=True)
    (into / "pdrouter").rename(into / VS_PACKAGE)
    imports = re.compile(r"^(\s*)(from|import) pdrouter(?=[ .])", re.MULTILINE)
    for path in (into / VS_PACKAGE).rglob("*.py"):
        path.write_text(imports.sub(rf"\1\2 {VS_PACKAGE}", path.read_text()))


def vs_transfer(folder: str | None, congestion: str | None = None) -> Any:
    """The other tree's ``transfer`` package (``--vs``), or None. With ``congestion``, its sockets get
    that TCP congestion control as they are wrapped (a tree before ``tcp_congestion`` cannot be told)."""
    if folder is None:
        return None
    if folder not in sys.path:
        sys.path.insert(0, folder)
    package = importlib.import_module(f"{VS_PACKAGE}.transfer")
    if congestion:
        framed = importlib.import_module(f"{VS_PACKAGE}.transfer.framed_socket").FramedSocket
        wrap = framed.__init__
        if not getattr(wrap, "sets_congestion", False):
            def init(self: Any, sock: socket.socket, *args: Any, **kwargs: Any) -> None:
                _tune(sock, congestion)
                wrap(self, sock, *args, **kwargs)

            init.sets_congestion = True  # type: ignore[attr-defined]
            framed.__init__ = init
    return package


def vs_layout(plan: Plan) -> Any:
    module = importlib.import_module(f"{VS_PACKAGE}.core.kv_layout")
    return module.KvLayout(**{f: getattr(plan.layout(), f) for f in (
        "num_layers", "num_kv_heads", "head_dim", "block_size", "num_blocks", "dtype")})


def vs_config(transfer: Any, token: str) -> Any:
    return transfer.TransferConfig(auth_token=token, epoch=transfer.new_epoch(), socket_buffer_bytes=SOCKET_BUFFER)


def pin_to(cpu: int | None) -> None:
    """Keep the calling thread, and every thread it starts from now on, on ``cpu`` (None: anywhere)."""
    if cpu is not None:
        os.sched_setaffinity(0, {cpu})


def placement(pin: bool) -> tuple[int | None, int | None]:
    """(sending process's core, receiving process's core): two different ones when ``pin`` and this
    process may run on two or more, else (None, None)."""
    cpus = sorted(os.sched_getaffinity(0))
    return (cpus[0], cpus[1]) if pin and len(cpus) >= 2 else (None, None)


def receiver_main(pipe: Connection, plan: Plan, tls: TlsFiles, token: str, vs_folder: str | None = None,
                  cpu: int | None = None) -> None:
    import threading

    pin_to(cpu)

    layout = plan.layout()
    pool = torch.zeros(layout.shape, dtype=torch.bfloat16)
    pool.view(torch.uint8).view(-1).fill_(1)  # fault the pages in before timing anything
    receivers = {v: KvReceiver(pool, layout, variant_config(v, tls, token, plan.tcp_congestion)) for v in VARIANTS}
    if (other := vs_transfer(vs_folder, plan.tcp_congestion)) is not None:
        receivers["vs"] = other.KvReceiver(pool, vs_layout(plan), vs_config(other, token))
    handles: dict[str, Any] = {}
    try:
        while True:
            cmd, *args = pipe.recv()
            if cmd == "raw":
                listener = socket.create_server(("127.0.0.1", 0))
                memory = pool.view(-1).view(torch.uint8).numpy().data
                threading.Thread(target=_raw_sink, args=(listener, memory, plan.tcp_congestion, *args),
                                 daemon=True).start()
                pipe.send(listener.getsockname()[1])
            elif cmd == "expect":
                variant, tid, blocks = args
                handle = receivers[variant].expect(tid, blocks, timeout_s=120)
                handles[tid] = handle
                pipe.send(handle.target)
            elif cmd == "wait":
                handle = handles.pop(args[0])
                handle.wait_all(60)
                pipe.send(handle.state.value)
            elif cmd == "digest":
                blocks = args[0]
                pipe.send(checksum(pool[:, :, b].contiguous().view(torch.uint8).numpy().data for b in blocks))
            elif cmd == "cpu":
                pipe.send(time.process_time())
            elif cmd == "quit":
                return
    finally:
        for receiver in receivers.values():
            receiver.close()


# -- sending process ----------------------------------------------------------------------------

class Bench:
    def __init__(self, plan: Plan, pki: Pki, vs_folder: str | None = None,
                 cpus: tuple[int | None, int | None] = (None, None)) -> None:
        self.plan = plan
        self.layout = plan.layout()
        self.pool = torch.empty(self.layout.shape, dtype=torch.bfloat16)
        self.pool.view(torch.int16).random_()
        ctx = mp.get_context("spawn")
        self.pipe, child = ctx.Pipe()
        self.child = ctx.Process(target=receiver_main, args=(child, plan, pki.receiver, TOKEN, vs_folder, cpus[1]),
                                 daemon=True)
        self.child.start()
        pin_to(cpus[0])  # before the senders: their connections' threads start on this core
        self.senders: dict[str, Any] = {
            v: KvSender(self.pool, self.layout, variant_config(v, pki.sender, TOKEN, plan.tcp_congestion))
            for v in VARIANTS}
        if (other := vs_transfer(vs_folder, plan.tcp_congestion)) is not None:
            self.senders["vs"] = other.KvSender(self.pool, vs_layout(plan), vs_config(other, TOKEN))
        self.blocks = list(range(plan.blocks))
        self._seq = 0
        self.raw = self._raw_link(plan.transfer_bytes(), mac=False)
        self.raw_gmac = self._raw_link(plan.transfer_bytes(), mac=True)
        self.raw_block = self._raw_link(self.layout.block_bytes, mac=False)

    def _raw_link(self, nbytes: int, *, mac: bool) -> socket.socket:
        sock = socket.create_connection(("127.0.0.1", self.call("raw", nbytes, mac)))
        _tune(sock, self.plan.tcp_congestion)
        return sock

    def call(self, *msg: Any) -> Any:
        self.pipe.send(msg)
        return self.pipe.recv()

    def raw_round(self, *, mac: bool = False, one_block: bool = False, lead_s: float = 0.0) -> float:
        """One round over a plain socket: the whole transfer (with ``mac``, AES-GMAC on both ends as
        each piece moves), or one block's bytes; until the sink's one-byte answer. ``lead_s``: idle
        that long first, untimed (as ``transfer``'s ``announce_s``)."""
        sock = self.raw_block if one_block else self.raw_gmac if mac else self.raw
        nbytes = self.layout.block_bytes if one_block else self.plan.transfer_bytes()
        memory = self.pool.view(-1).view(torch.uint8).numpy().data
        if lead_s:
            time.sleep(lead_s)
        start = time.perf_counter()
        ctx = _gmac() if mac else None
        for offset in range(0, nbytes, SEND_PIECE):
            piece = memory[offset:min(offset + SEND_PIECE, nbytes)]
            sock.sendall(piece)
            if ctx is not None:
                ctx.authenticate_additional_data(piece)
        if ctx is not None:
            ctx.finalize()
        if sock.recv(1) != b"k":
            raise RuntimeError("the raw sink went away")
        return time.perf_counter() - start

    def transfer(self, variant: str, blocks: list[int], layerwise: bool, announce_s: float | None = None) -> float:
        """One transfer of ``blocks``, from ``open_transfer`` to ``finish`` returning. ``announce_s``:
        opened and announced first, then that long idle (a prompt computing), untimed; timed from the
        first layer queued, as a prefill worker's transfer after its prompt computed."""
        self._seq += 1
        tid = f"bench-{self._seq}"
        target: TransferTarget = self.call("expect", variant, tid, blocks)
        sender = self.senders[variant]
        if announce_s is not None:
            transfer = sender.open_transfer(target)
            transfer.announce()
            time.sleep(announce_s)
            start = time.perf_counter()
        else:
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
            raise RuntimeError(f"{variant} transfer ended {state}")
        return elapsed

    def verify(self) -> None:
        """The last transfer landed bit-exact (blocks 0.. on both sides)."""
        theirs = self.call("digest", self.blocks)
        ours = checksum(self.pool[:, :, b].contiguous().view(torch.uint8).numpy().data for b in self.blocks)
        if theirs != ours:
            raise RuntimeError("received blocks differ from the sent ones")

    def close(self) -> None:
        for sock in (self.raw, self.raw_gmac, self.raw_block):
            sock.close()
        for sender in self.senders.values():
            sender.close()
        self.pipe.send(("quit",))
        self.child.join(30)


def vs_rounds(bench: Bench, reps: int) -> dict[str, float]:
    """One block with this tree's transport, ``--vs``'s and the raw socket, in turn (the order rotated
    each round): the other tree's latency and the rounds' median ratios."""
    one_block = [bench.blocks[0]]
    runs: dict[str, Callable[[], float]] = {
        "raw": functools.partial(bench.raw_round, one_block=True),
        "mac": functools.partial(bench.transfer, "mac", one_block, layerwise=False),
        "vs": functools.partial(bench.transfer, "vs", one_block, layerwise=False)}
    times: dict[str, list[float]] = {name: [] for name in runs}
    order = list(runs)
    for _ in range(reps):
        order = order[1:] + order[:1]
        for name in order:
            times[name].append(runs[name]())
    ours = sorted(m / v for m, v in zip(times["mac"], times["vs"], strict=True))
    return {"vs_tcp_one_block_latency_ms": statistics.median(times["vs"]) * 1e3,
            "vs_tcp_one_block_vs_raw_ratio": statistics.median(
                v / r for v, r in zip(times["vs"], times["raw"], strict=True)),
            "tcp_one_block_vs_other_ratio": statistics.median(ours),
            "tcp_one_block_vs_other_ratio_p10": ours[len(ours) // 10],
            "tcp_one_block_vs_other_ratio_p90": ours[len(ours) * 9 // 10]}


def run(plan: Plan, vs: str | None = None, pin: bool = False) -> dict[str, float]:
    with tempfile.TemporaryDirectory(prefix="kvbench-pki-") as folder:
        vs_folder = None
        if vs is not None:
            vs_folder = str(Path(folder) / "vs")
            Path(vs_folder).mkdir()
            export_renamed(vs, Path(vs_folder))
        cpus = placement(pin)
        bench = Bench(plan, Pki.create(Path(folder)), vs_folder, cpus)
        try:
            nbytes = plan.transfer_bytes()
            times: dict[str, list[float]] = {name: [] for name in ("raw", "raw_gmac", *VARIANTS)}
            cpu = dict.fromkeys(times, 0.0)

            def timed(name: str, run: Callable[[], float]) -> None:
                ours, theirs = time.process_time(), bench.call("cpu")
                times[name].append(run())
                cpu[name] += time.process_time() - ours + bench.call("cpu") - theirs

            bench.raw_round()  # warm-ups: connect, fault pages in
            bench.raw_round(mac=True)
            for variant in VARIANTS:
                bench.transfer(variant, bench.blocks, layerwise=True)
            for _ in range(plan.reps):
                timed("raw", bench.raw_round)
                timed("raw_gmac", functools.partial(bench.raw_round, mac=True))
                for variant in VARIANTS:
                    timed(variant, functools.partial(bench.transfer, variant, bench.blocks, layerwise=True))
                    if variant == "mac":
                        bench.verify()
            one_block = [bench.blocks[0]]
            latency = {v: statistics.median([bench.transfer(v, one_block, layerwise=False)
                                             for _ in range(plan.latency_reps)]) for v in ("mac", "tls_mac", "gloo")}
            latency["mac_layerwise"] = statistics.median([bench.transfer("mac", one_block, layerwise=True)
                                                          for _ in range(plan.latency_reps)])
            latency["raw"] = statistics.median([bench.raw_round(one_block=True) for _ in range(plan.latency_reps)])
            # The acceptance pair: raw and TCP with MACs in turn (the order swapped each time), so
            # that a burst of other load hits both; the ratio of each pair, then their median.
            pairs = []
            for i in range(plan.pair_reps or plan.latency_reps):
                tcp_first = i % 2 == 0
                first = bench.transfer("mac", one_block, layerwise=False) if tcp_first \
                    else bench.raw_round(one_block=True)
                second = bench.raw_round(one_block=True) if tcp_first \
                    else bench.transfer("mac", one_block, layerwise=False)
                pairs.append(first / second if tcp_first else second / first)
            pairs.sort()
            latency["pair_median"] = statistics.median(pairs)
            latency["pair_p10"] = pairs[len(pairs) // 10]
            latency["pair_p90"] = pairs[len(pairs) * 9 // 10]
            # The same, the transfer opened and announced while its prompt computes (the raw socket
            # idle as long first): from the KV being ready to its confirmation.
            announced, raw_idle, pairs = [], [], []
            for i in range(plan.pair_reps or plan.latency_reps):
                tcp_first = i % 2 == 0
                first = bench.transfer("mac", one_block, False, ANNOUNCE_LEAD_S) if tcp_first \
                    else bench.raw_round(one_block=True, lead_s=ANNOUNCE_LEAD_S)
                second = bench.raw_round(one_block=True, lead_s=ANNOUNCE_LEAD_S) if tcp_first \
                    else bench.transfer("mac", one_block, False, ANNOUNCE_LEAD_S)
                announced.append(first if tcp_first else second)
                raw_idle.append(second if tcp_first else first)
                pairs.append(first / second if tcp_first else second / first)
            pairs.sort()
            latency["announced"] = statistics.median(announced)
            latency["raw_after_idle"] = statistics.median(raw_idle)
            latency["announced_pair_median"] = statistics.median(pairs)
            latency["announced_pair_p10"] = pairs[len(pairs) // 10]
            latency["announced_pair_p90"] = pairs[len(pairs) * 9 // 10]
            other = vs_rounds(bench, plan.latency_reps * 5) if vs is not None else {}
        finally:
            bench.close()
    gbps = {name: nbytes / statistics.median(t) / 1e9 for name, t in times.items()}
    cpu_ns = {name: spent / (nbytes * plan.reps) * 1e9 for name, spent in cpu.items()}
    return {
        "pinned": float(cpus[0] is not None),
        "transfer_mib": nbytes / (1 << 20),
        "raw_socket_gbps": gbps["raw"],
        "tcp_mac_gbps": gbps["mac"],
        "tcp_mac_vs_raw_ratio": gbps["mac"] / gbps["raw"],
        "raw_gmac_gbps": gbps["raw_gmac"],
        "raw_gmac_vs_raw_ratio": gbps["raw_gmac"] / gbps["raw"],
        "tcp_mac_vs_raw_gmac_ratio": gbps["mac"] / gbps["raw_gmac"],
        "tcp_mac_offload_gbps": gbps["mac_offload"],
        "tcp_mac_inline_gbps": gbps["mac_inline"],
        "tls_mac_gbps": gbps["tls_mac"],
        "tls_gbps": gbps["tls"],
        "tls_mac_vs_raw_ratio": gbps["tls_mac"] / gbps["raw"],
        "gloo_layerwise_gbps": gbps["gloo"],
        "raw_cpu_ns_per_byte": cpu_ns["raw"],
        "raw_gmac_cpu_ns_per_byte": cpu_ns["raw_gmac"],
        "tcp_mac_cpu_ns_per_byte": cpu_ns["mac"],
        "tcp_mac_offload_cpu_ns_per_byte": cpu_ns["mac_offload"],
        "tcp_mac_inline_cpu_ns_per_byte": cpu_ns["mac_inline"],
        "tls_mac_cpu_ns_per_byte": cpu_ns["tls_mac"],
        "raw_one_block_latency_ms": latency["raw"] * 1e3,
        "tcp_one_block_latency_ms": latency["mac"] * 1e3,
        "tcp_one_block_layerwise_latency_ms": latency["mac_layerwise"] * 1e3,
        "tls_one_block_latency_ms": latency["tls_mac"] * 1e3,
        "gloo_one_block_latency_ms": latency["gloo"] * 1e3,
        "tcp_one_block_vs_raw_ratio": latency["pair_median"],
        "tcp_one_block_vs_raw_ratio_p10": latency["pair_p10"],
        "tcp_one_block_vs_raw_ratio_p90": latency["pair_p90"],
        "tcp_one_block_announced_latency_ms": latency["announced"] * 1e3,
        "raw_one_block_after_idle_latency_ms": latency["raw_after_idle"] * 1e3,
        "tcp_one_block_announced_vs_raw_ratio": latency["announced_pair_median"],
        "tcp_one_block_announced_vs_raw_ratio_p10": latency["announced_pair_p10"],
        "tcp_one_block_announced_vs_raw_ratio_p90": latency["announced_pair_p90"],
        **other,
    }


UNITS = {"transfer_mib": "MiB", "pinned": "bool"}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="128 MiB and fewer repetitions (< 30 s)")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of lines")
    parser.add_argument("--vs", default=None, metavar="REV",
                        help="also move one block with commit REV's transport, in turn with this tree's")
    parser.add_argument("--pin", action="store_true",
                        help="keep the sending process on one core and the receiving one on another")
    parser.add_argument("--tcp-congestion", default=None, metavar="ALGORITHM",
                        help="TCP congestion control of every socket, raw and transport alike (default: the host's)")
    args = parser.parse_args(argv)
    if args.tcp_congestion is not None:
        try:
            check_tcp_congestion(args.tcp_congestion)
        except ConfigError as exc:
            parser.error(f"--tcp-congestion: {exc}")
    plan = Plan(tokens=1024, reps=3, latency_reps=20, pair_reps=100) if args.quick else Plan(
        tokens=4096, reps=5, latency_reps=50, pair_reps=300)
    plan = dataclasses.replace(plan, tcp_congestion=args.tcp_congestion)
    congestion = args.tcp_congestion or host_tcp_congestion()
    if args.vs is not None:
        probe = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--verify", "--quiet", f"{args.vs}^{{commit}}"],
                               capture_output=True, text=True)
        if probe.returncode != 0:
            parser.error(f"--vs {args.vs}: not a commit of this repository")
    figures = run(plan, args.vs, pin=args.pin)
    if args.json:
        print(json.dumps({"tcp_congestion": congestion, **{k: round(v, 4) for k, v in figures.items()}}))
    else:
        print(f"tcp_congestion: {congestion}")
        for name, value in figures.items():
            unit = UNITS.get(name) or ("GB/s" if name.endswith("gbps") else "ns/B" if name.endswith("per_byte")
                                       else "x" if "_ratio" in name else "ms")
            print(f"{name}: {value:.3f} {unit}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
