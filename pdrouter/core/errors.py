"""The error tree, and how each error is reported on the wire.

::

    PdRouterError                      INTERNAL            500
    ├── InvalidRequestError            INVALID_ARGUMENT    400
    │   ├── PromptTooLongError         INVALID_ARGUMENT    400
    │   └── ModelNotFoundError         INVALID_ARGUMENT    400  (code model_not_found)
    ├── NotFoundError                  NOT_FOUND           404
    ├── CapacityError                  RESOURCE_EXHAUSTED  429
    │   └── RequestTooLargeError       RESOURCE_EXHAUSTED  429  (never fits: do not retry)
    ├── FailedPreconditionError        FAILED_PRECONDITION 400
    │   ├── IncompatibleError          FAILED_PRECONDITION 400  (model / KV layout mismatch)
    │   └── StaleEpochError            FAILED_PRECONDITION 400  (peer restarted)
    ├── ConfigError                    FAILED_PRECONDITION 400  (CLI: exit code 2)
    ├── UnavailableError               UNAVAILABLE         503
    │   └── TransferError              UNAVAILABLE         503  (KV transfer failed)
    ├── DeadlineExceededError          DEADLINE_EXCEEDED   504
    └── CancelledError                 CANCELLED           499

Codes are carried as names (``"INVALID_ARGUMENT"``) so this module needs no grpc import; the
servicers turn them into ``grpc.StatusCode[name]`` in one place.
"""

from __future__ import annotations

from typing import ClassVar


class PdRouterError(Exception):
    """Base of every error pd-router raises on purpose."""

    grpc_code: ClassVar[str] = "INTERNAL"
    http_status: ClassVar[int] = 500
    openai_type: ClassVar[str] = "server_error"
    openai_code: ClassVar[str | None] = None
    """OpenAI's ``error.code`` when it has a name of its own (else the gRPC code, lower-cased)."""
    retryable: ClassVar[bool] = False

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class InvalidRequestError(PdRouterError):
    """The request itself is wrong; the message says which field and what to send instead."""

    grpc_code = "INVALID_ARGUMENT"
    http_status = 400
    openai_type = "invalid_request_error"


class PromptTooLongError(InvalidRequestError):
    """Prompt plus max_tokens does not fit the model's context window."""

    openai_code = "context_length_exceeded"


class ModelNotFoundError(InvalidRequestError):
    """The request names a model this router does not serve: a bad request (400, gRPC
    INVALID_ARGUMENT), with OpenAI's ``error.code`` for it, ``model_not_found``."""

    openai_code = "model_not_found"


class NotFoundError(PdRouterError):
    """An unknown model, request id or worker."""

    grpc_code = "NOT_FOUND"
    http_status = 404
    openai_type = "not_found_error"


class CapacityError(PdRouterError):
    """No KV room now; the client may retry later (HTTP 429 with Retry-After)."""

    grpc_code = "RESOURCE_EXHAUSTED"
    http_status = 429
    openai_type = "rate_limit_error"
    retryable = True

    def __init__(self, message: str, retry_after_s: int | None = None, reason: str = "capacity") -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s
        """Seconds after which a retry may succeed (HTTP ``Retry-After``); None: unknown."""
        self.reason = reason
        """What ran out, for metrics: ``capacity``, admission's ``queue_full`` / ``timeout``, a tenant's limit."""


class RequestTooLargeError(CapacityError):
    """The request needs more KV than any worker's whole pool: it will never fit."""

    retryable = False


class FailedPreconditionError(PdRouterError):
    """The system is not in a state that allows the operation."""

    grpc_code = "FAILED_PRECONDITION"
    http_status = 400
    openai_type = "invalid_request_error"


class IncompatibleError(FailedPreconditionError):
    """Two peers disagree on model geometry, dtype, block size or KV layout."""


class StaleEpochError(FailedPreconditionError):
    """A message from a previous incarnation of a worker (it restarted since)."""


class ConfigError(FailedPreconditionError):
    """A configuration that cannot work (the CLI exits with code 2)."""


class UnavailableError(PdRouterError):
    """A worker or Redis cannot be reached now; retrying elsewhere may succeed."""

    grpc_code = "UNAVAILABLE"
    http_status = 503
    openai_type = "server_error"
    retryable = True


class TransferError(UnavailableError):
    """A KV transfer failed (checksum, truncated stream, peer gone, handshake refused)."""


class DeadlineExceededError(PdRouterError):
    """The request's deadline passed before it finished."""

    grpc_code = "DEADLINE_EXCEEDED"
    http_status = 504
    openai_type = "timeout_error"


class CancelledError(PdRouterError):
    """The client went away or asked to stop."""

    grpc_code = "CANCELLED"
    http_status = 499
    openai_type = "cancelled"


_BY_GRPC_CODE: dict[str, type[PdRouterError]] = {
    "INVALID_ARGUMENT": InvalidRequestError,
    "NOT_FOUND": NotFoundError,
    "RESOURCE_EXHAUSTED": CapacityError,
    "FAILED_PRECONDITION": FailedPreconditionError,
    "UNAVAILABLE": UnavailableError,
    "DEADLINE_EXCEEDED": DeadlineExceededError,
    "CANCELLED": CancelledError,
}


def error_from_grpc_code(code_name: str, message: str) -> PdRouterError:
    """Rebuild the closest error class from a gRPC status code name (client side of a hop)."""
    return _BY_GRPC_CODE.get(code_name, PdRouterError)(message)


def http_status_for(exc: BaseException) -> int:
    """The HTTP status code a front door answers with for ``exc`` (500 for foreign exceptions)."""
    return exc.http_status if isinstance(exc, PdRouterError) else 500
