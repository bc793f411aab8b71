"""What a client is told when a worker fails its request: the worker's status, in the router's words.

A worker's own text names what clients have no business seeing (worker ids, addresses, the
internal error of an engine or a transfer), so it stays in the router's log, with the request
id. The client gets an error of the same class, so its status code, retryability and
``Retry-After`` hold, with the message of this table:

=========================  ==============================================================
the worker's error         the client's message
=========================  ==============================================================
InvalidRequestError        the worker's own: it is about the request (a field to change)
CapacityError              the worker's own: no KV room now, retry later
UnavailableError           the worker serving the request is unavailable; retry
DeadlineExceededError      the request passed its deadline
CancelledError             the request was cancelled
any other (INTERNAL…)      the worker could not compute the request (an internal error)
=========================  ==============================================================
"""

from __future__ import annotations

import logging

from pdrouter.core.errors import (
    CancelledError,
    CapacityError,
    DeadlineExceededError,
    InvalidRequestError,
    PdRouterError,
    UnavailableError,
)

log = logging.getLogger(__name__)

_MESSAGES: tuple[tuple[type[PdRouterError], str], ...] = (
    (UnavailableError, "the {role} worker serving this request is unavailable (stopped, failing or unreachable); "
                       "retry the request"),
    (DeadlineExceededError, "the request passed its deadline"),
    (CancelledError, "the request was cancelled"),
)
_INTERNAL = "the {role} worker could not compute this request (an internal error, logged by the router)"


def client_error(exc: PdRouterError, role: str, called: str, request_id: str) -> PdRouterError:
    """The error to raise to the client for ``exc``, which the call to worker ``called`` ended with and
    which a ``role`` worker caused (``prefill`` when the decode worker reports that every prefill
    worker failed); the worker's own text is logged here."""
    if isinstance(exc, InvalidRequestError | CapacityError):
        return exc
    if isinstance(exc, CancelledError):
        log.debug("request %s cancelled (call to %s): %s", request_id, called, exc.message)
    else:
        log.warning("request %s failed on the %s side (call to %s): %s (%s)", request_id, role, called,
                    exc.message, exc.grpc_code)
    for kind, message in _MESSAGES:
        if isinstance(exc, kind):
            return kind(message.format(role=role))
    return PdRouterError(_INTERNAL.format(role=role))
