"""Connection handshake: mutual proof of the auth token, wire version, backend, epochs, compat hashes.

::

    client                                   server
      CLIENT_HELLO(epoch, compat, backend, nonce_c) ─▶
                      ◀─ SERVER_HELLO(epoch, compat, backend, nonce_s, mac_s)   or ERROR
      CLIENT_AUTH(mac_c) ─▶
                      ◀─ READY(process-group rendezvous, for gloo/NCCL)           or ERROR(AUTH)

``mac_x = HMAC-SHA256(token, role | nonce_c | nonce_s | epochs)``: the token never crosses the
wire and each side proves it to the other. The wire version is in every frame header. A compat
hash mismatch does not refuse the connection: each side learns the other's hash and refuses every
transfer over it with ``IncompatibleError`` (telling the peer which transfer failed, which a
refused connection could not). Epochs are checked per transfer against the target.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
from collections.abc import Callable
from dataclasses import dataclass
from typing import NoReturn, TypeVar

from pdrouter.core.errors import IncompatibleError
from pdrouter.transfer import wire
from pdrouter.transfer.config import TransferConfig
from pdrouter.transfer.errors import AuthError, ErrorCode, ProtocolError, error_for_code
from pdrouter.transfer.framed_socket import FramedSocket

_M = TypeVar("_M", bound=wire.Control)


@dataclass(frozen=True)
class PeerInfo:
    """What the handshake established about the other end."""

    address: str
    epoch: int
    compat_hash: str
    ready: wire.Ready
    ack_every: int = 0
    """(receiver side) how often the sender wants acknowledgements; 0: never."""


def client_handshake(fs: FramedSocket, config: TransferConfig, compat_hash: str) -> PeerInfo:
    """Run the client side; AuthError, IncompatibleError or PeerLostError when refused."""
    nonce = secrets.token_hex(16)
    fs.send([wire.encode_control(wire.ClientHello(config.epoch, compat_hash, config.backend.value, nonce,
                                                  config.ack_every_bytes))])
    hello = _expect(fs, wire.ServerHello)
    want = _mac(config.auth_token, "server", nonce, hello.nonce, config.epoch, hello.epoch)
    if not hmac.compare_digest(hello.mac, want):
        raise AuthError(f"receiver at {fs.peer} could not prove the auth token: the workers are "
                        f"configured with different tokens")
    mac = _mac(config.auth_token, "client", nonce, hello.nonce, config.epoch, hello.epoch)
    fs.send([wire.encode_control(wire.ClientAuth(mac))])
    ready = _expect(fs, wire.Ready)
    return PeerInfo(fs.peer, hello.epoch, hello.compat_hash, ready)


def server_handshake(fs: FramedSocket, config: TransferConfig, compat_hash: str,
                     make_ready: Callable[[], wire.Ready]) -> PeerInfo:
    """Run the server side; refuses (telling the client why) and raises when the client is not fit."""
    hello = _expect(fs, wire.ClientHello)
    if hello.backend != config.backend.value:
        _refuse(fs, ErrorCode.INCOMPATIBLE, IncompatibleError(
            f"sender uses backend {hello.backend!r}, receiver {config.backend.value!r}"))
    nonce = secrets.token_hex(16)
    mac = _mac(config.auth_token, "server", hello.nonce, nonce, hello.epoch, config.epoch)
    fs.send([wire.encode_control(wire.ServerHello(config.epoch, compat_hash, config.backend.value,
                                                  nonce, mac))])
    auth = _expect(fs, wire.ClientAuth)
    want = _mac(config.auth_token, "client", hello.nonce, nonce, hello.epoch, config.epoch)
    if not hmac.compare_digest(auth.mac, want):
        _refuse(fs, ErrorCode.AUTH, AuthError(f"sender at {fs.peer} could not prove the auth token"))
    ready = make_ready()
    fs.send([wire.encode_control(ready)])
    return PeerInfo(fs.peer, hello.epoch, hello.compat_hash, ready, hello.ack_every)


def _mac(token: str, role: str, client_nonce: str, server_nonce: str, client_epoch: int,
         server_epoch: int) -> str:
    msg = f"kvtransfer/{wire.WIRE_VERSION}|{role}|{client_nonce}|{server_nonce}|{client_epoch}|{server_epoch}"
    return hmac.new(token.encode(), msg.encode(), hashlib.sha256).hexdigest()


def _expect(fs: FramedSocket, cls: type[_M]) -> _M:
    header = fs.recv_header(idle=False)
    msg = wire.decode_control(header) if header.kind is not wire.Kind.DATA else None
    if isinstance(msg, wire.ErrorMsg):
        raise error_for_code(msg.code, f"{fs.peer} refused the connection: {msg.message}")
    if not isinstance(msg, cls):
        raise ProtocolError(f"handshake with {fs.peer}: expected {cls.KIND.name}, got {header.kind.name}")
    return msg


def _refuse(fs: FramedSocket, code: ErrorCode, exc: Exception) -> NoReturn:
    try:
        fs.send([wire.encode_control(wire.ErrorMsg("", int(code), str(exc)))])
    finally:
        raise exc
