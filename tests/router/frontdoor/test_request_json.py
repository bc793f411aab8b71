"""Request bodies are read as ``json.loads`` reads them, refusals included, with the same messages."""

from __future__ import annotations

import json
from typing import Any

import pytest

from pdrouter.core.errors import InvalidRequestError
from pdrouter.router.frontdoor.openai_schema import load_json_object


def _refuse_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


@pytest.mark.parametrize("body", [
    b'{"model": "echo", "prompt": [1, 2], "temperature": 0.5, "stop": ["\\u00e9", "x"]}',
    b'\xef\xbb\xbf{"model": "echo"}',  # a UTF-8 BOM
    b'{"temperature": NaN}', b'{"t": -Infinity}', b'{"model": ', b"", b"[1, 2]", b'{"a": 1} trailing',
    b"[" * 100_000,
])
def test_bodies_read_as_json_loads_reads_them(body: bytes) -> None:
    try:
        expected: Any = json.loads(body.decode(), parse_constant=_refuse_constant)
    except (ValueError, RecursionError) as exc:
        expected = InvalidRequestError(f"request body is not valid JSON: {exc}")
    if not isinstance(expected, dict | InvalidRequestError):
        expected = InvalidRequestError("request body must be a JSON object, got an array")
    if isinstance(expected, InvalidRequestError):
        with pytest.raises(InvalidRequestError) as raised:
            load_json_object(body)
        assert raised.value.message == expected.message
    else:
        assert load_json_object(body) == expected
