"""A relay in front of every port of a worker, on a second loopback address, that can break its KV stream.

A worker started with ``--host 127.0.0.1 --advertise-host 127.0.0.2`` and fixed ports registers
``127.0.0.2:PORT`` for its gRPC, lane and KV receiver ports; ``WorkerRelay`` listens there and
forwards each connection to ``127.0.0.1:PORT``, so the router's calls and the prefill workers' KV
reach the worker through it, as through a network. ``arm`` makes it break the next DATA message a
sender writes to the KV port (any connection, opened before or after): flip one of its bytes, cut
the connection in the middle of it, or hold the rest of it back until ``release`` (so that a sender
killed meanwhile dies in the middle of a transfer, whatever its timing). The sender's stream is
parsed message by message with the wire format's own prefix (``pdrouter.transfer.frames``), so
payload bytes are never taken for a header.
"""

from __future__ import annotations

import contextlib
import socket
import threading
from collections.abc import Sequence
from dataclasses import dataclass

from pdrouter.transfer.frames import PREFIX, TAG_BYTES, Flag, Kind


@dataclass(frozen=True)
class Fault:
    action: str
    """``flip`` (XOR 0x5A into one byte), ``cut`` (forward up to that byte, then close both sides) or
    ``hold`` (forward up to that byte, then nothing more of that connection until ``release``)."""
    offset: int
    """Bytes into the DATA message, from its prefix's first byte; past the prefix (44 bytes)."""


class _Messages:
    """Where the messages of one sender's stream start (stream offsets) and which kind each is."""

    def __init__(self) -> None:
        self.offset = 0
        """Bytes of the stream fed so far."""
        self._start = 0
        """Where the message being read starts."""
        self._prefix = bytearray()

    def feed(self, data: bytes) -> list[tuple[int, int]]:
        """``(start, kind)`` of each message whose prefix completed in ``data``."""
        found: list[tuple[int, int]] = []
        end = self.offset + len(data)
        pos = max(self.offset, self._start + len(self._prefix))
        while pos < end:
            take = data[pos - self.offset:pos - self.offset + PREFIX.size - len(self._prefix)]
            self._prefix += take
            pos += len(take)
            if len(self._prefix) < PREFIX.size:
                break
            _, _, kind, flags, body_len, payload_len, _, _ = PREFIX.unpack(bytes(self._prefix))
            length = PREFIX.size + body_len
            if not flags & Flag.OUT_OF_BAND:
                length += payload_len
            if flags & Flag.MAC_TRAILER:
                length += TAG_BYTES
            found.append((self._start, kind))
            self._start += length
            self._prefix.clear()
            pos = max(pos, self._start)
        self.offset = end
        return found


class WorkerRelay:
    """Listens on ``listen_host`` at each of ``ports`` and relays to ``upstream_host`` at the same port."""

    def __init__(self, listen_host: str, upstream_host: str, ports: Sequence[int], kv_port: int) -> None:
        self.upstream_host = upstream_host
        self.kv_port = kv_port
        self._lock = threading.Lock()
        self._fault: Fault | None = None
        self.fired = threading.Event()
        """Set once the armed fault was applied."""
        self._released = threading.Event()
        self._socks: list[socket.socket] = []
        self._threads: list[threading.Thread] = []
        self._listeners = [socket.create_server((listen_host, port)) for port in ports]
        for listener, port in zip(self._listeners, ports, strict=True):
            self._start(self._accept, listener, port)

    def arm(self, fault: Fault) -> None:
        """Break the next DATA message sent to the KV port (once)."""
        with self._lock:
            self._fault = fault
            self.fired.clear()
            self._released.clear()

    def release(self) -> None:
        """Let a held connection go on (what its sender wrote before dying, then its end)."""
        self._released.set()

    def close(self) -> None:
        self._released.set()
        for sock in (*self._listeners, *self._socks):
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            sock.close()
        for thread in self._threads:
            thread.join(10)

    def _take(self) -> Fault | None:
        with self._lock:
            fault, self._fault = self._fault, None
            return fault

    def _start(self, target: object, *args: object) -> None:
        thread = threading.Thread(target=target, args=args, daemon=True)  # type: ignore[arg-type]
        self._threads.append(thread)
        thread.start()

    def _accept(self, listener: socket.socket, port: int) -> None:
        while True:
            try:
                client, _ = listener.accept()
            except OSError:
                return
            try:
                server = socket.create_connection((self.upstream_host, port))
            except OSError:
                client.close()  # the worker is gone (killed): the caller sees the connection refused, closed
                continue
            self._socks += [client, server]
            self._start(self._pump, client, server, port == self.kv_port)
            self._start(self._pump, server, client, False)

    def _pump(self, src: socket.socket, dst: socket.socket, kv: bool) -> None:
        messages = _Messages()
        fault: Fault | None = None
        at = -1
        try:
            while data := src.recv(1 << 16):
                buf = bytearray(data)
                first = messages.offset
                if kv:
                    for start, kind in messages.feed(data):
                        if kind == Kind.DATA and fault is None and (fault := self._take()) is not None:
                            at = start + fault.offset
                if fault is not None and first <= at < first + len(buf):
                    index = at - first
                    if fault.action == "flip":
                        buf[index] ^= 0x5A
                    elif fault.action == "hold":
                        dst.sendall(buf[:index])
                        del buf[:index]
                        self.fired.set()
                        self._released.wait(300)
                    else:
                        dst.sendall(buf[:index])
                        self.fired.set()
                        for sock in (src, dst):
                            sock.shutdown(socket.SHUT_RDWR)
                        return
                    self.fired.set()
                    fault = None
                dst.sendall(buf)
        except OSError:
            pass
        with contextlib.suppress(OSError):
            dst.shutdown(socket.SHUT_WR)
