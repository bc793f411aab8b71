"""pd-router's vLLM KV connector: its transfer rate against the transfer layer alone, and a PD request's TTFT.

Figures (``name: value unit`` lines; ``--json`` prints one JSON object):

- ``layer_gbps``: ``KvSender`` → ``KvReceiver`` between two processes over vLLM-shaped pools (one
  buffer, a ``[blocks, kv_heads, block_size, 2 × head_dim]`` view per layer: the small model's
  geometry in bfloat16, 128-token blocks), a whole prompt's blocks layer by layer, from
  ``open_transfer`` to the receiver's confirmation.
- ``connector_gbps``: the same bytes between the same processes through the connector's worker side
  (``WorkerSide``, what vLLM's worker processes call: the step's plan, ``save_layer`` per layer,
  ``step_done``), with its side channel to a ``ConnectorHost`` each here: the prefill side's time
  from its first frame queued to the decode side's confirmation.
- ``connector_vs_layer_ratio``: the median of each pair's rate ratio, connector over layer (target
  >= 0.8); pairs run back to back, in alternating order.
- ``handoff_ms``: median wall time here of one hand-off through the connector, from asking the
  decode side to reserve to both sides reporting (the side channel's round trips included).

Without ``--quick``, two real vLLM engines (the CPU wheel, the small model in bfloat16, 128-token
blocks; about a minute to start here) move fresh 1,500-token prompts decode-first, and add:

- ``ttft_queue_ms``, ``ttft_prefill_ms``, ``ttft_transfer_ms``, ``ttft_first_decode_ms``, ``ttft_ms``:
  medians of the split of the time to first token: submitted to the decode engine until its blocks are
  reserved (queueing); the prefill engine's request until its forward pass ended (prefill, during which
  the layers already go out); from there until the decode side confirmed every block (the transfer's
  exposed tail, as the prefill engine's connector measures it); from the decode engine's word that the
  KV landed to its first token (its first step: the prompt's last position computed over the received
  KV, plus vLLM's output path).
- ``engine_kv_mib``: the KV of one such prompt; ``engine_overlapped_ratio``: the share of the
  transfer's window (first frame to confirmation) that overlapped the forward pass.

On real engines the transfer's window is the forward pass's (each layer goes out as it is computed),
so their rate is the computation's, not the transport's: the rate comparison is the component one
above, with the same code the engines run.

Each rate is the median of several hand-offs run in pairs (layer then connector, connector then
layer, ...) after a warm-up each, so that other work on the machine hits both alike.
"""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import os
import secrets
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _report import Report, base_parser

from pdrouter.transfer import KvReceiver, KvSender, TransferConfig, new_epoch
from pdrouter.transfer.vllm.host import ConnectorHost, Placement, TransferResult
from pdrouter.transfer.vllm.paged_pool import PagedKvLayout, PagedPool

TOKEN = secrets.token_hex(16)
GEOMETRY = {"num_layers": 6, "num_kv_heads": 2, "head_dim": 64, "block_size": 128, "dtype": "bfloat16"}
"""The small preset's KV geometry on vLLM's CPU backend (393,216 bytes per block)."""


@dataclass(frozen=True)
class Plan:
    blocks: int
    """Blocks per hand-off (32: a 4,096-token prompt, 12 MiB)."""
    reps: int
    prompts: int
    """Fresh prompts for the TTFT split (engines only)."""
    prompt_tokens: int


def layout(num_blocks: int) -> PagedKvLayout:
    return PagedKvLayout(num_blocks=num_blocks, arrangement="cpu|LBHNC|bench", **GEOMETRY)  # type: ignore[arg-type]


def vllm_views(lay: PagedKvLayout, fill: int | None) -> tuple[list[str], list[torch.Tensor]]:
    """vLLM's CPU allocation of ``lay``: one buffer, a layer-major view per layer (random when ``fill``)."""
    page = lay.num_kv_heads * lay.block_size * 2 * lay.head_dim
    buf = torch.empty(lay.num_layers * lay.num_blocks * page, dtype=torch.bfloat16)
    if fill is None:
        buf.view(torch.int16).fill_(1)  # fault the pages in before timing anything
    else:  # finite values: the decode side checks what it received before vLLM computes from it
        buf.normal_(generator=torch.Generator().manual_seed(fill))
    shape = (lay.num_blocks, lay.num_kv_heads, lay.block_size, 2 * lay.head_dim)
    views = [buf[i * lay.num_blocks * page:(i + 1) * lay.num_blocks * page].view(shape) for i in range(lay.num_layers)]
    return [f"model.layers.{i}.self_attn.attn" for i in range(lay.num_layers)], views


# -- the two peer processes (a vLLM worker process each) ----------------------------------------------
def peer_main(pipe: Connection, role: str, num_blocks: int, channel: str, token: str, seed: int | None) -> None:
    from pdrouter.transfer.vllm.worker_side import WorkerSide, WorkerSideConfig

    lay = layout(num_blocks)
    names, views = vllm_views(lay, seed)
    side = WorkerSide(WorkerSideConfig(channel, role, 0, 1))
    side.register(names, views, lay)
    config = TransferConfig(auth_token=token, epoch=new_epoch())
    plain = PagedPool(views, lay)
    receiver = KvReceiver(plain, lay, config) if role == "kv_consumer" else None
    sender = KvSender(plain, lay, config) if role == "kv_producer" else None
    handles: dict[str, Any] = {}
    pipe.send("ready")
    try:
        while True:
            cmd, *args = pipe.recv()
            if cmd == "plan":  # the connector: one engine step's plan, then the forward pass's layers
                side.bind(args[0])
                if args[1]:
                    for name in names:
                        side.save_layer(name)
                side.step_done()
                pipe.send(None)
            elif cmd == "results":
                report = side.results(set(args[0]))
                pipe.send((report.finished_sending, report.finished_recving, report.failed_recving))
            elif cmd == "expect":  # the transfer layer alone
                assert receiver is not None
                handles[args[0]] = receiver.expect(args[0], args[1], timeout_s=60)
                pipe.send(handles[args[0]].target)
            elif cmd == "wait":
                handles.pop(args[0]).wait_all(60)
                pipe.send(None)
            elif cmd == "send":
                assert sender is not None
                target, src = args
                started = time.monotonic()
                transfer = sender.open_transfer(target)
                for layer in range(lay.num_layers):
                    transfer.send_layers(src, layer)
                transfer.finish(60)
                pipe.send(time.monotonic() - started)
            elif cmd == "quit":
                return
    finally:
        side.shutdown()
        for endpoint in (receiver, sender):
            if endpoint is not None:
                endpoint.close()


class Peer:
    def __init__(self, role: str, num_blocks: int, host: ConnectorHost, seed: int | None) -> None:
        ctx = mp.get_context("spawn")
        self.pipe, child = ctx.Pipe()
        self.proc = ctx.Process(target=peer_main, args=(child, role, num_blocks, host.socket_path, TOKEN, seed),
                                daemon=True)
        self.proc.start()

    async def call(self, *command: Any) -> Any:
        def roundtrip() -> Any:
            self.pipe.send(command)
            return self.pipe.recv()
        return await asyncio.to_thread(roundtrip)

    async def ready(self) -> None:
        assert await asyncio.to_thread(self.pipe.recv) == "ready"

    def close(self) -> None:
        self.pipe.send(("quit",))
        self.proc.join(10)


async def layer_alone(prefill: Peer, decode: Peer, blocks: list[int]) -> float:
    tid = f"raw-{uuid.uuid4().hex}"
    target = await decode.call("expect", tid, blocks)
    seconds: float = await prefill.call("send", target, blocks)
    await decode.call("wait", tid)
    return seconds


async def through_connector(prefill: Peer, decode: Peer, hosts: tuple[ConnectorHost, ConnectorHost],
                            blocks: list[int]) -> tuple[TransferResult, float]:
    from pdrouter.transfer.vllm.step_plan import ReceivePlan, SendPlan, StepPlan

    prefill_host, decode_host = hosts
    key = f"req-{uuid.uuid4().hex}"
    started = time.monotonic()
    with decode_host.receive(key) as receiving, prefill_host.send(key) as sending:
        await decode.call("plan", StepPlan(receives=(ReceivePlan(key, key, tuple(blocks), 0, 60.0),)), False)
        placement = await receiving.placement(60)
        assert isinstance(placement, Placement)
        await prefill.call("plan", StepPlan(sends=(SendPlan(key, key, placement.targets, tuple(blocks), 60.0),)),
                           True)
        sent = await sending.sent(60)
        await receiving.landed(60)
    await decode.call("results", [])
    await prefill.call("results", [key])
    return sent, time.monotonic() - started


async def component_figures(plan: Plan, report: Report) -> None:
    hosts = (ConnectorHost(TransferConfig(auth_token=TOKEN, epoch=new_epoch()), "kv_producer"),
             ConnectorHost(TransferConfig(auth_token=TOKEN, epoch=new_epoch()), "kv_consumer"))
    for host in hosts:
        await host.start()
    prefill = Peer("kv_producer", plan.blocks + 4, hosts[0], seed=1)
    decode = Peer("kv_consumer", plan.blocks + 4, hosts[1], seed=None)
    try:
        await asyncio.gather(prefill.ready(), decode.ready(), hosts[0].wait_ready(60), hosts[1].wait_ready(60))
        blocks = list(range(plan.blocks))
        nbytes = plan.blocks * layout(plan.blocks).block_bytes
        await layer_alone(prefill, decode, blocks)  # warm-ups: connections, first pages
        await through_connector(prefill, decode, hosts, blocks)
        layer_s, connector_s, handoff_s = [], [], []
        for rep in range(plan.reps):  # pairs, in alternating order: a load that drifts hits both alike
            for which in ("layer", "connector") if rep % 2 == 0 else ("connector", "layer"):
                if which == "layer":
                    layer_s.append(await layer_alone(prefill, decode, blocks))
                    continue
                sent, wall = await through_connector(prefill, decode, hosts, blocks)
                assert sent.nbytes == nbytes, (sent.nbytes, nbytes)
                connector_s.append(sent.seconds)
                handoff_s.append(wall)
        report.add("transfer_mib", nbytes / 2**20, "MiB")
        report.add("layer_gbps", nbytes / statistics.median(layer_s) / 1e9, "GB/s")
        report.add("connector_gbps", nbytes / statistics.median(connector_s) / 1e9, "GB/s")
        report.add("connector_vs_layer_ratio",
                   statistics.median(lay / con for lay, con in zip(layer_s, connector_s, strict=True)), "x")
        report.add("handoff_ms", statistics.median(handoff_s) * 1000, "ms")
    finally:
        for host in hosts:
            host.stopping()
        for peer in (prefill, decode):
            peer.close()
        for host in hosts:
            await host.close()


# -- real engines ----------------------------------------------------------------------------------------
async def engine_figures(plan: Plan, report: Report) -> None:
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    from vllm import SamplingParams
    from vllm.config import KVTransferConfig
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.inputs import TokensPrompt
    from vllm.v1.engine.async_llm import AsyncLLM

    from pdrouter.engine.model_io import make_model
    from pdrouter.transfer.vllm.orders import ReceiveOrder, SendOrder

    folder = make_model("small", 0, Path(tempfile.mkdtemp(prefix="vllm-bench-")) / "small", dtype="bfloat16")
    hosts = (ConnectorHost(TransferConfig(auth_token=TOKEN, epoch=new_epoch()), "kv_producer"),
             ConnectorHost(TransferConfig(auth_token=TOKEN, epoch=new_epoch()), "kv_consumer"))

    async def start(host: ConnectorHost) -> Any:
        await host.start()
        # No statistics: vLLM's Prometheus loggers, made by two engines starting at once in one process,
        # race on the process-global registry.
        args = AsyncEngineArgs(model=str(folder), skip_tokenizer_init=True, enforce_eager=True, dtype="bfloat16",
                               max_model_len=4096, block_size=128, disable_log_stats=True,
                               kv_transfer_config=KVTransferConfig(**host.kv_transfer_config()))
        llm = await asyncio.to_thread(AsyncLLM.from_engine_args, args)
        await host.wait_ready(300)
        return llm

    prefill, decode = await asyncio.gather(start(hosts[0]), start(hosts[1]))

    async def last(llm: Any, prompt: list[int], params: Any, rid: str,
                   first: Callable[[], object] | None = None) -> None:
        async for _ in llm.generate(TokensPrompt(prompt_token_ids=prompt), params, request_id=rid):
            if first is not None:
                first()
                first = None

    async def handoff(prompt: list[int]) -> dict[str, float]:
        key = f"req-{uuid.uuid4().hex}"
        marks: dict[str, float] = {"start": time.monotonic()}

        async def mark(name: str, waiting: Any) -> Any:
            result = await waiting
            marks[name] = time.monotonic()
            return result

        with hosts[1].receive(key) as receiving:
            order = ReceiveOrder(key, 0, 60.0)
            decoding = asyncio.ensure_future(last(decode, prompt, SamplingParams(
                max_tokens=2, temperature=0, extra_args={"kv_transfer_params": order.params()}), key,
                lambda: marks.setdefault("first_token", time.monotonic())))
            placement = await receiving.placement(60)
            assert isinstance(placement, Placement)
            marks["reserved"] = time.monotonic()
            landing = asyncio.ensure_future(mark("landed", receiving.landed(60)))
            with hosts[0].send(key) as sending:
                await last(prefill, prompt, SamplingParams(max_tokens=1, temperature=0, extra_args={
                    "kv_transfer_params": SendOrder(key, placement.targets, 60.0).params()}), key)
                sent = await sending.sent(60)
            await landing
            await decoding
        marks["computed"] = marks["landed"] - sent.tail_s  # the prefill engine's forward pass ended
        marks["nbytes"] = sent.nbytes
        marks["overlapped"] = 1 - sent.tail_s / sent.seconds if sent.seconds else 0.0
        return marks

    try:
        rng = __import__("random").Random(0)
        prompts = [[rng.randrange(3, 256) for _ in range(plan.prompt_tokens)] for _ in range(plan.prompts)]
        await handoff(prompts[0])  # warm-up: the prefill engine dials the decode engine's receiver
        splits = [await handoff(p) for p in prompts[1:]]
        for name, begin, end in (("ttft_queue_ms", "start", "reserved"),
                                 ("ttft_prefill_ms", "reserved", "computed"),
                                 ("ttft_transfer_ms", "computed", "landed"),
                                 ("ttft_first_decode_ms", "landed", "first_token"),
                                 ("ttft_ms", "start", "first_token")):
            report.add(name, statistics.median(m[end] - m[begin] for m in splits) * 1000, "ms")
        report.add("engine_kv_mib", statistics.median(m["nbytes"] for m in splits) / 2**20, "MiB")
        report.add("engine_overlapped_ratio", statistics.median(m["overlapped"] for m in splits), "x")
    finally:
        for host in hosts:
            host.stopping()
        for llm in (prefill, decode):
            llm.shutdown()
        for host in hosts:
            await host.close()


def main(argv: list[str] | None = None) -> int:
    parser = base_parser(__doc__.split("\n\n")[0])
    args = parser.parse_args(argv)
    plan = (Plan(blocks=32, reps=11, prompts=0, prompt_tokens=0) if args.quick
            else Plan(blocks=32, reps=31, prompts=9, prompt_tokens=1500))
    report = Report()
    asyncio.run(component_figures(plan, report))
    if not args.quick:
        asyncio.run(engine_figures(plan, report))
    report.emit(args.json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
