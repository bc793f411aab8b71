"""Key derivation, proofs and MACs (``pdrouter.transfer.integrity``), without sockets."""

from __future__ import annotations

import os
import struct
import threading

import pytest
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes
from hypothesis import given
from hypothesis import strategies as st

from pdrouter.transfer.integrity import ONE_SHOT_BYTES, MacFeed, MacHelper, MacKey, derive_session, proof_matches

HELLO_C, HELLO_S = b'{"nonce":"aa"}', b'{"nonce":"bb"}'


def test_both_sides_derive_the_same_distinct_secrets() -> None:
    a = derive_session("x" * 32, HELLO_C, HELLO_S)
    b = derive_session("x" * 32, HELLO_C, HELLO_S)
    assert a == b
    values = [a.client_proof, a.server_proof, a.client_to_server, a.server_to_client]
    assert len(set(values)) == 4 and all(len(v) == 32 for v in values)


@pytest.mark.parametrize("change", ["token", "client hello", "server hello", "swapped hellos"])
def test_any_change_to_token_or_transcript_changes_everything(change: str) -> None:
    base = derive_session("x" * 32, HELLO_C, HELLO_S)
    other = {
        "token": lambda: derive_session("y" + "x" * 31, HELLO_C, HELLO_S),
        "client hello": lambda: derive_session("x" * 32, HELLO_C + b" ", HELLO_S),
        "server hello": lambda: derive_session("x" * 32, HELLO_C, b'{"nonce":"bc"}'),
        "swapped hellos": lambda: derive_session("x" * 32, HELLO_S, HELLO_C),
    }[change]()
    assert base.client_proof != other.client_proof and base.server_proof != other.server_proof
    assert base.client_to_server != other.client_to_server and base.server_to_client != other.server_to_client


@pytest.mark.parametrize("presented", ["", "é", "\ud800", "zz", "0" * 63, None, 5, ["ab"]])
def test_malformed_proofs_never_match_and_never_raise(presented: object) -> None:
    assert not proof_matches(presented, bytes(32))


def test_a_proof_matches_its_hex() -> None:
    proof = os.urandom(32)
    assert proof_matches(proof.hex(), proof) and proof_matches(proof.hex().upper(), proof)
    last_byte_changed = proof[:-1] + bytes([proof[-1] ^ 0x01])
    assert not proof_matches(last_byte_changed.hex(), proof)


def test_header_tags_bind_the_sequence_number_and_the_key() -> None:
    key = MacKey(os.urandom(32))
    tag = key.header_tag(7, b"message")
    assert key.header_tag(7, b"message") == tag
    assert key.header_tag(8, b"message") != tag
    assert key.header_tag(7, b"messagf") != tag
    assert MacKey(os.urandom(32)).header_tag(7, b"message") != tag


@given(st.binary(min_size=0, max_size=5000), st.lists(st.integers(1, 700), min_size=1, max_size=8))
def test_a_payload_mac_does_not_depend_on_how_the_payload_is_cut(data: bytes, cuts: list[int]) -> None:
    key = MacKey(bytes(range(32)))
    whole = key.payload_mac(3, b"h" * 16)
    whole.update(data)
    pieces = key.payload_mac(3, b"h" * 16)
    offset, i = 0, 0
    while offset < len(data):
        step = cuts[i % len(cuts)]
        pieces.update(memoryview(data)[offset:offset + step])
        offset, i = offset + step, i + 1
    assert pieces.tag() == whole.tag()


@pytest.mark.parametrize("size", [0, 1000, ONE_SHOT_BYTES - 1, ONE_SHOT_BYTES, ONE_SHOT_BYTES + 1,
                                  3 * ONE_SHOT_BYTES + 7])
def test_small_payloads_hashed_in_one_call_get_the_incremental_tag(size: int) -> None:
    """Below ONE_SHOT_BYTES pieces are gathered and hashed at once, above it incrementally: either way
    the tag is AES-GMAC over the header tag and the payload, computed here independently."""
    raw_key, header, data = os.urandom(32), os.urandom(16), os.urandom(size)
    reference = Cipher(algorithms.AES(raw_key), modes.GCM(struct.pack("<QI", 5, 1))).encryptor()
    reference.authenticate_additional_data(header + data)
    reference.finalize()
    mac = MacKey(raw_key).payload_mac(5, header)
    for start in range(0, size, 100_000):
        mac.update(memoryview(data)[start:start + 100_000])
    assert mac.tag() == reference.tag


@pytest.mark.parametrize("prepared", [5, 6])
def test_a_context_made_ahead_gives_the_same_tag_and_only_for_its_message(prepared: int) -> None:
    """``MacKey.prepare`` makes the running context of one message's payload while the connection
    idles: that message's tag is unchanged, and another message never uses it."""
    raw_key, header, data = os.urandom(32), os.urandom(16), os.urandom(3 * ONE_SHOT_BYTES)
    reference = Cipher(algorithms.AES(raw_key), modes.GCM(struct.pack("<QI", 5, 1))).encryptor()
    reference.authenticate_additional_data(header + data)
    reference.finalize()
    key = MacKey(raw_key)
    key.prepare(prepared)
    for _ in range(2):  # the second message 5 makes its own context
        mac = key.payload_mac(5, header)
        mac.update_all([memoryview(data)[i:i + ONE_SHOT_BYTES] for i in range(0, len(data), ONE_SHOT_BYTES)])
        assert mac.tag() == reference.tag
    assert (key._spare is None) == (prepared == 5)


def test_the_payload_mac_binds_header_tag_and_sequence_number() -> None:
    key = MacKey(os.urandom(32))

    def tag(seq: int, header: bytes, data: bytes) -> bytes:
        mac = key.payload_mac(seq, header)
        mac.update(data)
        return mac.tag()

    base = tag(1, b"a" * 16, b"payload")
    assert base != tag(2, b"a" * 16, b"payload") != tag(1, b"b" * 16, b"payload") != tag(1, b"a" * 16, b"payloae")
    assert key.header_tag(1, b"a" * 16 + b"payload") != base  # header and payload nonces differ


def test_the_helper_thread_gives_the_inline_result() -> None:
    key = MacKey(os.urandom(32))
    pieces = [os.urandom(n) for n in (1000, 300_000, 1 << 20, 5, 700_000)]
    inline = MacFeed(key.payload_mac(9, bytes(16)), None, 1 << 20)
    helper = MacHelper("test-mac")
    try:
        offloaded = MacFeed(key.payload_mac(9, bytes(16)), helper, 1 << 20)
        for piece in pieces:
            inline.add(piece)
            offloaded.add(piece)
        assert offloaded.finish() == inline.finish()
    finally:
        helper.close()
    assert not [t for t in threading.enumerate() if t.name == "test-mac"]
