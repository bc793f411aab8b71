"""Factories for the KV transfer tests: small layouts, random pools, configs, endpoint pairs."""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Callable
from pathlib import Path

import torch

from pdrouter.core.kv_layout import KvLayout
from pdrouter.core.tls import TlsFiles
from pdrouter.testing.pki import TestCa
from pdrouter.transfer import Backend, KvReceiver, KvSender, TransferConfig, frames, new_epoch
from pdrouter.transfer.pool_view import torch_dtype

TOKEN = "kvtransfer-test-token-0123456789"


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
    """A receiver and a sender on two pools of the same layout, closed by the fixture (or by the
    caller); ``receiver`` / ``sender`` override their configurations' fields."""

    def __init__(self, layout: KvLayout, backend: Backend, seed: int = 0, *,
                 receiver: dict[str, object] | None = None, sender: dict[str, object] | None = None) -> None:
        self.layout = layout
        self.src = make_pool(layout, seed)
        self.dst = make_pool(layout, None)
        self.receiver = KvReceiver(self.dst, layout, make_config(backend, **(receiver or {})))
        self.sender = KvSender(self.src, layout, make_config(backend, **(sender or {})))

    def close(self) -> None:
        self.sender.close()
        self.receiver.close()

    def assert_released(self) -> None:
        """No expectation or deadline, queued message, transfer or unacknowledged byte left on either side."""
        assert wait_until(lambda: (self.receiver.stats().expectations, self.receiver.stats().deadlines) == (0, 0))
        assert wait_until(lambda: (self.sender.stats().transfers, self.sender.stats().queued_messages,
                                   self.sender.stats().inflight_bytes) == (0, 0, 0))


class _Relay:
    """A TCP relay on a free loopback port in front of ``upstream``: each accepted connection is
    dialled through and pumped both ways by ``_relay`` (a thread per direction); ``close`` ends all."""

    def __init__(self, upstream: str) -> None:
        self._upstream = upstream
        self._stop = threading.Event()
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.address = f"127.0.0.1:{self._listener.getsockname()[1]}"
        self._socks: list[socket.socket] = []
        self._threads: list[threading.Thread] = []
        self.fired = threading.Event()
        """Set once the relay did what it was made to do to the stream."""

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
            self._relay(client, server)

    def _relay(self, client: socket.socket, server: socket.socket) -> None:
        raise NotImplementedError


class FaultyProxy(_Relay):
    """A TCP relay in front of a receiver that corrupts or cuts the sender-to-receiver stream.

    Messages are counted by the wire magic in the sender's stream (0: CLIENT_HELLO, 1: CLIENT_AUTH,
    2: BEGIN, 3: first DATA, ...); ``flip=(k, d)`` flips the byte ``d`` bytes into message ``k``,
    ``cut=(k, d)`` forwards up to that byte and then drops both connections, ``stall=(k, d)``
    forwards up to that byte and then stops reading (a hung receiver). ``flip_at=n`` flips the
    ``n``-th byte of the stream, whatever it carries (TLS records, say).
    """

    def __init__(self, upstream: str, *, flip: tuple[int, int] | None = None,
                 cut: tuple[int, int] | None = None, stall: tuple[int, int] | None = None,
                 flip_at: int | None = None) -> None:
        super().__init__(upstream)
        self._flip = flip
        self._flip_at = flip_at
        self._cut = cut
        self._stall = stall
        self._start(self._accept)

    def _relay(self, client: socket.socket, server: socket.socket) -> None:
        self._start(self._pump, client, server, True)
        self._start(self._pump, server, client, False)

    def _pump(self, src: socket.socket, dst: socket.socket, faulty: bool) -> None:
        seen = b""
        position = 0
        starts: list[int] = []
        try:
            while data := src.recv(1 << 16):
                buf = bytearray(data)
                if faulty and self._flip_at is not None and 0 <= self._flip_at - position < len(buf):
                    buf[self._flip_at - position] ^= 0x5A
                    self.fired.set()
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


class MessageProxy(_Relay):
    """A TCP relay in front of a receiver that parses the sender's stream message by message (wire v2)
    and tampers with it: messages are counted from 0 (CLIENT_HELLO, CLIENT_AUTH, BEGIN, DATA...).

    ``flip=(k, d)`` flips byte ``d`` of message ``k`` (prefix, body, payload and trailer counted
    together), ``replay=k`` sends message ``k`` twice, ``drop=k`` leaves it out, ``swap=k`` sends
    message ``k + 1`` before ``k``. The receiver's stream is relayed untouched.
    """

    def __init__(self, upstream: str, *, flip: tuple[int, int] | None = None, replay: int | None = None,
                 drop: int | None = None, swap: int | None = None) -> None:
        super().__init__(upstream)
        self._flip, self._replay, self._drop, self._swap = flip, replay, drop, swap
        self.kinds: list[frames.Kind] = []
        """The kinds of the sender's messages seen so far."""
        self._start(self._accept)

    def _relay(self, client: socket.socket, server: socket.socket) -> None:
        self._start(self._pump_messages, client, server)
        self._start(self._pump_raw, server, client)

    def _pump_raw(self, src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(1 << 16):
                dst.sendall(data)
        except OSError:
            pass
        with contextlib.suppress(OSError):
            dst.shutdown(socket.SHUT_WR)

    def _pump_messages(self, src: socket.socket, dst: socket.socket) -> None:
        index = 0
        held: bytes | None = None
        try:
            while (message := self._read_message(src)) is not None:
                out = self._tamper(index, bytearray(message))
                if self._swap == index:
                    held = out
                    self.fired.set()
                else:
                    dst.sendall(out)
                    if held is not None:
                        dst.sendall(held)
                        held = None
                index += 1
        except OSError:
            pass
        with contextlib.suppress(OSError):
            dst.shutdown(socket.SHUT_WR)

    def _tamper(self, index: int, message: bytearray) -> bytes:
        if self._flip is not None and self._flip[0] == index:
            message[self._flip[1]] ^= 0x01
            self.fired.set()
        if self._drop == index:
            self.fired.set()
            return b""
        if self._replay == index:
            self.fired.set()
            return bytes(message) * 2
        return bytes(message)

    def _read_message(self, src: socket.socket) -> bytes | None:
        prefix = _recv_exact(src, frames.PREFIX.size)
        if prefix is None:
            return None
        kind, flags, body_len, payload_len = frames.PREFIX.unpack(prefix)[2:6]
        self.kinds.append(frames.Kind(kind))
        rest = body_len
        if kind == frames.Kind.DATA and not flags & frames.Flag.OUT_OF_BAND:
            rest += payload_len + (frames.TAG_BYTES if flags & frames.Flag.MAC_TRAILER else 0)
        tail = _recv_exact(src, rest)
        return None if tail is None else prefix + tail


def _recv_exact(sock: socket.socket, nbytes: int) -> bytes | None:
    buf = bytearray(nbytes)
    view = memoryview(buf)
    while len(view):
        got = sock.recv_into(view)
        if got == 0:
            return None
        view = view[got:]
    return bytes(buf)


class Pki:
    """A cluster CA with a receiver ("127.0.0.1", "localhost") and a sender certificate, and a second,
    unrelated CA with a sender certificate (``pdrouter.testing.pki``)."""

    def __init__(self, folder: Path) -> None:
        cluster, other = TestCa(folder, "cluster"), TestCa(folder, "other")
        self.other_ca = str(other.ca_path)
        self._receiver = cluster.issue("receiver")
        self._sender = cluster.issue("sender", "prefill.kv.test")
        self._stranger = other.issue("stranger", "prefill.kv.test", trust=cluster)

    def receiver_tls(self) -> TlsFiles:
        return self._receiver

    def sender_tls(self) -> TlsFiles:
        return self._sender

    def stranger_tls(self) -> TlsFiles:
        """A sender with a certificate from another CA (it still trusts the cluster CA)."""
        return self._stranger
