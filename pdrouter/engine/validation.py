"""Request validation at the engine's edge: reject bad input before anything is allocated."""

from __future__ import annotations

import operator
from collections.abc import Sequence

from pdrouter.core.capacity import blocks_for_tokens
from pdrouter.core.errors import InvalidRequestError, PromptTooLongError, RequestTooLargeError
from pdrouter.core.model_spec import ModelSpec
from pdrouter.core.sampling import SamplingParams
from pdrouter.core.tokens import PackedPrompt


def token_ids(values: object, vocab_size: int, what: str = "prompt") -> Sequence[int]:
    """A tuple of ints in ``[0, vocab_size)``, or a ``PackedPrompt`` whose largest id is within it
    (kept packed); InvalidRequestError naming the first bad one."""
    if type(values) is PackedPrompt and values.largest < vocab_size:
        return values  # plain ints >= 0 by construction, the largest known
    if isinstance(values, str | bytes) or not isinstance(values, Sequence):
        raise InvalidRequestError(f"{what} must be a sequence of token ids, got {type(values).__name__}")
    ids = tuple(values)
    # Plain ints in range, checked by passes that run in C (a 2,000-token prompt: about a third of
    # the per-element loop below, which then only runs to name the first bad value).
    if not ids or (set(map(type, ids)) == {int} and min(ids) >= 0 and max(ids) < vocab_size):
        return ids
    out: list[int] = []
    for i, value in enumerate(ids):
        if isinstance(value, bool):
            raise InvalidRequestError(f"{what}[{i}] is a bool, not a token id")
        try:
            token = operator.index(value)
        except TypeError:
            raise InvalidRequestError(f"{what}[{i}] = {value!r} is not an integer token id") from None
        if not 0 <= token < vocab_size:
            raise InvalidRequestError(f"{what}[{i}] = {token} is outside the vocabulary [0, {vocab_size})")
        out.append(token)
    return tuple(out)


def validate_request(prompt: object, sampling: object, spec: ModelSpec, *, num_blocks: int,
                     block_size: int, hold_prompt_only: bool = False) -> Sequence[int]:
    """The prompt's token ids (a tuple, or the ``PackedPrompt`` it came as), once every check passed.

    * the prompt is a non-empty sequence of ids inside the vocabulary;
    * ``sampling`` is a valid :class:`SamplingParams` whose stop ids are inside the vocabulary;
    * prompt + ``max_tokens`` fits the model's context (PromptTooLongError);
    * the tokens this engine must hold (the prompt alone with ``hold_prompt_only``, for
      prefill-only requests, else prompt + ``max_tokens``) fit the whole KV pool
      (RequestTooLargeError: it would never run).
    """
    if not isinstance(sampling, SamplingParams):
        raise InvalidRequestError(f"sampling must be SamplingParams, got {type(sampling).__name__}")
    sampling.validate()
    ids = token_ids(prompt, spec.vocab_size)
    if not ids:
        raise InvalidRequestError("the prompt is empty: send at least one token")
    token_ids(list(sampling.stop_token_ids), spec.vocab_size, "stop_token_ids")
    total = len(ids) + sampling.max_tokens
    if total > spec.max_context:
        raise PromptTooLongError(f"prompt ({len(ids)} tokens) + max_tokens ({sampling.max_tokens}) = {total} "
                                 f"exceeds the model's context of {spec.max_context} tokens")
    held = len(ids) if hold_prompt_only else total
    if blocks_for_tokens(held, block_size) > num_blocks:
        raise RequestTooLargeError(f"the request needs {blocks_for_tokens(held, block_size)} KV blocks of "
                                   f"{block_size} tokens but the whole pool has {num_blocks}")
    return ids
