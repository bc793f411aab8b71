"""Raw HTTP/2 peers of a gRPC server, for the tests and benchmark of its limits: the slow, idle,
huge or credential-less connections a grpc client library would never make.

Each :func:`probe` opens one connection and behaves as ``kind`` says, then waits (at most
``wait_s``) for the server to end the call (a ``grpc-status``, or a reset) or to close the
connection, and reports what came and when. Built on the ``h2`` package (the dev extra).
"""

from __future__ import annotations

import asyncio
import contextlib
import struct
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

KINDS = ("silent", "slow-preface", "idle", "huge", "slow", "call")
"""``silent``: connect and send nothing; ``slow-preface``: the HTTP/2 preface a byte at a time;
``idle``: the preface and settings, then no call; ``huge``: a call whose message announces
``announce`` bytes, sent as fast as flow control lets it; ``slow``: the same, one byte every
``trickle_s``; ``call``: a call with ``message`` whole (its headers carry ``metadata``)."""


@dataclass(frozen=True)
class ProbeResult:
    outcome: str
    """``ended`` (the server ended the call), ``closed`` (it closed the connection, or sent GOAWAY
    and closed it), ``open`` (neither within the wait)."""
    status: int | None
    """The call's ``grpc-status``, when one came."""
    message: str
    """The call's ``grpc-message``, when one came."""
    elapsed_s: float
    """From the connection's opening to the outcome."""
    sent: int
    """Bytes of the request message sent before the outcome."""
    settings: dict[int, int]
    """The server's HTTP/2 settings, when they came."""


def _h2() -> Any:
    try:
        import h2.config
        import h2.connection
        import h2.events
        import h2.exceptions
    except ImportError as exc:  # pragma: no cover - the dev extra has it
        raise ImportError("the gRPC probe needs the h2 package: pip install -e '.[dev]'") from exc
    return h2


async def probe(host: str, port: int, kind: str, *, method: str = "/pdrouter.v1.Router/Generate",
                metadata: Sequence[tuple[str, str]] = (), announce: int = 60 << 20, message: bytes = b"",
                trickle_s: float = 0.5, wait_s: float = 30.0) -> ProbeResult:
    """One connection to the gRPC server at ``host:port`` behaving as ``kind`` (:data:`KINDS`)."""
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}, not {kind!r}")
    h2 = _h2()
    t0 = time.monotonic()
    reader, writer = await asyncio.open_connection(host, port)
    conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True, header_encoding="utf-8"))
    state: dict[str, Any] = {"status": None, "message": "", "sent": 0, "settings": {}}
    done = asyncio.get_running_loop().create_future()

    def finish(outcome: str) -> None:
        if not done.done():
            done.set_result(outcome)

    conn.initiate_connection()  # before anything the server sends is parsed
    preface = conn.data_to_send()
    parse = kind not in ("silent", "slow-preface")  # these never finish their side of the handshake
    if parse:
        writer.write(preface)  # first: the reader answers the server's settings behind it

    async def read() -> None:
        with contextlib.suppress(ConnectionError):
            while data := await reader.read(65536):
                if not parse:
                    continue
                try:
                    events = conn.receive_data(data)
                except h2.exceptions.ProtocolError:
                    break
                for event in events:
                    if isinstance(event, h2.events.RemoteSettingsChanged):
                        state["settings"] = {int(k): v.new_value for k, v in event.changed_settings.items()}
                    elif isinstance(event, (h2.events.ResponseReceived, h2.events.TrailersReceived)):
                        headers = dict(event.headers)
                        if "grpc-status" in headers:
                            state["status"] = int(headers["grpc-status"])
                            state["message"] = headers.get("grpc-message", "")
                    elif isinstance(event, (h2.events.StreamEnded, h2.events.StreamReset)):
                        finish("ended")
                    elif isinstance(event, h2.events.ConnectionTerminated):
                        finish("closed")
                pending = conn.data_to_send()
                if pending and not writer.is_closing():
                    writer.write(pending)
        finish("closed")

    async def send() -> None:
        with contextlib.suppress(ConnectionError, RuntimeError):
            if kind == "silent":
                return
            if kind == "slow-preface":
                for i in range(len(preface)):
                    writer.write(preface[i:i + 1])
                    await writer.drain()
                    await asyncio.sleep(trickle_s)
                return
            if kind == "idle":
                return
            stream = conn.get_next_available_stream_id()
            conn.send_headers(stream, [(":method", "POST"), (":scheme", "http"), (":path", method),
                                       (":authority", f"{host}:{port}"), ("content-type", "application/grpc"),
                                       ("te", "trailers"), *metadata])
            if kind == "call":
                conn.send_data(stream, b"\0" + struct.pack(">I", len(message)) + message, end_stream=True)
                writer.write(conn.data_to_send())
                state["sent"] = len(message)
                return
            conn.send_data(stream, b"\0" + struct.pack(">I", announce))
            writer.write(conn.data_to_send())
            while not done.done() and state["sent"] < announce:
                if kind == "slow":
                    chunk = 1
                    await asyncio.sleep(trickle_s)
                else:
                    chunk = min(announce - state["sent"], conn.local_flow_control_window(stream),
                                conn.max_outbound_frame_size)
                    if chunk <= 0:
                        await asyncio.sleep(0.01)  # the server's window is shut: wait for it to open
                        continue
                if done.done():
                    break
                conn.send_data(stream, b"x" * chunk)
                writer.write(conn.data_to_send())
                state["sent"] += chunk
                await writer.drain()

    reading = asyncio.ensure_future(read())
    sending = asyncio.ensure_future(send())
    try:
        outcome = await asyncio.wait_for(asyncio.shield(done), wait_s)
    except TimeoutError:
        outcome = "open"
    elapsed = time.monotonic() - t0
    for task in (sending, reading):
        task.cancel()
    writer.close()
    with contextlib.suppress(BaseException):
        await asyncio.gather(sending, reading, return_exceptions=True)
    return ProbeResult(outcome, state["status"], state["message"], elapsed, state["sent"], state["settings"])
