"""The wire format: one versioned frame header, and the messages it carries.

Every message is ``prefix | body | payload | trailer`` (the last two only for DATA)::

    prefix (44 bytes, little endian)
      magic "KVTX" | version u8 | kind u8 | flags u16 | body_len u32
      | payload_len u64 | payload_checksum u64 | tag 16 bytes

``tag`` covers the prefix (with the tag zero) and the body. During the handshake, before any key
exists, it is an xxh3-128 (against accidental corruption only); from then on it is the MAC of the
message under the direction's key and sequence number (``pdrouter.transfer.integrity``), so a
corrupted, forged, replayed or reordered header can never steer bytes into the wrong blocks.
A payload on the socket is followed by its own 16-byte MAC (flag MAC_TRAILER), which the sender
computes as it sends and the receiver as the bytes land. ``payload_checksum`` is an xxh3-64 of a
payload that travels out of band (gloo), computed before sending and authenticated with the header.

DATA bodies are binary (transfer id, sequence number, layer range, destination runs); ACK is
one u64; the other, rarer messages carry a small JSON object that is turned into (and only into)
the frozen dataclasses below. Nothing else leaves this module as a dict. A field of ids (BEGIN's
``dst_block_ids``) travels in it as one string, the hex of the ids as little-endian u32s (version 3):
a prompt's hundred-odd block ids cost the sender and the receiver a number each to write and parse
as a JSON list, and the receiver a type check each.
"""

from __future__ import annotations

import dataclasses
import hmac
import json
import struct
from collections.abc import Callable
from dataclasses import dataclass
from enum import IntEnum, IntFlag
from typing import Any, ClassVar, NamedTuple

import xxhash

from pdrouter.core.errors import IncompatibleError
from pdrouter.transfer.errors import ChecksumError, ProtocolError
from pdrouter.transfer.frame_plan import FrameSpan

MAGIC = b"KVTX"
WIRE_VERSION = 3
PREFIX = struct.Struct("<4sBBHIQQ16s")
TAG_OFFSET = PREFIX.size - 16
TAG_BYTES = 16
MAX_BODY_BYTES = 8 << 20
_DATA_FIXED = struct.Struct("<IIII")
_ACK = struct.Struct("<Q")
_ZERO_TAG = bytes(TAG_BYTES)

TagFn = Callable[[bytes], bytes]
"""Computes a message's tag from its prefix (tag zero) and body."""


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
    SERVER_AUTH = 11


HANDSHAKE_KINDS = frozenset({Kind.CLIENT_HELLO, Kind.SERVER_HELLO, Kind.CLIENT_AUTH, Kind.SERVER_AUTH,
                             Kind.ERROR})
"""What may arrive before the keys are installed."""


class Flag(IntFlag):
    NONE = 0
    OUT_OF_BAND = 1
    """The payload travels over the process group, not this socket."""
    NO_CHECKSUM = 2
    """The payload carries no check of its own (a CUDA pool's; or under TLS with payload MACs off)."""
    MAC_TRAILER = 4
    """The payload's 16-byte MAC follows it (the sender hashes while it sends)."""


_KINDS: dict[int, Kind] = {int(kind): kind for kind in Kind}
_FLAGS = frozenset(range(2 * max(Flag)))
"""Every kind made once, and every combination of the known flags: an enum call per message costs
more than the lookup."""
OUT_OF_BAND = int(Flag.OUT_OF_BAND)
NO_CHECKSUM = int(Flag.NO_CHECKSUM)
MAC_TRAILER = int(Flag.MAC_TRAILER)
"""The flags as plain ints, for tests on ``Header.flags`` (``&`` on the enum runs Python code)."""


class Prefix(NamedTuple):
    kind: int
    flags: int
    body_len: int
    payload_len: int
    payload_checksum: int
    tag: bytes


class Header(NamedTuple):
    """A parsed, verified prefix plus body (a named tuple: made once per message)."""

    kind: Kind
    flags: int
    """``Flag`` bits, as a plain int (test them with ``MAC_TRAILER`` and its kind)."""
    body: bytes
    payload_len: int
    payload_checksum: int
    tag: bytes = b""
    seq: int = -1
    """The message's number in its direction (-1 before the keys were installed)."""


def encode(kind: Kind, body: bytes = b"", *, flags: Flag = Flag.NONE, payload_len: int = 0,
           payload_checksum: int = 0) -> bytes:
    """Prefix (tag still zero: see ``seal``) and body of one message; any payload follows separately."""
    return PREFIX.pack(MAGIC, WIRE_VERSION, int(kind), int(flags), len(body), payload_len, payload_checksum,
                       _ZERO_TAG) + body


def plain_tag(data: bytes) -> bytes:
    """The tag of a handshake message: xxh3-128 (no key exists yet)."""
    return xxhash.xxh3_128_digest(data)


def seal(message: bytes, tag_fn: TagFn) -> tuple[bytes, bytes]:
    """``(prefix with its tag, tag)`` of an ``encode``d message; the body follows the prefix as it was."""
    tag = tag_fn(message)
    return message[:TAG_OFFSET] + tag, tag


def parse_prefix(raw: bytes) -> Prefix:
    """The fields of a 44-byte prefix (not yet verified: only magic, version and size are checked)."""
    magic, version, kind, flags, body_len, payload_len, payload_ck, tag = PREFIX.unpack(raw)
    if magic != MAGIC:
        raise ProtocolError(f"not a KV transfer peer (magic {magic!r})")
    if version != WIRE_VERSION:
        raise IncompatibleError(f"peer speaks KV transfer wire version {version}, this side {WIRE_VERSION}")
    if body_len > MAX_BODY_BYTES:
        raise ProtocolError(f"message body of {body_len} bytes exceeds {MAX_BODY_BYTES}")
    return Prefix(kind, flags, body_len, payload_len, payload_ck, tag)


def verify(raw_prefix: bytes, body: bytes, tag_fn: TagFn = plain_tag, *, seq: int = -1,
           what: str = "checksum", parsed: Prefix | None = None) -> Header:
    """Check the tag (``tag_fn``) and the kind; ChecksumError / ProtocolError otherwise (``parsed``:
    ``parse_prefix(raw_prefix)`` when the caller has it already)."""
    p = parse_prefix(raw_prefix) if parsed is None else parsed
    if not hmac.compare_digest(tag_fn(raw_prefix[:TAG_OFFSET] + _ZERO_TAG + body), p.tag):
        raise ChecksumError(f"frame header {what} mismatch: the stream is corrupted"
                            + (" (or a frame was forged, replayed, reordered or dropped)" if seq >= 0 else ""))
    kind = _KINDS.get(p.kind)
    known = p.flags in _FLAGS
    if not known:
        try:
            Flag(p.flags)
            known = True
        except ValueError:
            pass
    if kind is None or not known:
        raise ProtocolError(f"unknown message kind {p.kind} or flags {p.flags}")
    return Header(kind, p.flags, body, p.payload_len, p.payload_checksum, p.tag, seq)


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
    """The receiver's side of the hellos: nothing in it depends on the token."""

    KIND: ClassVar[Kind] = Kind.SERVER_HELLO
    epoch: int
    compat_hash: str
    backend: str
    nonce: str


@dataclass(frozen=True)
class ClientAuth:
    """The sender's proof of the token (hex), sent first."""

    KIND: ClassVar[Kind] = Kind.CLIENT_AUTH
    proof: str


@dataclass(frozen=True)
class ServerAuth:
    """The receiver's proof (hex), sent only once the sender's verified."""

    KIND: ClassVar[Kind] = Kind.SERVER_AUTH
    proof: str


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


Control = ClientHello | ServerHello | ClientAuth | ServerAuth | Ready | Begin | End | Done | ErrorMsg
_CONTROL: dict[Kind, type[Control]] = {
    cls.KIND: cls for cls in (ClientHello, ServerHello, ClientAuth, ServerAuth, Ready, Begin, End, Done, ErrorMsg)
}


_FIELDS: dict[type[Control], tuple[dataclasses.Field[Any], ...]] = {
    cls: dataclasses.fields(cls) for cls in _CONTROL.values()}
_NAMES: dict[type[Control], frozenset[str]] = {
    cls: frozenset(f.name for f in fields) for cls, fields in _FIELDS.items()}
_IDS = "tuple[int, ...]"
_FIELD_TYPES: dict[str, tuple[type, ...]] = {"int": (int,), "str": (str,), _IDS: (str,)}
_SPECS: dict[type[Control], tuple[tuple[str, tuple[type, ...]], ...]] = {
    cls: tuple((f.name, _FIELD_TYPES[str(f.type)]) for f in fields) for cls, fields in _FIELDS.items()}
"""Each control message's fields as (name, the JSON types it takes)."""
_ID_FIELDS: dict[type[Control], frozenset[str]] = {
    cls: frozenset(f.name for f in fields if str(f.type) == _IDS) for cls, fields in _FIELDS.items()}
"""Each control message's fields of ids: sent packed (``_pack_ids``)."""


def _pack_ids(ids: tuple[int, ...], what: str) -> str:
    """``ids`` as the hex of little-endian u32s; ValueError naming ``what`` for an id outside [0, 2^32)."""
    try:
        return struct.pack(f"<{len(ids)}I", *ids).hex()
    except struct.error:
        raise ValueError(f"{what}: ids must be integers in [0, 2^32)") from None


def _unpack_ids(text: str, what: str) -> tuple[int, ...]:
    """The ids ``_pack_ids`` wrote; ProtocolError naming ``what`` for anything else."""
    try:
        data = bytes.fromhex(text)
    except ValueError:
        raise ProtocolError(f"{what} must be hex digits") from None
    if len(data) % 4:
        raise ProtocolError(f"{what} must be whole 4-byte ids, got {len(data)} bytes")
    return struct.unpack(f"<{len(data) >> 2}I", data)
_JSON = json.JSONEncoder(separators=(",", ":"))
"""One encoder for every message: ``json.dumps`` with separators builds a new one per call."""


def encode_control(msg: Control) -> bytes:
    # The fields as they are (ints, strings, tuples of ints): ``dataclasses.asdict`` would deep-copy
    # a BEGIN's block ids one by one, the larger part of encoding it.
    fields = {f.name: getattr(msg, f.name) for f in _FIELDS[type(msg)]}
    for name in _ID_FIELDS[type(msg)]:
        fields[name] = _pack_ids(fields[name], f"{msg.KIND.name}.{name}")
    return encode(msg.KIND, _JSON.encode(fields).encode())


def decode_control(header: Header) -> Control:
    """The control message in ``header``; ProtocolError when the body does not match its kind."""
    cls = _CONTROL.get(header.kind)
    if cls is None:
        raise ProtocolError(f"{header.kind.name} is not a control message")
    try:
        raw: Any = json.loads(header.body)
    except (ValueError, RecursionError):  # bad UTF-8 or JSON, digits beyond the int limit, deep nesting
        raise ProtocolError(f"{header.kind.name} body is not JSON") from None
    if not isinstance(raw, dict) or raw.keys() != _NAMES[cls]:
        raise ProtocolError(f"{header.kind.name} body has the wrong fields")
    values: dict[str, Any] = {}
    packed = _ID_FIELDS[cls]
    for name, types in _SPECS[cls]:
        value: Any = raw[name]
        if not isinstance(value, types) or isinstance(value, bool):
            raise ProtocolError(f"{header.kind.name}.{name} has the wrong type")
        values[name] = _unpack_ids(str(value), f"{header.kind.name}.{name}") if name in packed else value
    return cls(**values)


_DONE_OPEN = b'{"transfer_id":"'
_DONE_CLOSE = b'"}'
_PLAIN = bytes(c for c in range(0x20, 0x80) if c not in b'"\\')


def decode_done(header: Header) -> str:
    """The transfer id of a DONE (``decode_control``'s result, without its general machinery in the
    usual case: an id of plain characters, as ``encode_control`` writes it)."""
    body = header.body
    if header.kind is Kind.DONE and body.startswith(_DONE_OPEN) and body.endswith(_DONE_CLOSE):
        raw = body[len(_DONE_OPEN):-len(_DONE_CLOSE)]
        if raw and not raw.translate(None, _PLAIN):  # no escape, quote or control character
            return raw.decode()
    msg = decode_control(header)
    if not isinstance(msg, Done):
        raise ProtocolError(f"{header.kind.name} is not a DONE")
    return msg.transfer_id


# -- binary DATA and ACK ------------------------------------------------------------------------

class DataHeader(NamedTuple):
    """Which transfer a DATA frame belongs to and where (receiver's block ids) its payload lands."""

    transfer_id: str
    seq: int
    span: FrameSpan
    """Its runs are (first block, count) pairs of the receiver's block ids."""


def encode_data(transfer_id: str, seq: int, span: FrameSpan, *, flags: Flag, payload_len: int,
                payload_checksum: int) -> bytes:
    tid = transfer_id.encode()
    flat = [value for run in span.runs for value in run]
    body = (struct.pack("<H", len(tid)) + tid + _DATA_FIXED.pack(seq, span.layer_start, span.layer_end, len(span.runs))
            + struct.pack(f"<{len(flat)}I", *flat))
    return encode(Kind.DATA, body, flags=flags, payload_len=payload_len, payload_checksum=payload_checksum)


def decode_data(header: Header) -> DataHeader:
    # struct rather than numpy: a frame names a handful of runs, and this runs once per frame on
    # the receiver's critical path (a numpy call costs microseconds there, its cache cold).
    body = header.body
    try:
        (tid_len,) = struct.unpack_from("<H", body, 0)
        tid = body[2:2 + tid_len].decode()
        seq, layer_start, layer_end, n_runs = _DATA_FIXED.unpack_from(body, 2 + tid_len)
        offset = 2 + tid_len + _DATA_FIXED.size
        if len(body) != offset + 8 * n_runs:
            raise ValueError("runs do not fill the body")
        flat = struct.unpack_from(f"<{2 * n_runs}I", body, offset)
    except (struct.error, ValueError, UnicodeDecodeError) as exc:
        raise ProtocolError(f"malformed DATA header: {exc}") from None
    runs = tuple(zip(flat[0::2], flat[1::2], strict=True))
    return DataHeader(tid, seq, FrameSpan(layer_start, layer_end, runs))


def encode_ack(nbytes: int) -> bytes:
    return encode(Kind.ACK, _ACK.pack(nbytes))


def decode_ack(header: Header) -> int:
    if len(header.body) != _ACK.size:
        raise ProtocolError("malformed ACK")
    return int(_ACK.unpack(header.body)[0])
