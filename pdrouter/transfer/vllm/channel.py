"""The side channel between a worker process and its vLLM engine's connector: messages and framing.

vLLM runs the connector's worker side in its own worker processes (one per tensor-parallel rank),
which own the KV cache and so host the transfer's receiver and sender. The worker process that
drives the engine (``AsyncLLM``) learns what it needs there, and steers it, over one Unix socket per
rank that it serves (``pdrouter.transfer.vllm.host``) and the connector dials:

```
connector rank r                                      worker process
  Hello(rank, world_size, kv_role) ─▶
                                   ◀─ Welcome(the transfer's identity: token, epoch, backend, TLS, KV port)
  Ready(rank, receiver address, pool geometry) ─▶
  Reserved(key, attempt, target) ─▶                   decode: blocks reserved, KV invited (calls a prefill worker)
  Local(key, cached_tokens) ─▶                        decode: the prompt is computed here
  Received(key, attempt, ok | error, bytes, s) ─▶     decode: the KV landed, or the attempt failed
                                   ◀─ Retry(key)      decode: invite it again (the next prefill worker)
                                   ◀─ GiveUp(key)     decode: compute the prompt here
  Sent(key, ok | error, bytes, s) ─▶                  prefill: the decode side confirmed, or the send failed
```

The socket lives in a directory only the worker's user can open (mode 0700); the secret it
carries (the KV token) never appears in vLLM's configuration, environment or logs. A message is a
4-byte big-endian length and a JSON object with a ``type``.
"""

from __future__ import annotations

import asyncio
import json
import struct
from dataclasses import asdict, dataclass, field, fields
from typing import Any, ClassVar

from pdrouter.core.errors import PdRouterError, UnavailableError
from pdrouter.transfer.errors import code_for_error, error_for_code

MAX_MESSAGE_BYTES = 16 << 20
_LENGTH = struct.Struct(">I")


class ChannelError(UnavailableError):
    """The side channel broke: closed, or a message this end cannot read (the engine went away)."""


@dataclass(frozen=True)
class Hello:
    type: ClassVar[str] = "hello"
    rank: int
    world_size: int
    kv_role: str
    pid: int


@dataclass(frozen=True)
class Welcome:
    type: ClassVar[str] = "welcome"
    auth_token: str = field(repr=False)
    epoch: int
    backend: str
    kv_host: str
    kv_advertise_host: str
    kv_port: int
    """0: any free port; else rank r listens on kv_port + r."""
    tls_ca: str | None = None
    tls_cert: str | None = None
    tls_key: str | None = None
    tcp_congestion: str | None = None
    """The KV connections' TCP congestion control (None: the host's default)."""


@dataclass(frozen=True)
class Ready:
    type: ClassVar[str] = "ready"
    rank: int
    receiver: str
    """host:port of this rank's KV receiver ("" on a prefill-only engine)."""
    num_blocks: int
    block_size: int
    block_bytes: int
    """Bytes of one block across every layer, on this rank."""
    compat_hash: str


@dataclass(frozen=True)
class Reserved:
    type: ClassVar[str] = "reserved"
    key: str
    rank: int
    attempt: int
    target: dict[str, Any]
    cached_tokens: int


@dataclass(frozen=True)
class Local:
    type: ClassVar[str] = "local"
    key: str
    rank: int
    cached_tokens: int


@dataclass(frozen=True)
class Outcome:
    """How one rank's transfer of one request ended (``Received`` and ``Sent`` carry one)."""

    ok: bool
    nbytes: int = 0
    seconds: float = 0.0
    code: int = 0
    """The transfer layer's ``ErrorCode`` when not ok."""
    message: str = ""
    tail_s: float = 0.0
    """Sender: from the end of the forward pass that computed the prompt to the confirmation (the part
    of the transfer that did not overlap the computation)."""

    @classmethod
    def failed(cls, error: BaseException, nbytes: int = 0, seconds: float = 0.0) -> Outcome:
        message = error.message if isinstance(error, PdRouterError) else f"{type(error).__name__}: {error}"
        return cls(False, nbytes, seconds, int(code_for_error(error)), message)

    def error(self) -> PdRouterError | None:
        return None if self.ok else error_for_code(self.code, self.message)


@dataclass(frozen=True)
class Received:
    type: ClassVar[str] = "received"
    key: str
    rank: int
    attempt: int
    outcome: Outcome


@dataclass(frozen=True)
class Sent:
    type: ClassVar[str] = "sent"
    key: str
    rank: int
    outcome: Outcome


@dataclass(frozen=True)
class Retry:
    type: ClassVar[str] = "retry"
    key: str


@dataclass(frozen=True)
class GiveUp:
    type: ClassVar[str] = "give_up"
    key: str
    reason: str


Message = Hello | Welcome | Ready | Reserved | Local | Received | Sent | Retry | GiveUp
_TYPES: dict[str, type[Any]] = {cls.type: cls for cls in (Hello, Welcome, Ready, Reserved, Local, Received, Sent,
                                                          Retry, GiveUp)}


def encode(message: Message) -> bytes:
    body = json.dumps({"type": message.type, **asdict(message)}, separators=(",", ":")).encode()
    return _LENGTH.pack(len(body)) + body


def decode(body: bytes) -> Message:
    try:
        raw = json.loads(body)
        cls = _TYPES[raw.pop("type")]
        if cls is Received or cls is Sent:
            raw["outcome"] = Outcome(**raw["outcome"])
        names = {f.name for f in fields(cls)}
        message: Message = cls(**{k: v for k, v in raw.items() if k in names})
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise ChannelError(f"unreadable side-channel message ({type(exc).__name__}: {exc})") from None
    return message


async def read_message(reader: asyncio.StreamReader) -> Message:
    """The next message; ChannelError when the peer closed or sent garbage."""
    try:
        head = await reader.readexactly(_LENGTH.size)
        (length,) = _LENGTH.unpack(head)
        if length > MAX_MESSAGE_BYTES:
            raise ChannelError(f"side-channel message of {length} bytes (at most {MAX_MESSAGE_BYTES})")
        return decode(await reader.readexactly(length))
    except (asyncio.IncompleteReadError, ConnectionError) as exc:
        raise ChannelError(f"the side channel closed ({type(exc).__name__})") from None


async def write_message(writer: asyncio.StreamWriter, message: Message) -> None:
    try:
        writer.write(encode(message))
        await writer.drain()
    except (ConnectionError, RuntimeError) as exc:
        raise ChannelError(f"the side channel closed ({type(exc).__name__})") from None
