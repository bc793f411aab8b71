"""The KV connection against a hostile peer: token proofs, frame MACs, slow clients, caps, TLS.

Real sockets and threads throughout: hostile peers are raw sockets (or ``FramedSocket``s that
know the token), tampering is done by a relay in front of the receiver.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import select
import socket
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

from pdrouter.core.errors import ConfigError, DeadlineExceededError
from pdrouter.transfer import (
    AuthError,
    Backend,
    ChecksumError,
    ErrorCode,
    KvReceiver,
    KvSender,
    PeerLostError,
    ProtocolError,
    TransferState,
    TransferTarget,
    frames,
)
from pdrouter.transfer.errors import error_for_code
from pdrouter.transfer.frame_plan import FrameSpan
from pdrouter.transfer.framed_socket import FramedSocket
from pdrouter.transfer.handshake import client_handshake

from .factories import TOKEN, FaultyProxy, MessageProxy, Pair, Pki, blocks_equal, make_config, make_layout, wait_until

LAYOUT = make_layout(num_layers=4, num_blocks=64, block_size=16, num_kv_heads=2, head_dim=32)
"""4 KiB of K (or V) per block and layer: 8 blocks and one frame per layer make 64 KiB frames."""


@pytest.fixture
def proxies() -> Iterator[list[MessageProxy]]:
    made: list[MessageProxy] = []
    yield made
    for proxy in made:
        proxy.close()


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    return Pki(tmp_path_factory.mktemp("pki"))


def replace_receiver(pair: Pair, **overrides: object) -> KvReceiver:
    pair.receiver.close()
    pair.receiver = KvReceiver(pair.dst, pair.layout, make_config(**overrides))
    return pair.receiver


def replace_sender(pair: Pair, **overrides: object) -> KvSender:
    pair.sender.close()
    pair.sender = KvSender(pair.src, pair.layout, make_config(**overrides))
    return pair.sender


def raw_client(address: str, **limits: float) -> FramedSocket:
    host, port = address.rsplit(":", 1)
    return FramedSocket.connect(host, int(port), 5.0, 5.0, **limits)


def client_hello(epoch: int = 7, compat: str = "c" * 16) -> bytes:
    return frames.encode_control(frames.ClientHello(epoch, compat, "tcp", "0" * 32, 0))


def closed_within(sock: socket.socket, seconds: float, *, trickle: bytes = b"") -> float | None:
    """Seconds until the peer closed ``sock`` (sending ``trickle`` one byte every 50 ms meanwhile), or None."""
    start = time.monotonic()
    sent = 0
    while time.monotonic() - start < seconds:
        if sent < len(trickle):
            try:
                sock.send(trickle[sent:sent + 1])
                sent += 1
            except OSError:
                return time.monotonic() - start
        if select.select([sock], [], [], 0.05)[0]:
            try:
                if sock.recv(65536) == b"":
                    return time.monotonic() - start
            except OSError:
                return time.monotonic() - start
    return None


def send_all(pair: Pair, target: TransferTarget, src: list[int]) -> Any:
    transfer = pair.sender.open_transfer(target)
    for layer in range(pair.layout.num_layers):
        transfer.send_layers(src, layer)
    return transfer


# -- secrets ------------------------------------------------------------------------------------

def test_weak_or_missing_tokens_are_refused_at_configuration() -> None:
    for weak in ("", "short", "x" * 15):
        with pytest.raises(ConfigError, match="auth token"):
            make_config(token=weak)
    make_config(token="x" * 16)
    with pytest.raises(ConfigError, match="needs tls"):
        make_config(payload_macs=False)


# -- the handshake: the client proves first -----------------------------------------------------

def test_a_wrong_token_is_refused_before_the_receiver_sends_anything_derived_from_it(
        make_pair: Callable[..., Pair]) -> None:
    pair = make_pair(LAYOUT)
    fs = raw_client(pair.receiver.address)
    try:
        fs.set_deadline(5.0)
        fs.send(client_hello())
        header = fs.recv_header(idle=False)
        hello = frames.decode_control(header)
        assert isinstance(hello, frames.ServerHello)
        assert set(json.loads(header.body)) == {"epoch", "compat_hash", "backend", "nonce"}  # no proof, no MAC
        time.sleep(0.2)
        assert not fs.has_data()  # and nothing else until the client proved the token
        fs.send(frames.encode_control(frames.ClientAuth("ab" * 32)))
        refusal = frames.decode_control(fs.recv_header(idle=False))
        assert isinstance(refusal, frames.ErrorMsg) and refusal.code == ErrorCode.AUTH
        assert isinstance(error_for_code(refusal.code, refusal.message), AuthError)
        with pytest.raises(PeerLostError, match="closed"):  # then the receiver hangs up
            fs.recv_header(idle=False)
    finally:
        fs.close()
    assert wait_until(lambda: pair.receiver.stats().connections == 0)


@pytest.mark.parametrize("proof", ["é" * 64, "\ud800", "zz" * 32, "", "00" * 32, "a" * 2000, "ab" * 31])
def test_garbage_proofs_are_a_clean_auth_error(make_pair: Callable[..., Pair], caplog: pytest.LogCaptureFixture,
                                               proof: str) -> None:
    pair = make_pair(LAYOUT)
    fs = raw_client(pair.receiver.address)
    try:
        with caplog.at_level(logging.DEBUG, logger="pdrouter.transfer"):
            fs.set_deadline(5.0)
            fs.send(client_hello())
            fs.recv_header(idle=False)
            fs.send(frames.encode_control(frames.ClientAuth(proof)))
            refusal = frames.decode_control(fs.recv_header(idle=False))
            assert isinstance(refusal, frames.ErrorMsg) and refusal.code == ErrorCode.AUTH
            assert wait_until(lambda: pair.receiver.stats().connections == 0)
    finally:
        fs.close()
    assert not [r for r in caplog.records if r.exc_info or r.levelno >= logging.ERROR]
    assert any("could not prove the auth token" in r.getMessage() for r in caplog.records)


def test_the_sender_refuses_a_receiver_that_cannot_prove_the_token(make_pair: Callable[..., Pair]) -> None:
    pair = make_pair(LAYOUT)
    listener = socket.create_server(("127.0.0.1", 0))
    seen: list[str] = []

    def impostor() -> None:
        conn, _ = listener.accept()
        fs = FramedSocket(conn, 5.0)
        try:
            fs.recv_header(idle=False)
            fs.send(frames.encode_control(frames.ServerHello(3, "c" * 16, "tcp", "1" * 32)))
            auth = frames.decode_control(fs.recv_header(idle=False))
            seen.append(auth.proof if isinstance(auth, frames.ClientAuth) else "")
            fs.send(frames.encode_control(frames.ServerAuth(auth.proof if isinstance(auth, frames.ClientAuth) else "")))
            fs.recv_header(idle=False)  # until the sender hangs up
        except PeerLostError:
            pass
        finally:
            fs.close()

    thread = threading.Thread(target=impostor)
    thread.start()
    try:
        with pytest.raises(AuthError, match="could not prove the auth token"):
            pair.sender.connect(f"127.0.0.1:{listener.getsockname()[1]}")  # echoing our own proof back fails
        assert pair.sender.stats().connections == 0
    finally:
        thread.join(10)
        listener.close()
    assert len(seen) == 1 and len(seen[0]) == 64


# -- slow and greedy clients --------------------------------------------------------------------

def test_a_client_trickling_its_hello_is_dropped_at_the_handshake_deadline(make_pair: Callable[..., Pair]) -> None:
    pair = make_pair(LAYOUT)
    receiver = replace_receiver(pair, handshake_timeout_s=0.5, message_timeout_s=30.0, progress_timeout_s=30.0)
    host, port = receiver.address.rsplit(":", 1)
    with socket.create_connection((host, int(port))) as sock:
        took = closed_within(sock, 5.0, trickle=client_hello())
    assert took is not None and 0.4 <= took < 2.0, took
    assert wait_until(lambda: receiver.stats().connections == 0)


def test_a_silent_client_is_dropped_at_the_handshake_deadline(make_pair: Callable[..., Pair]) -> None:
    pair = make_pair(LAYOUT)
    receiver = replace_receiver(pair, handshake_timeout_s=0.3)
    host, port = receiver.address.rsplit(":", 1)
    with socket.create_connection((host, int(port))) as sock:
        took = closed_within(sock, 5.0)
    assert took is not None and 0.2 <= took < 2.0, took


def test_a_large_body_before_authentication_is_refused_unread(make_pair: Callable[..., Pair]) -> None:
    pair = make_pair(LAYOUT)
    host, port = pair.receiver.address.rsplit(":", 1)
    big = frames.encode(frames.Kind.CLIENT_HELLO, b"{" + b" " * 8000 + b"}")
    prefix, _ = frames.seal(big, frames.plain_tag)
    with socket.create_connection((host, int(port))) as sock:
        sock.sendall(prefix)  # announces 8 KiB, over the 4 KiB allowed before the token is proved
        took = closed_within(sock, 5.0)
    assert took is not None and took < 1.0
    with socket.create_connection((host, int(port))) as sock:  # DATA before the handshake: refused too
        data = frames.encode_data("t", 0, FrameSpan(0, 1, ((1, 1),)), flags=frames.Flag.MAC_TRAILER,
                                payload_len=1 << 20, payload_checksum=0)
        sock.sendall(frames.seal(data, frames.plain_tag)[0] + data[frames.PREFIX.size:])
        assert closed_within(sock, 5.0) is not None


def test_an_authenticated_client_trickling_a_data_frame_is_dropped_at_its_deadline(
        make_pair: Callable[..., Pair]) -> None:
    pair = make_pair(LAYOUT)
    receiver = replace_receiver(pair, progress_timeout_s=3.0, message_timeout_s=0.5)
    handle = receiver.expect("req-slow", list(range(8)), timeout_s=30)
    t = handle.target
    fs = raw_client(receiver.address)
    fs.set_deadline(5.0)
    client_handshake(fs, make_config(), LAYOUT.compat_hash())  # this client knows the token
    fs.set_deadline(None)
    fs.send(frames.encode_control(frames.Begin(t.transfer_id, t.epoch, t.compat_hash, t.dst_block_ids, 0,
                                           0, LAYOUT.num_layers)))
    span = FrameSpan(0, 1, ((0, 8),))
    nbytes = span.nbytes(LAYOUT.block_elems * LAYOUT.dtype_bytes)
    stop = threading.Event()
    sent = [0]

    def trickle() -> None:  # 64 bytes every 50 ms: never silent for long, far below the minimum rate
        with fs.exclusive():
            fs.write_header(frames.encode_data(t.transfer_id, 0, span, flags=frames.Flag.MAC_TRAILER,
                                             payload_len=nbytes, payload_checksum=0))
            while sent[0] < nbytes and not stop.wait(0.05):
                try:
                    fs.write_all(bytes(64))
                except PeerLostError:
                    return
                sent[0] += 64

    writer = threading.Thread(target=trickle)
    started = time.monotonic()
    writer.start()
    try:
        with pytest.raises(PeerLostError, match="within its deadline"):
            handle.wait_all(10)
        took = time.monotonic() - started
    finally:
        stop.set()
        writer.join(10)
        fs.close()
    assert 0.4 <= took < 2.5, took  # the message's deadline, not the 3 s progress timeout
    assert 0 < sent[0] < nbytes
    assert handle.state is TransferState.FAILED
    assert wait_until(lambda: (receiver.stats().expectations, receiver.stats().connections) == (0, 0))


def test_connections_without_the_token_cannot_lock_a_sender_out(make_pair: Callable[..., Pair],
                                                                 caplog: pytest.LogCaptureFixture) -> None:
    """The cap's worth of idle connections that never prove the token: each new connection closes
    the oldest of them, so a sender with the token still gets in."""
    pair = make_pair(LAYOUT)
    receiver = replace_receiver(pair, max_connections=4, handshake_timeout_s=60.0)
    host, port = receiver.address.rsplit(":", 1)
    with caplog.at_level(logging.WARNING, logger="pdrouter.transfer"):
        idle = [socket.create_connection((host, int(port))) for _ in range(4)]
        try:
            assert wait_until(lambda: receiver.stats().evicted_connections == 3)
            assert [closed_within(sock, 5.0) is not None for sock in idle] == [True, True, True, False]
            handle = receiver.expect("req-1", [3], timeout_s=30)
            transfer = pair.sender.open_transfer(handle.target)
            transfer.send_layers([5])
            transfer.finish(30)
            handle.wait_all(30)
            assert blocks_equal(pair.src, [5], pair.dst, [3])
            assert receiver.stats().refused_connections == 0
        finally:
            for sock in idle:
                sock.close()
    assert len([r for r in caplog.records if "max_unauthenticated_connections" in r.getMessage()]) == 1


def test_the_budget_of_unproved_connections_is_checked() -> None:
    assert make_config(max_connections=128).unauthenticated_budget == 32
    assert make_config(max_connections=2, max_unauthenticated_connections=2).unauthenticated_budget == 2
    for bad in (0, 3):
        with pytest.raises(ConfigError, match="max_unauthenticated_connections"):
            make_config(max_connections=2, max_unauthenticated_connections=bad)


def test_connections_past_the_cap_are_closed_on_arrival_when_all_proved(make_pair: Callable[..., Pair],
                                                                       caplog: pytest.LogCaptureFixture) -> None:
    """Every open connection proved the token: a new one is closed on arrival, and none of them is."""
    pair = make_pair(LAYOUT)
    receiver = replace_receiver(pair, max_connections=2, handshake_timeout_s=10.0)
    host, port = receiver.address.rsplit(":", 1)
    proved: list[FramedSocket] = []
    try:
        for _ in range(2):
            proved.append(fs := raw_client(receiver.address))
            client_handshake(fs, make_config(), LAYOUT.compat_hash())
            assert wait_until(lambda: receiver.stats().unauthenticated == 0)
        with caplog.at_level(logging.WARNING, logger="pdrouter.transfer"):
            for _ in range(2):
                with socket.create_connection((host, int(port))) as extra:
                    assert closed_within(extra, 5.0) is not None
        assert (receiver.stats().refused_connections, receiver.stats().evicted_connections) == (2, 0)
        assert receiver.stats().connections == 2
        assert len([r for r in caplog.records if "max_connections" in r.getMessage()]) == 1  # logged once
    finally:
        for fs in proved:
            fs.close()
    assert wait_until(lambda: receiver.stats().connections == 0)


# -- frame MACs ---------------------------------------------------------------------------------

def tampered_transfer(pair: Pair, proxies: list[MessageProxy], *, timeout_s: float = 30,
                      **tamper: Any) -> tuple[Any, Any]:
    replace_sender(pair, max_frame_bytes=64 << 10)  # one 64 KiB frame per layer: messages 3 to 6
    proxies.append(proxy := MessageProxy(pair.receiver.address, **tamper))
    handle = pair.receiver.expect("req-1", list(range(8)), timeout_s=timeout_s)
    transfer = send_all(pair, dataclasses.replace(handle.target, peer=proxy.address), list(range(8, 16)))
    return handle, transfer


DATA_HEAD = frames.PREFIX.size + 31
"""A DATA message of transfer "req-1" with one run: prefix, then a 31-byte body; then the payload."""


@pytest.mark.parametrize(("flip", "match"), [
    ((4, DATA_HEAD + 30_000), "frame 1 payload failed its integrity check"),
    ((4, DATA_HEAD + (64 << 10) + 5), "frame 1 payload failed its integrity check"),
    ((4, frames.PREFIX.size + 20), "header MAC mismatch"),
    ((4, 14), "header MAC mismatch"),
    ((5, 30), "header MAC mismatch"),
], ids=["payload", "payload MAC", "DATA body", "DATA prefix", "DATA tag"])
def test_a_flipped_bit_in_a_frame_is_an_integrity_error(make_pair: Callable[..., Pair],
                                                         proxies: list[MessageProxy],
                                                         flip: tuple[int, int], match: str) -> None:
    pair = make_pair(LAYOUT)
    handle, transfer = tampered_transfer(pair, proxies, flip=flip)
    with pytest.raises(ChecksumError, match=match):
        handle.wait_all(30)
    with pytest.raises(ChecksumError):
        transfer.finish(30)
    assert proxies[0].fired.is_set() and handle.state is TransferState.FAILED  # the decode side frees the blocks
    pair.assert_released()


@pytest.mark.parametrize("tamper", [{"replay": 4}, {"swap": 4}, {"drop": 4}, {"replay": 2}],
                         ids=["replayed DATA", "reordered DATA", "dropped DATA", "replayed BEGIN"])
def test_replayed_reordered_or_dropped_frames_are_rejected(make_pair: Callable[..., Pair],
                                                           proxies: list[MessageProxy],
                                                           tamper: dict[str, int]) -> None:
    pair = make_pair(LAYOUT)
    handle, transfer = tampered_transfer(pair, proxies, **tamper)
    with pytest.raises(ChecksumError, match="header MAC mismatch"):
        handle.wait_all(30)
    with pytest.raises(ChecksumError, match="header MAC mismatch"):
        transfer.finish(30)
    assert proxies[0].fired.is_set()
    pair.assert_released()


@pytest.mark.parametrize("tamper", [{"flip": (2, frames.PREFIX.size + 30)}, {"drop": 2}],
                         ids=["flipped BEGIN", "dropped BEGIN"])
def test_a_tampered_begin_binds_nothing(make_pair: Callable[..., Pair], proxies: list[MessageProxy],
                                        tamper: dict[str, Any]) -> None:
    pair = make_pair(LAYOUT)
    handle, transfer = tampered_transfer(pair, proxies, timeout_s=1.0, **tamper)
    with pytest.raises(ChecksumError, match="header MAC mismatch"):
        transfer.finish(30)  # the receiver dropped the connection and said why
    with pytest.raises(DeadlineExceededError):
        handle.wait_all(30)  # never bound to a sender: it ends at its deadline
    assert not pair.dst.view(-1).view(torch.uint8).any()
    pair.assert_released()


def test_an_untouched_relay_changes_nothing(make_pair: Callable[..., Pair], proxies: list[MessageProxy]) -> None:
    pair = make_pair(LAYOUT)
    handle, transfer = tampered_transfer(pair, proxies)
    transfer.finish(30)
    handle.wait_all(30)
    assert blocks_equal(pair.src, list(range(8, 16)), pair.dst, list(range(8)))
    assert proxies[0].kinds[:4] == [frames.Kind.CLIENT_HELLO, frames.Kind.CLIENT_AUTH, frames.Kind.BEGIN,
                                    frames.Kind.DATA]


@pytest.mark.parametrize("offload", [True, False])
def test_large_frames_verify_with_and_without_the_mac_helper(make_pair: Callable[..., Pair], offload: bool) -> None:
    layout = make_layout(num_layers=2, num_blocks=80, block_size=16, num_kv_heads=8, head_dim=64)  # 32 KiB halves
    pair = make_pair(layout)
    replace_receiver(pair, mac_offload=offload)
    replace_sender(pair, mac_offload=offload)
    handle = pair.receiver.expect("req-big", list(range(64)), timeout_s=30)  # 4 MiB frames: the helper's path
    transfer = send_all(pair, handle.target, list(range(10, 74)))
    transfer.finish(30)  # type: ignore[attr-defined]
    handle.wait_all(30)
    assert blocks_equal(pair.src, list(range(10, 74)), pair.dst, list(range(64)))
    pair.assert_released()


# -- TLS ----------------------------------------------------------------------------------------

def tls_pair(pki: Pki, *, receiver: dict[str, object] | None = None,
             sender: dict[str, object] | None = None) -> Pair:
    return Pair(LAYOUT, Backend.TCP, 5, receiver={"tls": pki.receiver_tls(), **(receiver or {})},
                sender={"tls": pki.sender_tls(), **(sender or {})})


@pytest.mark.parametrize("payload_macs", [True, False], ids=["TLS and MACs", "TLS alone"])
def test_a_transfer_over_mutual_tls_is_bit_exact(pki: Pki, payload_macs: bool) -> None:
    pair = tls_pair(pki, receiver={"payload_macs": payload_macs}, sender={"payload_macs": payload_macs})
    try:
        handle = pair.receiver.expect("req-tls", list(range(20, 40)), timeout_s=30)
        transfer = send_all(pair, handle.target, list(range(20)))
        transfer.finish(30)
        handle.wait_all(30)
        assert blocks_equal(pair.src, list(range(20)), pair.dst, list(range(20, 40)))
        pair.assert_released()
    finally:
        pair.close()


def test_a_sender_with_a_certificate_from_another_ca_is_refused(pki: Pki) -> None:
    pair = tls_pair(pki)
    try:
        stranger = KvSender(pair.src, LAYOUT, make_config(tls=pki.stranger_tls()))
        try:
            with pytest.raises(AuthError, match="UNKNOWN_CA"):
                stranger.connect(pair.receiver.address)  # the receiver's alert says why
            assert stranger.stats().connections == 0
        finally:
            stranger.close()
        assert wait_until(lambda: pair.receiver.stats().connections == 0)
        pair.sender.connect(pair.receiver.address)  # the cluster's own certificate gets in
    finally:
        pair.close()


def test_a_sender_refuses_a_receiver_it_cannot_verify(pki: Pki) -> None:
    pair = tls_pair(pki)
    try:
        wary = KvSender(pair.src, LAYOUT, make_config(tls=dataclasses.replace(pki.sender_tls(), ca=pki.other_ca)))
        try:
            with pytest.raises(AuthError, match="certificate"):
                wary.connect(pair.receiver.address)
        finally:
            wary.close()
    finally:
        pair.close()


def test_plaintext_and_tls_do_not_mix(pki: Pki, make_pair: Callable[..., Pair]) -> None:
    pair = tls_pair(pki)
    try:
        plain = KvSender(pair.src, LAYOUT, make_config())
        try:
            with pytest.raises((ProtocolError, PeerLostError)):
                plain.connect(pair.receiver.address)  # a plaintext sender on a TLS receiver
        finally:
            plain.close()
        assert wait_until(lambda: pair.receiver.stats().connections == 0)
    finally:
        pair.close()
    plain_pair = make_pair(LAYOUT)
    tls_sender = KvSender(plain_pair.src, LAYOUT, make_config(tls=pki.sender_tls()))
    try:
        with pytest.raises((ProtocolError, PeerLostError)):
            tls_sender.connect(plain_pair.receiver.address)  # and a TLS sender on a plaintext one
    finally:
        tls_sender.close()


def test_a_flipped_byte_inside_tls_is_an_integrity_error(pki: Pki) -> None:
    pair = tls_pair(pki, sender={"max_frame_bytes": 64 << 10})
    proxy = FaultyProxy(pair.receiver.address, flip_at=200_000)
    try:
        handle = pair.receiver.expect("req-1", list(range(8)), timeout_s=30)
        transfer = send_all(pair, dataclasses.replace(handle.target, peer=proxy.address), list(range(8, 16)))
        with pytest.raises(ChecksumError, match="TLS record"):
            handle.wait_all(30)
        with pytest.raises((ChecksumError, PeerLostError)):
            transfer.finish(30)
        assert proxy.fired.is_set()
        pair.assert_released()
    finally:
        proxy.close()
        pair.close()


def test_the_token_is_still_proved_inside_tls(pki: Pki) -> None:
    pair = tls_pair(pki)
    try:
        intruder = KvSender(pair.src, LAYOUT, make_config(token=TOKEN + "-but-not-quite", tls=pki.sender_tls()))
        try:
            with pytest.raises(AuthError, match="auth token"):
                intruder.connect(pair.receiver.address)
        finally:
            intruder.close()
    finally:
        pair.close()


def test_arbitrary_handshake_bodies_are_refused_cleanly(make_pair: Callable[..., Pair],
                                                        caplog: pytest.LogCaptureFixture) -> None:
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    pair = make_pair(LAYOUT)
    json_values = st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=40),
                               lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner,
                                                                                          max_size=4), max_leaves=12)
    bodies = st.binary(max_size=600) | json_values.map(lambda v: json.dumps(v).encode()) | st.just(b"[" * 3000)

    @settings(max_examples=12, deadline=None, suppress_health_check=list(HealthCheck))
    @given(bodies, st.sampled_from([frames.Kind.CLIENT_HELLO, frames.Kind.CLIENT_AUTH, frames.Kind.BEGIN]))
    def check(body: bytes, kind: frames.Kind) -> None:
        fs = raw_client(pair.receiver.address)
        try:
            fs.set_deadline(5.0)
            if kind is not frames.Kind.CLIENT_HELLO:
                fs.send(client_hello())
                fs.recv_header(idle=False)
            fs.send(frames.encode(kind, body))
            with pytest.raises(PeerLostError):  # an ERROR message at most, then the receiver hangs up
                while True:
                    msg = frames.decode_control(fs.recv_header(idle=False))
                    assert isinstance(msg, frames.ErrorMsg)
        finally:
            fs.close()

    with caplog.at_level(logging.DEBUG, logger="pdrouter.transfer"):
        check()
    assert not [r for r in caplog.records if r.exc_info or r.levelno >= logging.ERROR]
    assert wait_until(lambda: pair.receiver.stats().connections == 0)
    handle = pair.receiver.expect("req-after", [2], timeout_s=30)  # and it still serves real senders
    transfer = pair.sender.open_transfer(handle.target)
    transfer.send_layers([9])
    transfer.finish(30)
    handle.wait_all(30)
