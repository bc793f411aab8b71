"""ServedModel's checks: the vocabulary bound on token ids, at its edges."""

from __future__ import annotations

import pytest

from pdrouter.core.errors import InvalidRequestError
from pdrouter.core.tokenizer import ByteTokenizer
from pdrouter.router.frontdoor.served_models import ServedModel
from pdrouter.router.request import ModelInfo


def make_served(vocab_size: int = 512) -> ServedModel:
    return ServedModel(ModelInfo(name="m", max_context=128, vocab_size=vocab_size, block_size=16),
                       ByteTokenizer(vocab_size))


@pytest.mark.parametrize("ids", [(), (0,), (511,), (0, 511, 7), [3] * 1000])
def test_ids_inside_the_vocabulary_pass(ids: list[int]) -> None:
    make_served().check_token_ids(ids, "prompt")


@pytest.mark.parametrize(("ids", "bad"), [((512,), 512), ((-1,), -1), ((5, 600, -3), 600), ((5, -3, 600), -3)])
def test_the_first_id_outside_is_named(ids: tuple[int, ...], bad: int) -> None:
    with pytest.raises(InvalidRequestError) as raised:
        make_served().check_token_ids(ids, "prompt")
    assert raised.value.message.startswith(f"prompt: token id {bad} is outside the vocabulary of 'm' [0, 512)")
