"""Secrets from the environment: ``NAME`` holds the value, or ``NAME_FILE`` names a file holding it.

The ``_FILE`` form is the Docker / Kubernetes secrets convention: the value never appears in the
process's environment or command line. Surrounding whitespace (a trailing newline) is stripped.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

from pdrouter.core.errors import ConfigError


def secret_from_env(name: str, environ: Mapping[str, str] | None = None) -> str | None:
    """The secret in ``name`` or in the file ``name_FILE`` names; None when neither is set.

    ConfigError (one line naming the variable, never the value) when both are set, or the
    file cannot be read or is empty.
    """
    env = os.environ if environ is None else environ
    value, path = env.get(name) or None, env.get(f"{name}_FILE") or None
    if value is not None and path is not None:
        raise ConfigError(f"both {name} and {name}_FILE are set: give one")
    if path is None:
        return value.strip() if value is not None else None
    try:
        text = Path(path).read_text(encoding="utf-8").strip()
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{name}_FILE={path}: cannot read it ({type(exc).__name__})") from None
    if not text:
        raise ConfigError(f"{name}_FILE={path} is empty")
    return text
