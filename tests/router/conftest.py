"""Fixtures shared by the front-door tests."""

from __future__ import annotations

import pytest

from engine.tokenizer import ByteTokenizer


@pytest.fixture
def tokenizer() -> ByteTokenizer:
    return ByteTokenizer(512)
