"""The KV data plane under concurrency: 16 prefill pools sending to 16 decode pools at once, on loopback.

Two processes, as in a real pair of nodes: this one holds 16 ``KvSender`` (one pool each, like 16
prefill workers), a child holds 16 ``KvReceiver`` (16 decode workers). Each round, every sender
moves one request of Llama-3-8B-like geometry (32 layers, 8 KV heads, head_dim 128, bf16, block 16:
128 KiB per token) layer by layer to a receiver of a fixed permutation (sender ``i`` → receiver
``5i mod 16``), all 16 started together from a barrier, each from its own thread; every transfer
is then checked bit for bit against the sender's blocks.

Figures (``name: value unit``, ``--json`` for one object):

- ``raw_socket_gbps``: one plain TCP socket moving the same bytes with the transport's system-call
  pattern (``kv_transfer_bench``'s baseline), and ``single_stream_gbps``: one transfer alone, both
  measured in the same run, interleaved with the concurrent rounds;
- ``concurrent_aggregate_gbps``: all bytes of a round over the round's wall time (first start to
  last end), and its ratio to the single stream;
- ``concurrent_transfer_gbps_p50`` / ``_min``: each transfer's own rate (bytes / its time);
- ``concurrent_transfer_ms_p50`` / ``_p99`` / ``_max``: transfer times, open to ``finish``;
- ``fairness_jain``: Jain's index of the per-transfer rates in each round (1 = all equal; 1/16 = one
  transfer got everything), the lowest round; ``fairness_max_over_min``: the widest spread of a round;
- ``bit_exact_transfers``: transfers whose blocks matched the sender's, out of ``transfers``.

On a machine with few cores the 32 threads share them: the aggregate is then bounded by the CPUs
(``cpu_ns_per_byte`` says what a byte costs both processes), not by the socket count.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import secrets
import socket
import statistics
import sys
import threading
import time
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

import torch
from kv_transfer_bench import SEND_PIECE, SOCKET_BUFFER, _raw_sink, _tune

from pdrouter.core.kv_layout import KvLayout
from pdrouter.transfer import KvReceiver, KvSender, TransferConfig, TransferTarget, new_epoch
from pdrouter.transfer.pool_view import checksum

TOKEN = secrets.token_hex(16)
PAIRS = 16


@dataclass(frozen=True)
class Plan:
    tokens: int
    rounds: int
    pairs: int = PAIRS

    @property
    def blocks(self) -> int:
        return self.tokens // 16

    def layout(self) -> KvLayout:
        return KvLayout(num_layers=32, num_kv_heads=8, head_dim=128, block_size=16,
                        num_blocks=self.blocks + 2, dtype="bfloat16")

    @property
    def transfer_bytes(self) -> int:
        return self.blocks * self.layout().block_bytes

    def receiver_of(self, sender: int) -> int:
        return (5 * sender) % self.pairs


def config(token: str) -> TransferConfig:
    return TransferConfig(auth_token=token, epoch=new_epoch(), socket_buffer_bytes=SOCKET_BUFFER)


def _blocks_digest(pool: torch.Tensor, blocks: list[int]) -> str:
    return checksum(pool[:, :, b].contiguous().view(torch.uint8).numpy().data for b in blocks)


# -- the decode side (a child process) -------------------------------------------------------------

def receiver_main(pipe: Connection, plan: Plan, token: str) -> None:
    layout = plan.layout()
    pools = [torch.zeros(layout.shape, dtype=torch.bfloat16) for _ in range(plan.pairs)]
    for pool in pools:
        pool.view(torch.uint8).view(-1).fill_(1)  # fault the pages in before timing anything
    receivers = [KvReceiver(pool, layout, config(token)) for pool in pools]
    handles: dict[str, Any] = {}
    try:
        while True:
            cmd, *args = pipe.recv()
            if cmd == "expect":
                targets = []
                for index, tid in args[0]:
                    handle = receivers[index].expect(tid, list(range(plan.blocks)), timeout_s=120)
                    handles[tid] = handle
                    targets.append(handle.target)
                pipe.send(targets)
            elif cmd == "wait":
                states = []
                for tid in args[0]:
                    handle = handles.pop(tid)
                    handle.wait_all(60)
                    states.append(handle.state.value)
                pipe.send(states)
            elif cmd == "digests":
                pipe.send([_blocks_digest(pool, list(range(plan.blocks))) for pool in pools])
            elif cmd == "raw":
                listener = socket.create_server(("127.0.0.1", 0))
                memory = pools[0].view(-1).view(torch.uint8).numpy().data
                threading.Thread(target=_raw_sink, args=(listener, memory, args[0]), daemon=True).start()
                pipe.send(listener.getsockname()[1])
            elif cmd == "cpu":
                pipe.send(time.process_time())
            elif cmd == "quit":
                return
    finally:
        for receiver in receivers:
            receiver.close()


# -- the prefill side ------------------------------------------------------------------------------

class Bench:
    def __init__(self, plan: Plan) -> None:
        self.plan = plan
        self.layout = plan.layout()
        self.pools = []
        for i in range(plan.pairs):
            pool = torch.empty(self.layout.shape, dtype=torch.bfloat16)
            pool.view(torch.int16).random_(generator=torch.Generator().manual_seed(i))
            self.pools.append(pool)
        ctx = mp.get_context("spawn")
        self.pipe, child = ctx.Pipe()
        self.child = ctx.Process(target=receiver_main, args=(child, plan, TOKEN), daemon=True)
        self.child.start()
        self.senders = [KvSender(pool, self.layout, config(TOKEN)) for pool in self.pools]
        self.blocks = list(range(plan.blocks))
        self._seq = 0
        self.raw = socket.create_connection(("127.0.0.1", self.call("raw", plan.transfer_bytes)))
        _tune(self.raw)

    def call(self, *msg: Any) -> Any:
        self.pipe.send(msg)
        return self.pipe.recv()

    def raw_round(self) -> float:
        nbytes = self.plan.transfer_bytes
        memory = self.pools[0].view(-1).view(torch.uint8).numpy().data
        start = time.perf_counter()
        for offset in range(0, nbytes, SEND_PIECE):
            self.raw.sendall(memory[offset:min(offset + SEND_PIECE, nbytes)])
        if self.raw.recv(1) != b"k":
            raise RuntimeError("the raw sink went away")
        return time.perf_counter() - start

    def round(self, senders: list[int]) -> list[tuple[float, float]]:
        """Every sender of ``senders`` moves one request at once; (start, end) of each, perf_counter."""
        tids = []
        for i in senders:
            self._seq += 1
            tids.append(f"c{self._seq}-{i}")
        targets: list[TransferTarget] = self.call("expect", [(self.plan.receiver_of(i), tid)
                                                              for i, tid in zip(senders, tids, strict=True)])
        spans: list[tuple[float, float]] = [(0.0, 0.0)] * len(senders)
        errors: list[BaseException] = []
        barrier = threading.Barrier(len(senders))

        def run(slot: int, sender: KvSender, target: TransferTarget) -> None:
            try:
                barrier.wait()
                start = time.perf_counter()
                transfer = sender.open_transfer(target)
                for layer in range(self.layout.num_layers):
                    transfer.send_layers(self.blocks, layer)
                transfer.finish(120)
                spans[slot] = (start, time.perf_counter())
            except BaseException as exc:  # reported by the round below
                errors.append(exc)

        threads = [threading.Thread(target=run, args=(slot, self.senders[i], target))
                   for slot, (i, target) in enumerate(zip(senders, targets, strict=True))]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        if errors:
            raise RuntimeError(f"{len(errors)} transfers failed, the first: {errors[0]!r}")
        states = self.call("wait", tids)
        if any(state != "done" for state in states):
            raise RuntimeError(f"transfers ended {states}")
        return spans

    def bit_exact(self) -> int:
        """How many receiver pools hold exactly their sender's blocks (after a full round)."""
        theirs = self.call("digests")
        ours = [_blocks_digest(pool, self.blocks) for pool in self.pools]
        return sum(theirs[self.plan.receiver_of(i)] == ours[i] for i in range(self.plan.pairs))

    def close(self) -> None:
        self.raw.close()
        for sender in self.senders:
            sender.close()
        self.pipe.send(("quit",))
        self.child.join(30)


def jain(values: list[float]) -> float:
    return sum(values) ** 2 / (len(values) * sum(v * v for v in values))


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def run(plan: Plan) -> dict[str, float | int]:
    bench = Bench(plan)
    nbytes = plan.transfer_bytes
    everyone = list(range(plan.pairs))
    try:
        bench.raw_round()
        bench.round([0])
        bench.round(everyone)  # warm-up: every connection dialled and authenticated
        raw, single, aggregate, rates, times, jains, spreads = [], [], [], [], [], [], []
        cpu = 0.0
        exact = 0
        for _ in range(plan.rounds):
            raw.append(nbytes / bench.raw_round() / 1e9)
            ((start, end),) = bench.round([0])
            single.append(nbytes / (end - start) / 1e9)
            ours, theirs = time.process_time(), bench.call("cpu")
            spans = bench.round(everyone)
            cpu += time.process_time() - ours + bench.call("cpu") - theirs
            exact += bench.bit_exact()
            wall = max(e for _, e in spans) - min(s for s, _ in spans)
            aggregate.append(plan.pairs * nbytes / wall / 1e9)
            round_rates = [nbytes / (e - s) / 1e9 for s, e in spans]
            rates += round_rates
            times += [(e - s) * 1e3 for s, e in spans]
            jains.append(jain(round_rates))
            spreads.append(max(round_rates) / min(round_rates))
    finally:
        bench.close()
    single_gbps = statistics.median(single)
    aggregate_gbps = statistics.median(aggregate)
    return {
        "pairs": plan.pairs,
        "transfer_mib": nbytes / (1 << 20),
        "raw_socket_gbps": statistics.median(raw),
        "single_stream_gbps": single_gbps,
        "single_stream_vs_raw_ratio": single_gbps / statistics.median(raw),
        "concurrent_aggregate_gbps": aggregate_gbps,
        "concurrent_vs_single_ratio": aggregate_gbps / single_gbps,
        "concurrent_transfer_gbps_p50": statistics.median(rates),
        "concurrent_transfer_gbps_min": min(rates),
        "concurrent_transfer_ms_p50": statistics.median(times),
        "concurrent_transfer_ms_p99": pct(times, 0.99),
        "concurrent_transfer_ms_max": max(times),
        "fairness_jain": min(jains),
        "fairness_max_over_min": max(spreads),
        "cpu_ns_per_byte": cpu / (plan.rounds * plan.pairs * nbytes) * 1e9,
        "transfers": plan.rounds * plan.pairs,
        "bit_exact_transfers": exact,
    }


UNITS = {"pairs": "", "transfer_mib": "MiB", "fairness_jain": "", "fairness_max_over_min": "x",
         "cpu_ns_per_byte": "ns/B", "transfers": "", "bit_exact_transfers": ""}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="8 MiB per transfer, 3 rounds (< 30 s)")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of lines")
    args = parser.parse_args(argv)
    plan = Plan(tokens=64, rounds=3) if args.quick else Plan(tokens=256, rounds=5)
    figures = run(plan)
    if figures["bit_exact_transfers"] != figures["transfers"]:
        print(f"kv_concurrency: {figures['transfers'] - figures['bit_exact_transfers']:.0f} transfers "
              "landed different bytes", file=sys.stderr)
    if args.json:
        print(json.dumps({k: round(v, 4) for k, v in figures.items()}))
    else:
        for name, value in figures.items():
            unit = UNITS.get(name)
            if unit is None:
                unit = "GB/s" if name.endswith(("gbps", "gbps_p50", "gbps_min")) else "x" if name.endswith("ratio") \
                    else "ms"
            shown = f"{value:.3f}" if isinstance(value, float) else str(value)
            print(f"{name}: {shown} {unit}".rstrip())
    return 0 if figures["bit_exact_transfers"] == figures["transfers"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
