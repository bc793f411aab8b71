"""Bad input is refused with a ``pdrouter.core.errors`` error at every entry point, before anything is
allocated: by the torch engine and by the simulated one alike."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from pdrouter.core.errors import (
    InvalidRequestError,
    PdRouterError,
    PromptTooLongError,
    RequestTooLargeError,
)
from pdrouter.core.ids import RequestId
from pdrouter.core.sampling import SamplingParams
from pdrouter.engine.batch_engine import BatchEngine

from .engine_testing import AnyEngineFactory, assert_no_leak, rid


def bypass(**fields: Any) -> SamplingParams:
    """SamplingParams with out-of-range fields (as a buggy caller could build with object.__setattr__)."""
    params = SamplingParams()
    for name, value in fields.items():
        object.__setattr__(params, name, value)
    return params


CASES: list[tuple[str, object, object, type[PdRouterError], str]] = [
    ("empty prompt", [], SamplingParams(), InvalidRequestError, "empty"),
    ("prompt over context", [1] * 1024, SamplingParams(max_tokens=1), PromptTooLongError, "context"),
    ("prompt + max_tokens over context", [1] * 1000, SamplingParams(max_tokens=25), PromptTooLongError,
     "1025"),
    ("token id = vocab", [1, 512], SamplingParams(), InvalidRequestError, "vocabulary"),
    ("negative token id", [-1], SamplingParams(), InvalidRequestError, "vocabulary"),
    ("float token", [1.5], SamplingParams(), InvalidRequestError, "integer"),
    ("bool token", [True], SamplingParams(), InvalidRequestError, "bool"),
    ("text prompt", "hello", SamplingParams(), InvalidRequestError, "sequence"),
    ("max_tokens = 0", [1], bypass(max_tokens=0), InvalidRequestError, "max_tokens"),
    ("max_tokens < 0", [1], bypass(max_tokens=-3), InvalidRequestError, "max_tokens"),
    ("top_p = 0", [1], bypass(top_p=0.0), InvalidRequestError, "top_p"),
    ("top_p > 1", [1], bypass(top_p=1.5), InvalidRequestError, "top_p"),
    ("stop id out of vocab", [1], SamplingParams(stop_token_ids=(600,)), InvalidRequestError, "stop_token_ids"),
    ("not SamplingParams", [1], {"max_tokens": 4}, InvalidRequestError, "SamplingParams"),
    ("more KV than the pool", [1] * 130, SamplingParams(max_tokens=1), RequestTooLargeError, "whole pool"),
]

ENTRY_POINTS: dict[str, Callable[[BatchEngine, RequestId, Any, Any], object]] = {
    "add_request": lambda e, r, p, s: e.add_request(r, p, s),
    "add_prefill_request": lambda e, r, p, s: e.add_prefill_request(r, p, s),
    "reserve_remote": lambda e, r, p, s: e.reserve_remote(r, p, s),
}


@pytest.mark.parametrize("entry", list(ENTRY_POINTS))
@pytest.mark.parametrize(("prompt", "sampling", "error", "match"), [c[1:] for c in CASES],
                         ids=[c[0] for c in CASES])
def test_bad_input_is_refused_and_nothing_allocated(make_any_engine: AnyEngineFactory, entry: str, prompt: object,
                                                    sampling: object, error: type[PdRouterError],
                                                    match: str) -> None:
    engine = make_any_engine(num_blocks=8)
    with pytest.raises(error, match=match):
        ENTRY_POINTS[entry](engine, rid(), prompt, sampling)
    assert_no_leak(engine)


def test_sampling_params_themselves_refuse_bad_values() -> None:
    with pytest.raises(InvalidRequestError, match="max_tokens"):
        SamplingParams(max_tokens=0)
    with pytest.raises(InvalidRequestError, match="top_p"):
        SamplingParams(top_p=0.0)
    with pytest.raises(InvalidRequestError, match="top_p"):
        SamplingParams(top_p=1.01)


def test_duplicate_and_empty_request_ids(make_any_engine: AnyEngineFactory) -> None:
    engine = make_any_engine()
    r = rid()
    engine.add_request(r, [1, 2], SamplingParams(max_tokens=2))
    for entry in ENTRY_POINTS.values():
        with pytest.raises(InvalidRequestError, match="already in use"):
            entry(engine, r, [3, 4], SamplingParams(max_tokens=2))
    with pytest.raises(InvalidRequestError, match="request_id"):
        engine.add_request(RequestId(""), [1], SamplingParams())
    assert engine.stats().num_waiting == 1
    engine.abort(r)


def test_commit_remote_refuses_a_token_outside_the_vocabulary(make_any_engine: AnyEngineFactory) -> None:
    engine = make_any_engine()
    r = rid()
    engine.reserve_remote(r, [1, 2, 3], SamplingParams())
    with pytest.raises(InvalidRequestError, match="first_token"):
        engine.commit_remote(r, 512)
    assert engine.stats().num_awaiting_kv == 1
    engine.abort(r)


def test_prefill_side_holds_only_the_prompt(make_any_engine: AnyEngineFactory) -> None:
    engine = make_any_engine(num_blocks=8)
    r = rid()
    engine.add_prefill_request(r, [1] * 100, SamplingParams(max_tokens=60))  # 7 blocks: fits
    with pytest.raises(RequestTooLargeError):
        engine.add_prefill_request(rid(), [1] * 130, SamplingParams(max_tokens=1))  # 9 blocks
    engine.abort(r)


def test_token_ids_fast_and_slow_paths_agree() -> None:
    """Plain ints in range come back as they are; anything else goes through the per-value checks."""
    from enum import IntEnum

    from pdrouter.engine.validation import token_ids

    class Tok(IntEnum):
        A = 3

    assert token_ids([1, 2, 3], 10) == (1, 2, 3)
    assert token_ids((), 10) == ()
    converted = token_ids([1, Tok.A], 10)
    assert converted == (1, 3) and all(type(t) is int for t in converted)
    for bad, words in (([1, True], "bool"), ([1, 2.0], "not an integer"), ([1, -1], "outside"),
                       ([1, 10], "outside")):
        with pytest.raises(InvalidRequestError, match=words):
            token_ids(bad, 10)
