"""Transfers between real processes: gloo across processes, and peers killed mid-transfer."""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import signal
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from pdrouter.transfer import Backend, KvReceiver, KvSender, PeerLostError, TransferState
from pdrouter.transfer.target import TransferTarget

from .factories import blocks_equal, make_config, make_layout, make_pool, wait_until
from .peers import LayoutSpec, receiver_main, sender_main

SMALL: LayoutSpec = {"dtype": "bfloat16", "num_layers": 3, "num_blocks": 4096, "block_size": 2,
                     "num_kv_heads": 1, "head_dim": 8}
LLAMA: LayoutSpec = {"dtype": "bfloat16", "num_layers": 32, "num_blocks": 258, "block_size": 16,
                     "num_kv_heads": 8, "head_dim": 128}
KILLABLE: LayoutSpec = {"dtype": "float16", "num_layers": 4, "num_blocks": 16, "block_size": 16,
                        "num_kv_heads": 2, "head_dim": 32}


class Peer:
    """A spawned peer process and its command pipe."""

    def __init__(self, target: Callable[..., None], *args: Any) -> None:
        ctx = mp.get_context("spawn")
        self.pipe, child = ctx.Pipe()
        self.process = ctx.Process(target=target, args=(child, *args), daemon=True)
        self.process.start()
        child.close()

    def call(self, *command: Any, timeout: float = 120) -> Any:
        self.pipe.send(command)
        return self.reply(timeout)

    def reply(self, timeout: float = 120) -> Any:
        if not self.pipe.poll(timeout):
            raise TimeoutError(f"peer did not answer {timeout}s")
        answer = self.pipe.recv()
        if answer[0] == "error":
            raise AssertionError(f"peer failed: {answer[1]}: {answer[2]}")
        return answer[1]

    def kill(self) -> None:
        os.kill(self.process.pid or 0, signal.SIGKILL)
        self.process.join(30)

    def close(self) -> None:
        if self.process.is_alive():
            with contextlib.suppress(OSError):
                self.pipe.send(("quit",))
            self.process.join(30)
        if self.process.is_alive():
            self.kill()
        self.pipe.close()
        self.process.close()


@pytest.fixture
def spawn(monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[..., Peer]]:
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[2]))  # the children import tests.transfer
    peers: list[Peer] = []

    def factory(target: Callable[..., None], *args: Any) -> Peer:
        peer = Peer(target, *args)
        peers.append(peer)
        return peer

    yield factory
    for peer in peers:
        peer.close()


@pytest.mark.slow
def test_gloo_between_two_processes_is_bit_exact(spawn: Callable[..., Peer]) -> None:
    peer = spawn(sender_main, Backend.GLOO, [(SMALL, 11), (LLAMA, 12)])
    peer.reply()
    small, llama = make_layout(**SMALL), make_layout(**LLAMA)
    dst_small, dst_llama = make_pool(small, None), make_pool(llama, None)
    with KvReceiver(dst_small, small, make_config(Backend.GLOO)) as rx_small, \
            KvReceiver(dst_llama, llama, make_config(Backend.GLOO)) as rx_llama:
        one = rx_small.expect("one", [100], timeout_s=120)
        peer.call("send", 0, one.target, [7], 1, -1)
        one.wait_all(60)
        many_src, many_dst = [(i * 7) % 4096 for i in range(3000)], list(range(4095, 1095, -1))
        many = rx_small.expect("many", many_dst, timeout_s=120)
        peer.call("send", 0, many.target, many_src, 1, -1)
        many.wait_all(60)
        big = rx_llama.expect("big", list(range(2, 258)), timeout_s=120)
        assert llama.block_bytes * 256 == 512 << 20
        peer.call("send", 1, big.target, list(range(0, 256)), 1, -1)
        big.wait_all(60)
    src_small = make_pool(small, 11)
    assert blocks_equal(src_small, [7], dst_small, [100])
    assert blocks_equal(src_small, many_src, dst_small, many_dst)
    del src_small
    src_llama = make_pool(llama, 12)
    assert torch.equal(src_llama[:, :, 0:256].view(torch.uint8), dst_llama[:, :, 2:258].view(torch.uint8))


@pytest.mark.parametrize("backend", [Backend.TCP, Backend.GLOO])
def test_sender_killed_mid_transfer(spawn: Callable[..., Peer], backend: Backend) -> None:
    peer = spawn(sender_main, backend, [(KILLABLE, 5)])
    peer.reply()
    layout = make_layout(**KILLABLE)
    with KvReceiver(make_pool(layout, None), layout, make_config(backend)) as receiver:
        handle = receiver.expect("req-1", [1, 2, 3], timeout_s=120)
        peer.pipe.send(("send", 0, handle.target, [4, 5, 6], 1, 2))  # two layers, then it stops
        assert peer.pipe.poll(60) and peer.pipe.recv() == ("paused", 2)
        handle.wait_layer(1, 60)
        peer.kill()
        with pytest.raises(PeerLostError, match="connection"):
            handle.wait_all(60)
        assert wait_until(lambda: receiver.stats() == type(receiver.stats())(0, 0))


def test_receiver_killed_mid_transfer(spawn: Callable[..., Peer]) -> None:
    peer = spawn(receiver_main, Backend.TCP, KILLABLE)
    layout = make_layout(**KILLABLE)
    with KvSender(make_pool(layout, 5), layout, make_config()) as sender:
        target: TransferTarget = peer.call("expect", "req-1", [1, 2, 3])
        transfer = sender.open_transfer(target)
        transfer.send_layers([4, 5, 6], 0)
        peer.call("wait_layer", "req-1", 0)
        peer.kill()
        with pytest.raises(PeerLostError):
            transfer.send_layers([4, 5, 6], range(1, 4))
            transfer.finish(60)
        assert transfer.state is TransferState.FAILED
        stats = sender.stats()
        assert wait_until(lambda: sender.stats().transfers == 0 and sender.stats().connections == 0), stats

