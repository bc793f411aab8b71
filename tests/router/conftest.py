"""Fixtures shared by the front-door tests."""

from __future__ import annotations

import pytest

from pdrouter.core.tokenizer import ByteTokenizer


@pytest.fixture
def tokenizer() -> ByteTokenizer:
    return ByteTokenizer(512)
