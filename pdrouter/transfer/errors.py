"""Transfer errors, and the codes that carry them across the wire.

The KV transfer errors are leaves of the project's error tree (``pdrouter.core.errors``)::

    TransferError (UNAVAILABLE)              a transfer failed; retrying elsewhere may succeed
    ├── ChecksumError                        a frame failed its MAC: corrupted, forged, replayed
    ├── PeerLostError                        connection closed, truncated, peer killed or silent
    └── ProtocolError                        a peer broke the frame protocol (uninvited blocks, ...)
        └── UnknownTransferError             the receiver expects no such transfer (any more)
    IncompatibleError (FAILED_PRECONDITION)  model geometry / dtype / block size / layout differ
    └── AuthError                            the peers do not share the auth token
    StaleEpochError (FAILED_PRECONDITION)    the peer restarted since the target was issued
    DeadlineExceededError                    the transfer's deadline passed
    CancelledError                           one side aborted the transfer
    InvalidRequestError                      the caller asked for something impossible

Each error crossing the wire travels as an ``ErrorCode`` plus a message; ``error_for_code`` rebuilds
the same class on the other side, so both ends raise the same kind of error.
"""

from __future__ import annotations

from enum import IntEnum

from pdrouter.core.errors import (
    CancelledError,
    DeadlineExceededError,
    IncompatibleError,
    InvalidRequestError,
    PdRouterError,
    StaleEpochError,
    TransferError,
)


class ChecksumError(TransferError):
    """A frame's header or payload fails its MAC (or checksum): corrupted or tampered with in transit,
    or replayed, reordered or dropped (the MACs bind each message's sequence number)."""


class PeerLostError(TransferError):
    """The connection to the peer closed, was truncated, or made no progress in time."""


class ProtocolError(TransferError):
    """The peer sent something the frame protocol does not allow (e.g. blocks it was not invited to)."""


class UnknownTransferError(ProtocolError):
    """The receiver holds no expectation for this transfer id (never made, expired, or finished)."""


class AuthError(IncompatibleError):
    """The peers do not share the same auth token (a handshake proof did not verify), or TLS refused a
    certificate."""


class ErrorCode(IntEnum):
    """Why a transfer (or a whole connection) failed, as carried in an ERROR message."""

    PROTOCOL = 1
    CHECKSUM = 2
    INCOMPATIBLE = 3
    STALE_EPOCH = 4
    AUTH = 5
    UNKNOWN_TRANSFER = 6
    ABORTED = 7
    DEADLINE = 8
    PEER_LOST = 9
    INVALID = 10


_CLASS_BY_CODE: dict[ErrorCode, type[PdRouterError]] = {
    ErrorCode.PROTOCOL: ProtocolError,
    ErrorCode.CHECKSUM: ChecksumError,
    ErrorCode.INCOMPATIBLE: IncompatibleError,
    ErrorCode.STALE_EPOCH: StaleEpochError,
    ErrorCode.AUTH: AuthError,
    ErrorCode.UNKNOWN_TRANSFER: UnknownTransferError,
    ErrorCode.ABORTED: CancelledError,
    ErrorCode.DEADLINE: DeadlineExceededError,
    ErrorCode.PEER_LOST: PeerLostError,
    ErrorCode.INVALID: InvalidRequestError,
}

# Most specific class first, so a subclass maps to its own code.
_CODE_BY_CLASS: tuple[tuple[type[BaseException], ErrorCode], ...] = (
    (AuthError, ErrorCode.AUTH),
    (ChecksumError, ErrorCode.CHECKSUM),
    (PeerLostError, ErrorCode.PEER_LOST),
    (UnknownTransferError, ErrorCode.UNKNOWN_TRANSFER),
    (ProtocolError, ErrorCode.PROTOCOL),
    (IncompatibleError, ErrorCode.INCOMPATIBLE),
    (StaleEpochError, ErrorCode.STALE_EPOCH),
    (CancelledError, ErrorCode.ABORTED),
    (DeadlineExceededError, ErrorCode.DEADLINE),
    (InvalidRequestError, ErrorCode.INVALID),
)


def error_for_code(code: int, message: str) -> PdRouterError:
    """The error a peer meant by ``code`` (a ProtocolError for codes this version does not know)."""
    try:
        return _CLASS_BY_CODE[ErrorCode(code)](message)
    except ValueError:
        return ProtocolError(f"unknown error code {code}: {message}")


def code_for_error(exc: BaseException) -> ErrorCode:
    """The wire code for ``exc`` (PROTOCOL for anything unexpected)."""
    for cls, code in _CODE_BY_CLASS:
        if isinstance(exc, cls):
            return code
    return ErrorCode.PEER_LOST if isinstance(exc, TransferError) else ErrorCode.PROTOCOL
