"""API keys for both front doors: which keys are accepted, and the check of one request's credentials.

A router started with keys (``--api-key``, ``--api-key-file``, ``PDROUTER_API_KEYS``: the union)
serves a request only when it carries ``Authorization: Bearer <key>`` (gRPC: the metadata
``authorization: Bearer <key>``) for one of them; the liveness paths (HTTP ``/health``,
``/healthz``; gRPC ``grpc.health.v1.Health``) stay open. Without keys every request is served.

The check costs the same whichever key, if any, the request carries: the presented key and each
accepted one are compared as SHA-256 digests (fixed length, so no key's length shows), every
accepted key is compared (``hmac.compare_digest``, constant time) and the results are combined
without stopping at a match. Keys are held only as digests; nothing here logs or prints one, and
an :class:`ApiKeys` shows how many keys it holds, never a key.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Iterable, Sequence
from pathlib import Path

from pdrouter.core.errors import ConfigError, PdRouterError

MIN_KEY_CHARS = 16
"""The shortest key accepted at start (``secrets.token_urlsafe(24)`` makes 32 characters)."""
ENV_VAR = "PDROUTER_API_KEYS"
"""Comma-separated keys, read by ``pdrouter router`` (and ``pdrouter up``, which passes its key on)."""
OPEN_HTTP_PATHS = frozenset({"/health", "/healthz"})
"""HTTP paths served without a key: liveness and readiness probes."""
OPEN_GRPC_PREFIX = "/grpc.health.v1.Health/"
"""gRPC methods served without a key: the standard health service."""


class AuthenticationError(PdRouterError):
    """The request carries no API key, or one that is not accepted (HTTP 401, gRPC UNAUTHENTICATED)."""

    grpc_code = "UNAUTHENTICATED"
    http_status = 401
    openai_type = "invalid_request_error"
    openai_code = "invalid_api_key"


MISSING_KEY = "no API key: send the header Authorization: Bearer <key>"
WRONG_KEY = "invalid API key"


def _digest(key: bytes) -> bytes:
    return hashlib.sha256(key).digest()


class ApiKeys:
    """The accepted keys of one router (none: the doors are open). Immutable; safe to share."""

    __slots__ = ("_digests",)

    def __init__(self, keys: Iterable[str] = ()) -> None:
        """``keys``: already checked (:func:`collect_api_keys`); duplicates are merged."""
        self._digests = tuple(sorted({_digest(k.encode()) for k in keys}))

    @property
    def enabled(self) -> bool:
        """True when requests need a key."""
        return bool(self._digests)

    def __len__(self) -> int:
        return len(self._digests)

    def __repr__(self) -> str:
        return f"ApiKeys({len(self._digests)} keys)"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, ApiKeys) and other._digests == self._digests

    def __hash__(self) -> int:
        return hash(self._digests)

    def check(self, authorization: bytes | str | None) -> None:
        """Nothing when ``authorization`` (a request's ``Authorization`` value) is ``Bearer <key>``
        for an accepted key, or when no key is configured; :class:`AuthenticationError` otherwise."""
        if not self._digests:
            return
        if authorization is None:
            raise AuthenticationError(MISSING_KEY)
        if isinstance(authorization, str):
            authorization = authorization.encode("utf-8", "surrogateescape")
        scheme, _, token = authorization.strip().partition(b" ")
        if scheme.lower() != b"bearer":
            raise AuthenticationError(MISSING_KEY)
        presented = _digest(token.strip())
        match = False
        for digest in self._digests:
            match |= hmac.compare_digest(presented, digest)
        if not match:
            raise AuthenticationError(WRONG_KEY)


def _checked(key: str, where: str) -> str:
    if len(key) < MIN_KEY_CHARS:
        raise ConfigError(f"an API key from {where} has {len(key)} characters: keys need at least {MIN_KEY_CHARS} "
                          f"(make one with: python -c 'import secrets; print(secrets.token_urlsafe(24))')")
    if not (key.isascii() and key.isprintable()) or " " in key:
        raise ConfigError(f"an API key from {where} has a space or a character that is not printable ASCII")
    return key


def _key_lines(path: Path) -> list[tuple[str, str | None]]:
    """``(key, tenant or None)`` per key line of an ``--api-key-file``."""
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"--api-key-file {path}: cannot read it ({type(exc).__name__})") from None
    out: list[tuple[str, str | None]] = []
    for number, line in enumerate(text.splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        parts = line.split()
        if len(parts) > 2:
            raise ConfigError(f"--api-key-file {path} line {number}: a line is a key and, optionally, its tenant's "
                              f"name; this one has more")
        out.append((_checked(parts[0], f"--api-key-file {path} line {number}"), parts[1] if len(parts) == 2 else None))
    return out


def read_key_file(path: Path) -> list[str]:
    """The keys of an ``--api-key-file``: one a line, optionally followed by its tenant's name
    (``KEY team-a``, see ``pdrouter.core.tenants``); blank lines and ``#`` comments are skipped."""
    return [key for key, _ in _key_lines(path)]


def key_file_tenants(files: Sequence[Path]) -> dict[str, str]:
    """Key → tenant name, for the key lines of ``files`` that name a tenant."""
    return {key: tenant for path in files for key, tenant in _key_lines(path) if tenant is not None}


def collect_api_keys(flags: Sequence[str] = (), files: Sequence[Path] = (), env: str | None = None) -> ApiKeys:
    """The union of the keys given with ``--api-key`` (``flags``), in ``--api-key-file`` s and in
    the ``PDROUTER_API_KEYS`` value ``env`` (comma-separated, blanks skipped).

    ConfigError (one line, naming where the key came from but never the key) for a key shorter
    than :data:`MIN_KEY_CHARS`, one with spaces or unprintable characters, or an unreadable file.
    An ``--api-key-file`` with no key in it is refused too: it would leave the doors open.
    """
    keys = [_checked(k.strip(), "--api-key") for k in flags]
    for path in files:
        found = read_key_file(path)
        if not found:
            raise ConfigError(f"--api-key-file {path} holds no key")
        keys += found
    keys += [_checked(k.strip(), ENV_VAR) for k in (env or "").split(",") if k.strip()]
    return ApiKeys(keys)
