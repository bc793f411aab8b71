from __future__ import annotations

import json

import pytest

from pdrouter.core.errors import IncompatibleError, StaleEpochError
from pdrouter.transfer import frames
from pdrouter.transfer.errors import ChecksumError, ErrorCode, ProtocolError, code_for_error, error_for_code
from pdrouter.transfer.frame_plan import FrameSpan


def split(message: bytes) -> tuple[bytes, bytes]:
    """An encoded message sealed with the handshake's tag, as (prefix, body)."""
    prefix, _ = frames.seal(message, frames.plain_tag)
    return prefix, message[frames.PREFIX.size:]


@pytest.mark.parametrize("msg", [
    frames.ClientHello(epoch=5, compat_hash="c", backend="tcp", nonce="n1", ack_every=1 << 24),
    frames.ServerHello(epoch=6, compat_hash="c", backend="gloo", nonce="n2"),
    frames.ClientAuth(proof="ab" * 32),
    frames.ServerAuth(proof="cd" * 32),
    frames.Ready("127.0.0.1", 1234, "p/"),
    frames.Begin("req-1", 9, "c", (4, 5, 6), 1, 0, 32),
    frames.End("req-1", 3, 4096),
    frames.Done("req-1"),
    frames.ErrorMsg("req-1", int(ErrorCode.CHECKSUM), "bad"),
])
def test_control_messages_round_trip(msg: frames.Control) -> None:
    prefix, body = split(frames.encode_control(msg))
    assert frames.decode_control(frames.verify(prefix, body)) == msg


def test_data_header_round_trip() -> None:
    span = FrameSpan(2, 5, ((7, 3), (40, 1)))
    message = frames.encode_data("req-9", 17, span, flags=frames.Flag.MAC_TRAILER, payload_len=12345,
                               payload_checksum=99)
    header = frames.verify(*split(message))
    assert (header.kind, header.flags, header.payload_len, header.payload_checksum) == (
        frames.Kind.DATA, frames.Flag.MAC_TRAILER, 12345, 99)
    data = frames.decode_data(header)
    assert (data.transfer_id, data.seq, data.span) == ("req-9", 17, span)
    assert data.span.runs == ((7, 3), (40, 1))


def test_ack_round_trip() -> None:
    assert frames.decode_ack(frames.verify(*split(frames.encode_ack(1 << 40)))) == 1 << 40


@pytest.mark.parametrize("offset", [5, 12, 20, 30, 40, 50, 60])
def test_any_flipped_header_byte_is_caught(offset: int) -> None:
    prefix, body = split(frames.encode_data("req-1", 0, FrameSpan(0, 1, ((3, 4),)), flags=frames.Flag.NONE,
                                          payload_len=800, payload_checksum=1))
    sealed = bytearray(prefix + body)
    sealed[offset] ^= 0x10
    with pytest.raises((ChecksumError, ProtocolError, IncompatibleError)):
        frames.verify(bytes(sealed[:frames.PREFIX.size]), bytes(sealed[frames.PREFIX.size:]))


def test_header_checksum_mismatch_is_a_checksum_error() -> None:
    prefix, body = split(frames.encode_control(frames.Done("req-1")))
    with pytest.raises(ChecksumError, match="corrupted"):
        frames.verify(prefix, body.replace(b"req-1", b"req-2"))


def test_wrong_magic_and_version() -> None:
    prefix, _ = split(frames.encode_control(frames.Done("x")))
    with pytest.raises(ProtocolError, match="not a KV transfer peer"):
        frames.parse_prefix(b"HTTP" + prefix[4:])
    with pytest.raises(IncompatibleError, match="wire version 9"):
        frames.parse_prefix(prefix[:4] + bytes([9]) + prefix[5:])
    with pytest.raises(IncompatibleError, match="wire version 1"):  # the checksummed format before MACs
        frames.parse_prefix(prefix[:4] + bytes([1]) + prefix[5:])


@pytest.mark.parametrize("body", [b"not json", b"[]", b'{"transfer_id": 5}', b'{"transfer_id": "x", "extra": 1}'])
def test_malformed_control_bodies(body: bytes) -> None:
    header = frames.verify(*split(frames.encode(frames.Kind.DONE, body)))
    with pytest.raises(ProtocolError):
        frames.decode_control(header)


@pytest.mark.parametrize("ids, error", [
    ([1, 2], "has the wrong type"),  # the JSON list of wire version 2
    ("01000000zz000000", "must be hex digits"),
    ("010000000200", "whole 4-byte ids"),
])
def test_begin_block_ids_must_be_packed_ids(ids: object, error: str) -> None:
    raw = {"transfer_id": "t", "receiver_epoch": 1, "compat_hash": "c", "dst_block_ids": ids,
           "skip_blocks": 0, "layer_start": 0, "layer_end": 1}
    header = frames.verify(*split(frames.encode(frames.Kind.BEGIN, json.dumps(raw).encode())))
    with pytest.raises(ProtocolError, match=error):
        frames.decode_control(header)


def test_begin_block_ids_round_trip_as_packed_hex() -> None:
    for ids in [(), (0,), (7, 8, 9, 3), tuple(range(1000, 1138)), (2**32 - 1,)]:
        begin = frames.Begin("t", 1, "c", ids, 0, 0, 32)
        encoded = frames.encode_control(begin)
        assert frames.decode_control(frames.verify(*split(encoded))) == begin
        assert b"[" not in encoded  # one string, not a JSON list
    with pytest.raises(ValueError, match=r"BEGIN.dst_block_ids: ids must be integers in \[0, 2\^32\)"):
        frames.encode_control(frames.Begin("t", 1, "c", (1, -1), 0, 0, 32))


def test_error_codes_rebuild_the_same_class() -> None:
    for exc in (ChecksumError("x"), StaleEpochError("y"), IncompatibleError("z")):
        rebuilt = error_for_code(code_for_error(exc), exc.message)
        assert type(rebuilt) is type(exc) and rebuilt.message == exc.message
    assert isinstance(error_for_code(999, "?"), ProtocolError)


@pytest.mark.parametrize("tid", ["req-1", 'a"b', "é", "x\\y", "tab\there", "\x7f", "{}"])
def test_a_done_decodes_to_its_id_whatever_the_id_holds(tid: str) -> None:
    assert frames.decode_done(frames.verify(*split(frames.encode_control(frames.Done(tid))))) == tid


@pytest.mark.parametrize("body", [b'{"transfer_id":"a\x01"}', b'{"transfer_id":"a"', b'{"transfer_id":1}',
                                  b'{"transfer_id":"a","x":1}'])
def test_a_malformed_done_is_refused(body: bytes) -> None:
    with pytest.raises(ProtocolError):
        frames.decode_done(frames.verify(*split(frames.encode(frames.Kind.DONE, body))))
