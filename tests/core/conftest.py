"""Core fixtures: a small model folder (its tokenizer files are what the tokenizer tests read)."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The ``tiny`` preset, seed 0 (written by the engine's model writer, imported here only)."""
    from pdrouter.engine.model_io import make_model

    return make_model("tiny", 0, tmp_path_factory.mktemp("tiny"))
