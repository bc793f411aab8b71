"""Proofs of the internal secret for gRPC calls: the secret itself never travels.

Two proofs, both HMAC-SHA256 under the internal secret, each bound to the worker's address (the
``host:port`` it registers and callers dial, its *identity*):

* **the worker proves itself first** (:func:`peer_proof`): before a caller sends anything but a
  health check on a channel, it asks the worker's health service, with a random challenge
  (metadata :data:`CHALLENGE_METADATA`), for HMAC(secret, label, challenge, identity). The worker
  answers in its response headers (:data:`IDENTITY_METADATA`, :data:`PEER_PROOF_METADATA`). The
  caller checks the proof and that the identity is the address it dialled. A server without the
  secret cannot answer; one that has it but is not at that address (another worker, or a relay
  to a real one, behind a forged registry record) answers with another identity and is refused;
* **every call carries a proof** (:func:`call_proof`): HMAC(secret, label, method, the address
  dialled, a timestamp, a random nonce) in :data:`CALL_PROOF_METADATA`, with the address in
  :data:`TARGET_METADATA`. The worker accepts it for its own address only, within
  :data:`WINDOW_S` of its clock, and once (:class:`ReplayWindow`). A peer that collects proofs
  learns nothing of the secret, and can replay none of them to any worker.

The lane has its own challenge-response, with the same two properties (``pdrouter.wire.lane.frames``).
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import time
from collections import OrderedDict

CHALLENGE_METADATA = "x-pdrouter-challenge"
"""A caller's challenge (hex) on a health check: asks the worker to prove itself."""
IDENTITY_METADATA = "x-pdrouter-identity"
"""The worker's answer: the address it answers as."""
PEER_PROOF_METADATA = "x-pdrouter-peer-proof"
"""The worker's answer: :func:`peer_proof` (hex)."""
CALL_PROOF_METADATA = "x-pdrouter-proof"
"""On every internal call: ``<ms since the epoch>.<nonce hex>.<call_proof hex>``."""
TARGET_METADATA = "x-pdrouter-target"
"""On every internal call: the address the caller dialled."""
CHALLENGE_BYTES = 32
NONCE_BYTES = 16
WINDOW_S = 30.0
"""A call proof is accepted within this many seconds of the worker's clock (either way)."""
_PEER_LABEL = b"pdrouter grpc v1: the worker proves the internal secret\x00"
_CALL_LABEL = b"pdrouter grpc v1: a call proves the internal secret\x00"


def peer_proof(secret: bytes, challenge: bytes, identity: str) -> bytes:
    """The worker's answer to ``challenge``, as the worker at ``identity``."""
    return hmac.new(secret, _PEER_LABEL + challenge + identity.encode(), hashlib.sha256).digest()


def call_proof(secret: bytes, method: str, target: str, at_ms: int, nonce: bytes) -> bytes:
    """A call's proof: of ``method``, to the worker at ``target``, made at ``at_ms``, once (``nonce``)."""
    message = b"%s%s\x00%s\x00%d\x00%s" % (_CALL_LABEL, method.encode(), target.encode(), at_ms, nonce)
    return hmac.new(secret, message, hashlib.sha256).digest()


def new_call_proof(secret: bytes, method: str, target: str) -> str:
    """The :data:`CALL_PROOF_METADATA` value of a call made now."""
    at_ms = time.time_ns() // 1_000_000
    nonce = secrets.token_bytes(NONCE_BYTES)
    return f"{at_ms}.{nonce.hex()}.{call_proof(secret, method, target, at_ms, nonce).hex()}"


class ReplayWindow:
    """The call proofs a worker accepted in the last ``2 × window_s`` seconds, so that none is accepted
    twice. It holds only proofs that verified, so only callers with the secret fill it, and a proof
    older than the window is refused by its timestamp alone."""

    def __init__(self, window_s: float = WINDOW_S) -> None:
        self.window_s = window_s
        self._seen: OrderedDict[bytes, float] = OrderedDict()

    def first_use(self, nonce: bytes, now: float) -> bool:
        """Record ``nonce``; False when it was seen before."""
        seen = self._seen
        horizon = now - 2 * self.window_s
        while seen:
            oldest, when = next(iter(seen.items()))
            if when >= horizon:
                break
            del seen[oldest]
        if nonce in seen:
            return False
        seen[nonce] = now
        return True

    def __len__(self) -> int:
        return len(self._seen)


def check_call_proof(secret: bytes, identity: str, method: str, target: str | None, value: str | None,
                     replays: ReplayWindow) -> str | None:
    """Why a call with proof ``value`` (to ``target``, of ``method``) is refused by the worker at
    ``identity``, or None to serve it."""
    if value is None:
        return ("internal call without a proof of the internal secret: the caller must be a pd-router router or "
                "worker started with the same PDROUTER_INTERNAL_TOKEN")
    if target != identity:
        return (f"this internal call was made to {target or 'no address'}, and this worker answers as {identity} "
                f"(its --advertise-host and port): call it at that address")
    try:
        at_s, nonce_s, mac_s = value.split(".")
        at_ms, nonce, mac = int(at_s), bytes.fromhex(nonce_s), bytes.fromhex(mac_s)
    except ValueError:
        return "malformed proof of the internal secret"
    if len(nonce) != NONCE_BYTES or not hmac.compare_digest(mac, call_proof(secret, method, target, at_ms, nonce)):
        return "wrong internal secret: check PDROUTER_INTERNAL_TOKEN on the caller and this worker"
    now = time.time()
    if abs(now - at_ms / 1000) > replays.window_s:
        return (f"the call's proof is stamped {now - at_ms / 1000:+.0f} s from this worker's clock (at most "
                f"{replays.window_s:g} s either way): synchronize the clocks (NTP)")
    if not replays.first_use(nonce, now):
        return "this proof of the internal secret was used before (a replayed call)"
    return None
