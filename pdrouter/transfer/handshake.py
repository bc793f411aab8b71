"""Connection handshake: proof of the auth token (the connecting side first), per-connection keys,
wire version, backend, epochs, compat hashes.

::

    client (sender)                                   server (receiver)
      CLIENT_HELLO(epoch, compat, backend, nonce_c, ack_every) ─▶
                          ◀─ SERVER_HELLO(epoch, compat, backend, nonce_s)   or ERROR
      CLIENT_AUTH(proof_c) ─▶                         verified in constant time, else ERROR(AUTH), close
                          ◀─ SERVER_AUTH(proof_s)                            verified by the client
      ════ from here every message carries a MAC under the direction's key ════
                          ◀─ READY(process-group rendezvous, for gloo/NCCL)

Both proofs and both keys come from HKDF over the token and the exact bytes of the two hellos
(``pdrouter.transfer.integrity``): they bind both nonces, both epochs, the backends, the compat
hashes and the role (a distinct label per proof and per direction). The token never crosses the
wire, and the receiver sends nothing derived from it before the sender proved it: a peer without
the token gets a nonce and an ERROR, nothing to guess the token from offline. (A sender does send
its proof to whatever it dials; tokens are at least ``MIN_TOKEN_BYTES`` long and random, and TLS
with a CA authenticates the receiver first.)

The wire version is in every frame header. A compat hash mismatch does not refuse the connection:
each side learns the other's hash and refuses every transfer over it with ``IncompatibleError``
(telling the peer which transfer failed, which a refused connection could not). Epochs are checked
per transfer against the target.
"""

from __future__ import annotations

import secrets
from collections.abc import Callable
from dataclasses import dataclass
from typing import NoReturn, TypeVar

from pdrouter.core.errors import IncompatibleError
from pdrouter.transfer import frames
from pdrouter.transfer.config import TransferConfig
from pdrouter.transfer.errors import AuthError, ErrorCode, ProtocolError, error_for_code
from pdrouter.transfer.framed_socket import FramedSocket
from pdrouter.transfer.integrity import derive_session, proof_matches

_M = TypeVar("_M", bound=frames.Control)
_NONCE_HEX = 32


@dataclass(frozen=True)
class PeerInfo:
    """What the handshake established about the other end."""

    address: str
    epoch: int
    compat_hash: str
    ready: frames.Ready
    ack_every: int = 0
    """(receiver side) how often the sender wants acknowledgements; 0: never."""


def client_handshake(fs: FramedSocket, config: TransferConfig, compat_hash: str) -> PeerInfo:
    """Run the client side; AuthError, IncompatibleError, ProtocolError or PeerLostError when refused.

    On return ``fs`` carries MACs both ways.
    """
    hello = frames.encode_control(frames.ClientHello(config.epoch, compat_hash, config.backend.value,
                                                 secrets.token_hex(_NONCE_HEX // 2), config.ack_every_bytes))
    fs.send(hello)
    header, server = _expect(fs, frames.ServerHello, config)
    _check_nonce(fs, server.nonce)
    keys = derive_session(config.auth_token, _body(hello), header.body)
    fs.send(frames.encode_control(frames.ClientAuth(keys.client_proof.hex())))
    _, auth = _expect(fs, frames.ServerAuth, config)
    if not proof_matches(auth.proof, keys.server_proof):
        raise AuthError(f"receiver at {fs.peer} could not prove the auth token: the workers are "
                        f"configured with different tokens")
    fs.install_keys(keys.client_to_server, keys.server_to_client)
    _, ready = _expect(fs, frames.Ready, config)
    return PeerInfo(fs.peer, server.epoch, server.compat_hash, ready)


def server_handshake(fs: FramedSocket, config: TransferConfig, compat_hash: str,
                     make_ready: Callable[[], frames.Ready]) -> PeerInfo:
    """Run the server side; refuses (telling the client why, with nothing derived from the token)
    and raises when the client is not fit. On return ``fs`` carries MACs both ways."""
    header, client = _expect(fs, frames.ClientHello, config)
    _check_nonce(fs, client.nonce)
    if client.backend != config.backend.value:
        _refuse(fs, ErrorCode.INCOMPATIBLE, IncompatibleError(
            f"sender uses backend {client.backend!r}, receiver {config.backend.value!r}"))
    if client.ack_every < 0:
        _refuse(fs, ErrorCode.PROTOCOL, ProtocolError(f"sender at {fs.peer} asked for a negative ack window"))
    hello = frames.encode_control(frames.ServerHello(config.epoch, compat_hash, config.backend.value,
                                                 secrets.token_hex(_NONCE_HEX // 2)))
    fs.send(hello)
    keys = derive_session(config.auth_token, header.body, _body(hello))
    _, auth = _expect(fs, frames.ClientAuth, config)
    if not proof_matches(auth.proof, keys.client_proof):
        _refuse(fs, ErrorCode.AUTH, AuthError(f"sender at {fs.peer} could not prove the auth token"))
    fs.send(frames.encode_control(frames.ServerAuth(keys.server_proof.hex())))
    fs.install_keys(keys.server_to_client, keys.client_to_server)
    ready = make_ready()
    fs.send(frames.encode_control(ready))
    return PeerInfo(fs.peer, client.epoch, client.compat_hash, ready, client.ack_every)


def _body(message: bytes) -> bytes:
    return message[frames.PREFIX.size:]


def _check_nonce(fs: FramedSocket, nonce: str) -> None:
    if len(nonce) != _NONCE_HEX:
        raise ProtocolError(f"handshake with {fs.peer}: a nonce of {len(nonce)} characters, not {_NONCE_HEX}")


def _expect(fs: FramedSocket, cls: type[_M], config: TransferConfig) -> tuple[frames.Header, _M]:
    header = fs.recv_header(idle=False, max_body=config.max_preauth_bytes)
    msg = frames.decode_control(header) if header.kind is not frames.Kind.DATA else None
    if isinstance(msg, frames.ErrorMsg):
        raise error_for_code(msg.code, f"{fs.peer} refused the connection: {msg.message}")
    if not isinstance(msg, cls):
        raise ProtocolError(f"handshake with {fs.peer}: expected {cls.KIND.name}, got {header.kind.name}")
    return header, msg


def _refuse(fs: FramedSocket, code: ErrorCode, exc: Exception) -> NoReturn:
    try:
        fs.send(frames.encode_control(frames.ErrorMsg("", int(code), str(exc))))
    finally:
        raise exc
