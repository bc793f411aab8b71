"""A worker's error, as the client gets it: the same status, the router's words (pure logic)."""

from __future__ import annotations

import logging

import pytest

from pdrouter.core.errors import (
    CancelledError,
    CapacityError,
    DeadlineExceededError,
    FailedPreconditionError,
    IncompatibleError,
    InvalidRequestError,
    NotFoundError,
    PdRouterError,
    PromptTooLongError,
    TransferError,
    UnavailableError,
)
from pdrouter.router.worker_errors import client_error

INTERNALS = "prefill on prefill-7 failed: cannot reach the worker lane at 10.1.2.3:50062: [Errno 111] refused"


@pytest.mark.parametrize(("error", "kind", "message"), [
    (UnavailableError(INTERNALS), UnavailableError,
     "the prefill worker serving this request is unavailable (stopped, failing or unreachable); retry the request"),
    (TransferError(INTERNALS), UnavailableError,
     "the prefill worker serving this request is unavailable (stopped, failing or unreachable); retry the request"),
    (DeadlineExceededError(INTERNALS), DeadlineExceededError, "the request passed its deadline"),
    (CancelledError(INTERNALS), CancelledError, "the request was cancelled"),
    (PdRouterError(INTERNALS), PdRouterError,
     "the prefill worker could not compute this request (an internal error, logged by the router)"),
    (IncompatibleError(INTERNALS), PdRouterError,
     "the prefill worker could not compute this request (an internal error, logged by the router)"),
    (FailedPreconditionError(INTERNALS), PdRouterError,
     "the prefill worker could not compute this request (an internal error, logged by the router)"),
    (NotFoundError(INTERNALS), PdRouterError,
     "the prefill worker could not compute this request (an internal error, logged by the router)"),
])
def test_the_status_stands_and_the_internals_go_to_the_log(error: PdRouterError, kind: type[PdRouterError],
                                                           message: str, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG, "pdrouter.router.worker_errors")
    told = client_error(error, "prefill", "decode-3", "req-1")
    assert type(told) is kind and told.message == message
    assert told.grpc_code == kind.grpc_code and told.http_status == kind.http_status
    assert "req-1" in caplog.text and "decode-3" in caplog.text and INTERNALS in caplog.text


@pytest.mark.parametrize("error", [InvalidRequestError("max_tokens must be positive"),
                                   PromptTooLongError("prompt too long"),
                                   CapacityError("no KV room now", retry_after_s=2)])
def test_errors_about_the_request_keep_the_workers_words(error: PdRouterError) -> None:
    assert client_error(error, "decode", "decode-3", "req-1") is error
