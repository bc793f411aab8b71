"""The allocator tuning every long-lived pdrouter process applies at start."""

from __future__ import annotations

import platform

import pytest

from pdrouter.cli.serve import tune_allocator


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="mallopt thresholds are glibc's")
def test_applied_on_glibc() -> None:
    assert tune_allocator() is True


def test_an_operator_setting_wins(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", "131072")
    assert tune_allocator() is False
