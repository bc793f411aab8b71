"""``secret_from_env``: a secret from ``NAME`` or from the file ``NAME_FILE`` names."""

from __future__ import annotations

from pathlib import Path

import pytest

from pdrouter.core.errors import ConfigError
from pdrouter.core.secrets_env import secret_from_env

SECRET = "s3cret-value-0123456789"


def test_neither_form_is_none() -> None:
    assert secret_from_env("PDR_TEST_SECRET", {}) is None
    assert secret_from_env("PDR_TEST_SECRET", {"PDR_TEST_SECRET": "", "PDR_TEST_SECRET_FILE": ""}) is None


def test_the_value_itself() -> None:
    assert secret_from_env("PDR_TEST_SECRET", {"PDR_TEST_SECRET": SECRET}) == SECRET


def test_a_file_holding_it_with_its_trailing_newline_stripped(tmp_path: Path) -> None:
    path = tmp_path / "secret"
    path.write_text(SECRET + "\n")
    assert secret_from_env("PDR_TEST_SECRET", {"PDR_TEST_SECRET_FILE": str(path)}) == SECRET


def test_both_forms_at_once_are_refused(tmp_path: Path) -> None:
    path = tmp_path / "secret"
    path.write_text(SECRET)
    with pytest.raises(ConfigError, match="both PDR_TEST_SECRET and PDR_TEST_SECRET_FILE") as caught:
        secret_from_env("PDR_TEST_SECRET", {"PDR_TEST_SECRET": SECRET, "PDR_TEST_SECRET_FILE": str(path)})
    assert SECRET not in caught.value.message


@pytest.mark.parametrize("content", [None, "", "  \n", b"\xff\xfe"], ids=["missing", "empty", "blank", "not utf-8"])
def test_an_unreadable_or_empty_file_is_refused(tmp_path: Path, content: str | bytes | None) -> None:
    path = tmp_path / "secret"
    if isinstance(content, bytes):
        path.write_bytes(content)
    elif content is not None:
        path.write_text(content)
    with pytest.raises(ConfigError, match="PDR_TEST_SECRET_FILE"):
        secret_from_env("PDR_TEST_SECRET", {"PDR_TEST_SECRET_FILE": str(path)})


def test_a_directory_is_unreadable(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read"):
        secret_from_env("PDR_TEST_SECRET", {"PDR_TEST_SECRET_FILE": str(tmp_path)})


def test_the_process_environment_by_default(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PDR_TEST_SECRET", SECRET)
    monkeypatch.delenv("PDR_TEST_SECRET_FILE", raising=False)
    assert secret_from_env("PDR_TEST_SECRET") == SECRET
