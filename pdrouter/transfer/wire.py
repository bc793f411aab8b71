"""The wire format: one versioned frame header, and the messages it carries.

Every message is ``prefix | body | payload | trailer`` (the last two only for DATA)::

    prefix (36 bytes, little endian)
      magic "KVTX" | version u8 | kind u8 | flags u16 | body_len u32
      | payload_len u64 | payload_checksum u64 (xxh3-64) | header_checksum u64 (xxh3-64)

``header_checksum`` covers the prefix (with that field zero) and the body, so a corrupted header
can never steer bytes into the wrong blocks. A payload's own xxh3-64 is either in
``payload_checksum`` (payloads that travel out of band, hashed before sending) or, for payloads on
the socket, in an 8-byte trailer right after the payload (flag CHECKSUM_TRAILER): the sender hashes
each chunk just before writing it, while it is hot in cache, which makes checksums nearly free.

DATA bodies are binary (transfer id, sequence number, layer range, destination runs); ACK is
one u64; the other, rarer messages carry a small JSON object that is turned into (and only into)
the frozen dataclasses below. Nothing else leaves this module as a dict.
"""

from __future__ import annotations

import dataclasses
import json
import struct
from dataclasses import dataclass
from enum import IntEnum, IntFlag
from typing import Any, ClassVar

import numpy as np
import xxhash

from pdrouter.core.errors import IncompatibleError
from pdrouter.transfer.errors import ChecksumError, ProtocolError
from pdrouter.transfer.frame_plan import FrameSpan

MAGIC = b"KVTX"
WIRE_VERSION = 1
PREFIX = struct.Struct("<4sBBHIQQQ")
MAX_BODY_BYTES = 8 << 20
_DATA_FIXED = struct.Struct("<IIII")
_ACK = struct.Struct("<Q")
TRAILER = struct.Struct("<Q")


class Kind(IntEnum):
    CLIENT_HELLO = 1
    SERVER_HELLO = 2
    CLIENT_AUTH = 3
    READY = 4
    BEGIN = 5
    DATA = 6
    END = 7
    ACK = 8
    DONE = 9
    ERROR = 10


class Flag(IntFlag):
    NONE = 0
    OUT_OF_BAND = 1
    """The payload travels over the process group, not this socket."""
    NO_CHECKSUM = 2
    """The payload is not hashed (CUDA pools, or checksums turned off)."""
    CHECKSUM_TRAILER = 4
    """The payload's xxh3-64 follows it as an 8-byte trailer (the sender hashes while it sends)."""


@dataclass(frozen=True)
class Header:
    """A parsed, verified prefix plus body."""

    kind: Kind
    flags: Flag
    body: bytes
    payload_len: int
    payload_checksum: int


def encode(kind: Kind, body: bytes = b"", *, flags: Flag = Flag.NONE, payload_len: int = 0,
           payload_checksum: int = 0) -> bytes:
    """Prefix and body of one message (the payload, if any, follows separately)."""
    fields = (MAGIC, WIRE_VERSION, int(kind), int(flags), len(body), payload_len, payload_checksum)
    unsigned = PREFIX.pack(*fields, 0)
    digest = xxhash.xxh3_64(unsigned)
    digest.update(body)
    return PREFIX.pack(*fields, digest.intdigest()) + body


def parse_prefix(raw: bytes) -> tuple[int, int, int, int, int, int]:
    """(kind, flags, body_len, payload_len, payload_checksum, header_checksum) of a 36-byte prefix."""
    magic, version, kind, flags, body_len, payload_len, payload_ck, header_ck = PREFIX.unpack(raw)
    if magic != MAGIC:
        raise ProtocolError(f"not a kvtransfer peer (magic {magic!r})")
    if version != WIRE_VERSION:
        raise IncompatibleError(f"peer speaks kvtransfer wire version {version}, this side {WIRE_VERSION}")
    if body_len > MAX_BODY_BYTES:
        raise ProtocolError(f"message body of {body_len} bytes exceeds {MAX_BODY_BYTES}")
    return kind, flags, body_len, payload_len, payload_ck, header_ck


def verify(raw_prefix: bytes, body: bytes) -> Header:
    """Check the header checksum and the kind; ChecksumError / ProtocolError otherwise."""
    kind, flags, _, payload_len, payload_ck, header_ck = parse_prefix(raw_prefix)
    digest = xxhash.xxh3_64(raw_prefix[:-8] + bytes(8))
    digest.update(body)
    if digest.intdigest() != header_ck:
        raise ChecksumError("frame header checksum mismatch: the stream is corrupted")
    try:
        return Header(Kind(kind), Flag(flags), body, payload_len, payload_ck)
    except ValueError:
        raise ProtocolError(f"unknown message kind {kind}") from None


# -- JSON control messages --------------------------------------------------------------------

@dataclass(frozen=True)
class ClientHello:
    KIND: ClassVar[Kind] = Kind.CLIENT_HELLO
    epoch: int
    compat_hash: str
    backend: str
    nonce: str
    ack_every: int
    """Acknowledge received payload bytes whenever this many are unacknowledged (0: never)."""


@dataclass(frozen=True)
class ServerHello:
    KIND: ClassVar[Kind] = Kind.SERVER_HELLO
    epoch: int
    compat_hash: str
    backend: str
    nonce: str
    mac: str


@dataclass(frozen=True)
class ClientAuth:
    KIND: ClassVar[Kind] = Kind.CLIENT_AUTH
    mac: str


@dataclass(frozen=True)
class Ready:
    """Handshake accepted; for gloo/NCCL, where to meet to build the pair's process group."""

    KIND: ClassVar[Kind] = Kind.READY
    store_host: str = ""
    store_port: int = 0
    group_prefix: str = ""


@dataclass(frozen=True)
class Begin:
    KIND: ClassVar[Kind] = Kind.BEGIN
    transfer_id: str
    receiver_epoch: int
    compat_hash: str
    dst_block_ids: tuple[int, ...]
    skip_blocks: int
    layer_start: int
    layer_end: int


@dataclass(frozen=True)
class End:
    KIND: ClassVar[Kind] = Kind.END
    transfer_id: str
    frames: int
    nbytes: int


@dataclass(frozen=True)
class Done:
    KIND: ClassVar[Kind] = Kind.DONE
    transfer_id: str


@dataclass(frozen=True)
class ErrorMsg:
    """A transfer failed (``transfer_id`` empty: the whole connection is going away)."""

    KIND: ClassVar[Kind] = Kind.ERROR
    transfer_id: str
    code: int
    message: str


Control = ClientHello | ServerHello | ClientAuth | Ready | Begin | End | Done | ErrorMsg
_CONTROL: dict[Kind, type[Control]] = {
    cls.KIND: cls for cls in (ClientHello, ServerHello, ClientAuth, Ready, Begin, End, Done, ErrorMsg)
}
_FIELD_TYPES: dict[str, tuple[type, ...]] = {"int": (int,), "str": (str,), "tuple[int, ...]": (list,)}


def encode_control(msg: Control) -> bytes:
    body = json.dumps(dataclasses.asdict(msg), separators=(",", ":")).encode()
    return encode(msg.KIND, body)


def decode_control(header: Header) -> Control:
    """The control message in ``header``; ProtocolError when the body does not match its kind."""
    cls = _CONTROL.get(header.kind)
    if cls is None:
        raise ProtocolError(f"{header.kind.name} is not a control message")
    try:
        raw: Any = json.loads(header.body)
    except ValueError:
        raise ProtocolError(f"{header.kind.name} body is not JSON") from None
    fields = dataclasses.fields(cls)
    if not isinstance(raw, dict) or set(raw) != {f.name for f in fields}:
        raise ProtocolError(f"{header.kind.name} body has the wrong fields")
    values: dict[str, Any] = {}
    for f in fields:
        value = raw[f.name]
        if not isinstance(value, _FIELD_TYPES[str(f.type)]) or isinstance(value, bool):
            raise ProtocolError(f"{header.kind.name}.{f.name} has the wrong type")
        if isinstance(value, list):
            if not all(isinstance(v, int) and not isinstance(v, bool) for v in value):
                raise ProtocolError(f"{header.kind.name}.{f.name} must be a list of ints")
            value = tuple(value)
        values[f.name] = value
    return cls(**values)


# -- binary DATA and ACK ------------------------------------------------------------------------

@dataclass(frozen=True)
class DataHeader:
    """Which transfer a DATA frame belongs to and where (receiver's block ids) its payload lands."""

    transfer_id: str
    seq: int
    span: FrameSpan
    runs: np.ndarray
    """The span's runs as an (n, 2) int64 array: (first block, count)."""


def encode_data(transfer_id: str, seq: int, span: FrameSpan, *, flags: Flag, payload_len: int,
                payload_checksum: int) -> bytes:
    tid = transfer_id.encode()
    runs = np.asarray(span.runs, dtype="<u4").reshape(-1, 2)
    body = (struct.pack("<H", len(tid)) + tid
            + _DATA_FIXED.pack(seq, span.layer_start, span.layer_end, len(runs)) + runs.tobytes())
    return encode(Kind.DATA, body, flags=flags, payload_len=payload_len, payload_checksum=payload_checksum)


def decode_data(header: Header) -> DataHeader:
    body = header.body
    try:
        (tid_len,) = struct.unpack_from("<H", body, 0)
        tid = body[2:2 + tid_len].decode()
        seq, layer_start, layer_end, n_runs = _DATA_FIXED.unpack_from(body, 2 + tid_len)
        offset = 2 + tid_len + _DATA_FIXED.size
        if len(body) != offset + 8 * n_runs:
            raise ValueError("runs do not fill the body")
        runs = np.frombuffer(body, dtype="<u4", count=2 * n_runs, offset=offset).reshape(-1, 2)
    except (struct.error, ValueError, UnicodeDecodeError) as exc:
        raise ProtocolError(f"malformed DATA header: {exc}") from None
    span = FrameSpan(layer_start, layer_end, tuple((int(s), int(c)) for s, c in runs.tolist()))
    return DataHeader(tid, seq, span, runs.astype(np.int64))


def encode_ack(nbytes: int) -> bytes:
    return encode(Kind.ACK, _ACK.pack(nbytes))


def decode_ack(header: Header) -> int:
    if len(header.body) != _ACK.size:
        raise ProtocolError("malformed ACK")
    return int(_ACK.unpack(header.body)[0])
