"""The shared vocabulary package stays free of heavy imports; errors map to the right codes."""

from __future__ import annotations

import itertools
import pkgutil
import re
import subprocess
import sys

import pytest

import pdrouter.core as core
from pdrouter.core import errors
from pdrouter.core.ids import new_request_id
from pdrouter.core.sampling import SamplingParams


def test_core_imports_no_torch_grpc_or_redis() -> None:
    modules = [f"pdrouter.core.{m.name}" for m in pkgutil.iter_modules(core.__path__)]
    assert len(modules) >= 7
    code = ("import sys\n" + "".join(f"import {m}\n" for m in modules)
            + "bad = [m for m in ('torch', 'grpc', 'redis', 'numpy') if m in sys.modules]\nprint(bad)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


@pytest.mark.parametrize(("exc", "grpc_code", "http"), [
    (errors.InvalidRequestError, "INVALID_ARGUMENT", 400),
    (errors.PromptTooLongError, "INVALID_ARGUMENT", 400),
    (errors.NotFoundError, "NOT_FOUND", 404),
    (errors.CapacityError, "RESOURCE_EXHAUSTED", 429),
    (errors.RequestTooLargeError, "RESOURCE_EXHAUSTED", 429),
    (errors.IncompatibleError, "FAILED_PRECONDITION", 400),
    (errors.StaleEpochError, "FAILED_PRECONDITION", 400),
    (errors.UnavailableError, "UNAVAILABLE", 503),
    (errors.TransferError, "UNAVAILABLE", 503),
    (errors.DeadlineExceededError, "DEADLINE_EXCEEDED", 504),
    (errors.CancelledError, "CANCELLED", 499),
    (errors.PdRouterError, "INTERNAL", 500),
])
def test_error_codes(exc: type[errors.PdRouterError], grpc_code: str, http: int) -> None:
    err = exc("boom")
    assert (err.grpc_code, err.http_status, err.message) == (grpc_code, http, "boom")
    assert errors.http_status_for(err) == http
    assert isinstance(errors.error_from_grpc_code(grpc_code, "x"), errors.PdRouterError)


def test_error_round_trip_and_foreign_exceptions() -> None:
    assert type(errors.error_from_grpc_code("RESOURCE_EXHAUSTED", "full")) is errors.CapacityError
    assert type(errors.error_from_grpc_code("DATA_LOSS", "?")) is errors.PdRouterError
    assert errors.http_status_for(RuntimeError()) == 500
    assert errors.RequestTooLargeError.retryable is False and errors.CapacityError.retryable is True


def test_request_ids_are_unique() -> None:
    ids = {new_request_id() for _ in range(1000)}
    assert len(ids) == 1000 and all(re.fullmatch("req-[0-9a-f]{32}", i) for i in ids)


def test_a_forked_process_makes_other_request_ids() -> None:
    import os

    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: its ids must not repeat the parent's
        os.write(write, "\n".join(new_request_id() for _ in range(3)).encode())
        os._exit(0)
    os.close(write)
    os.waitpid(pid, 0)
    with os.fdopen(read) as pipe:
        child = pipe.read().split("\n")
    parent = [new_request_id() for _ in range(3)]
    assert len(child) == 3 and not set(child) & set(parent)


def test_request_ids_tell_nothing_of_the_next() -> None:
    """Each id is random on its own: no shared prefix to read off one id, no counter to step."""
    ids = [new_request_id() for _ in range(64)]
    prefixes = {i[4:12] for i in ids}  # 8 hex digits: a shared part would repeat across the 64
    assert len(prefixes) == 64
    as_numbers = [int(i[4:], 16) for i in ids]
    assert not any(b - a == 1 for a, b in itertools.pairwise(as_numbers))


@pytest.mark.parametrize(("kwargs", "field"), [
    ({"max_tokens": 0}, "max_tokens"), ({"max_tokens": -3}, "max_tokens"),
    ({"top_p": 0.0}, "top_p"), ({"top_p": 1.5}, "top_p"), ({"temperature": -1.0}, "temperature"),
    ({"top_k": -1}, "top_k"), ({"seed": -1}, "seed"), ({"stop_token_ids": (-1,)}, "stop_token_ids"),
])
def test_sampling_params_reject_bad_values(kwargs: dict[str, object], field: str) -> None:
    with pytest.raises(errors.InvalidRequestError, match=field):
        SamplingParams(**kwargs)  # type: ignore[arg-type]


def test_sampling_defaults() -> None:
    assert SamplingParams(temperature=0.0).greedy
    assert not SamplingParams().greedy
