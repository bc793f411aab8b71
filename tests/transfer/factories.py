"""Factories for the kvtransfer tests: small layouts, random pools, configs, endpoint pairs."""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Callable

import torch

from pdrouter.core.kv_layout import KvLayout
from pdrouter.transfer import Backend, KvReceiver, KvSender, TransferConfig, new_epoch
from pdrouter.transfer.pool_view import torch_dtype

TOKEN = "test-token"


def make_layout(dtype: str = "float32", *, num_layers: int = 4, num_blocks: int = 64, block_size: int = 4,
                num_kv_heads: int = 2, head_dim: int = 8) -> KvLayout:
    return KvLayout(num_layers=num_layers, num_kv_heads=num_kv_heads, head_dim=head_dim,
                    block_size=block_size, num_blocks=num_blocks, dtype=dtype)


def make_pool(layout: KvLayout, seed: int | None = 0) -> torch.Tensor:
    """A pool of random bit patterns (``seed=None``: zeros)."""
    pool = torch.zeros(layout.shape, dtype=torch_dtype(layout.dtype))
    if seed is not None:
        words = pool.view(-1).view(torch.int32) if pool.numel() * pool.element_size() % 4 == 0 else None
        gen = torch.Generator().manual_seed(seed)
        if words is not None:
            torch.randint(-(2**31), 2**31 - 1, words.shape, generator=gen, dtype=torch.int32, out=words)
        else:
            pool.view(-1).view(torch.uint8).random_(0, 256, generator=gen)
    return pool


def blocks_equal(a: torch.Tensor, a_ids: list[int], b: torch.Tensor, b_ids: list[int]) -> bool:
    """Bit-exact equality of blocks ``a_ids`` of pool ``a`` and ``b_ids`` of pool ``b`` (all layers)."""
    left = a[:, :, a_ids].contiguous().view(-1).view(torch.uint8)
    right = b[:, :, b_ids].contiguous().view(-1).view(torch.uint8)
    return torch.equal(left, right)


def make_config(backend: Backend = Backend.TCP, *, token: str = TOKEN, epoch: int | None = None,
                **overrides: object) -> TransferConfig:
    settings: dict[str, object] = {"connect_timeout_s": 10.0, "progress_timeout_s": 10.0, "abort_grace_s": 2.0}
    settings.update(overrides)
    return TransferConfig(auth_token=token, epoch=epoch or new_epoch(), backend=backend,
                          **settings)  # type: ignore[arg-type]


def wait_until(predicate: Callable[[], bool], timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.01)
    return predicate()


class Pair:
    """A receiver and a sender on two pools of the same layout, closed by the fixture."""

    def __init__(self, layout: KvLayout, backend: Backend, seed: int = 0) -> None:
        self.layout = layout
        self.src = make_pool(layout, seed)
        self.dst = make_pool(layout, None)
        self.receiver = KvReceiver(self.dst, layout, make_config(backend))
        self.sender = KvSender(self.src, layout, make_config(backend))

    def close(self) -> None:
        self.sender.close()
        self.receiver.close()

    def assert_released(self) -> None:
        """No expectation or deadline, queued message, transfer or unacknowledged byte left on either side."""
        assert wait_until(lambda: (self.receiver.stats().expectations, self.receiver.stats().deadlines) == (0, 0))
        assert wait_until(lambda: (self.sender.stats().transfers, self.sender.stats().queued_messages,
                                   self.sender.stats().inflight_bytes) == (0, 0, 0))




class FaultyProxy:
    """A TCP relay in front of a receiver that corrupts or cuts the sender-to-receiver stream.

    Messages are counted by the wire magic in the sender's stream (0: CLIENT_HELLO, 1: CLIENT_AUTH,
    2: BEGIN, 3: first DATA, ...); ``flip=(k, d)`` flips the byte ``d`` bytes into message ``k``,
    ``cut=(k, d)`` forwards up to that byte and then drops both connections, ``stall=(k, d)``
    forwards up to that byte and then stops reading (a hung receiver).
    """

    def __init__(self, upstream: str, *, flip: tuple[int, int] | None = None,
                 cut: tuple[int, int] | None = None, stall: tuple[int, int] | None = None) -> None:
        self._upstream = upstream
        self._flip = flip
        self._cut = cut
        self._stall = stall
        self._stop = threading.Event()
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.address = f"127.0.0.1:{self._listener.getsockname()[1]}"
        self._socks: list[socket.socket] = []
        self._threads: list[threading.Thread] = []
        self.fired = threading.Event()
        self._start(self._accept)

    def close(self) -> None:
        self._stop.set()
        with contextlib.suppress(OSError):
            self._listener.shutdown(socket.SHUT_RDWR)
        self._listener.close()
        for sock in list(self._socks):
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            sock.close()
        for thread in self._threads:
            thread.join(10)

    def _start(self, target: Callable[..., None], *args: object) -> None:
        thread = threading.Thread(target=target, args=args, daemon=True)
        self._threads.append(thread)
        thread.start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            host, port = self._upstream.rsplit(":", 1)
            server = socket.create_connection((host, int(port)))
            self._socks += [client, server]
            self._start(self._pump, client, server, True)
            self._start(self._pump, server, client, False)

    def _pump(self, src: socket.socket, dst: socket.socket, faulty: bool) -> None:
        seen = b""
        position = 0
        starts: list[int] = []
        try:
            while data := src.recv(1 << 16):
                buf = bytearray(data)
                if faulty:
                    window = seen + data
                    index = window.find(b"KVTX")
                    while index >= 0:
                        start = position - len(seen) + index
                        if not starts or start > starts[-1]:
                            starts.append(start)
                        index = window.find(b"KVTX", index + 1)
                    seen = window[-3:]
                    if self._flip and len(starts) > self._flip[0]:
                        at = starts[self._flip[0]] + self._flip[1] - position
                        if 0 <= at < len(buf):
                            buf[at] ^= 0x5A
                            self.fired.set()
                    if self._stall and len(starts) > self._stall[0]:
                        at = starts[self._stall[0]] + self._stall[1] - position
                        if 0 <= at < len(buf):
                            dst.sendall(buf[:at])
                            self.fired.set()
                            self._stop.wait()
                            return
                    if self._cut and len(starts) > self._cut[0]:
                        at = starts[self._cut[0]] + self._cut[1] - position
                        if 0 <= at < len(buf):
                            dst.sendall(buf[:at])
                            self.fired.set()
                            for sock in (src, dst):
                                sock.shutdown(socket.SHUT_RDWR)
                            return
                position += len(data)
                dst.sendall(buf)
        except OSError:
            pass
        with contextlib.suppress(OSError):
            dst.shutdown(socket.SHUT_WR)
