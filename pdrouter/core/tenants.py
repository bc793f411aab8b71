"""Tenants: who sends a request, and what it may take.

A router started with a tenants file (``--tenants FILE``, YAML) maps each API key to a tenant; a
tenant has limits (requests, prompt tokens and output tokens per minute, requests at once), a
priority class, a fair-share weight and a cache policy::

    default:                       # keys that name no tenant (optional: unlimited, weight 1, cache shared)
      requests_per_minute: 60
    tenants:
      team-a:
        api_key_sha256: [9f86d081884c7d65…]   # its keys' SHA-256 digests (hex), or "KEY team-a" in the key file
        requests_per_minute: 600
        prompt_tokens_per_minute: 2000000
        output_tokens_per_minute: 400000
        max_concurrent: 64
        priority: interactive      # interactive | standard | batch, or an integer in [-100, 100]
        weight: 3                  # its share of the decode pools when they are full (> 0)
        cache: tenant              # tenant: its prompts share cached blocks among themselves only; shared

Every field but the name is optional; a limit left out is no limit. Unknown fields are refused
(a misspelt limit must not silently be no limit). Names are 1–64 characters of ``A-Z a-z 0-9 . _ -``
(they become Redis key parts and metric labels); ``default`` is the tenant of keys that name none.

Nothing here touches Redis or the network: this is the vocabulary the router's gate
(``pdrouter.router.tenancy``), its admission queue and its metrics share.
"""

from __future__ import annotations

import hashlib
import hmac
import math
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml

from pdrouter.core.errors import CapacityError, ConfigError

DEFAULT_TENANT = "default"
"""The tenant of keys (and key-less requests) that name none."""
PRIORITY_CLASSES: Mapping[str, int] = {"interactive": 1, "standard": 0, "batch": -1}
"""Named priority classes; a waiting request of a higher class is always admitted before any of a lower one."""
MAX_PRIORITY = 100
_NAME = re.compile(r"[A-Za-z0-9._-]{1,64}")
LIMIT_NAMES = ("requests_per_minute", "prompt_tokens_per_minute", "output_tokens_per_minute", "max_concurrent")
"""The limits a tenant may have; also the ``reason`` of a refusal (a metric label, the error's message)."""
CacheMode = Literal["tenant", "shared"]
_TENANT_FIELDS = frozenset({*LIMIT_NAMES, "priority", "weight", "cache", "api_key_sha256"})


@dataclass(frozen=True)
class TenantLimits:
    """A tenant's limits across every router of the pool (None: no limit)."""

    requests_per_minute: int | None = None
    prompt_tokens_per_minute: int | None = None
    output_tokens_per_minute: int | None = None
    """Output tokens are counted as a request's ``max_tokens`` when it is admitted (as OpenAI counts
    them), and corrected to what it generated when it ends."""
    max_concurrent: int | None = None
    """Requests of the tenant being served at once (waiting for KV room included)."""

    @property
    def limited(self) -> bool:
        """Whether any limit is set (an unlimited tenant costs no Redis call)."""
        return any(getattr(self, name) is not None for name in LIMIT_NAMES)


@dataclass(frozen=True)
class Tenant:
    name: str
    limits: TenantLimits = field(default_factory=TenantLimits)
    priority: int = 0
    """Its requests wait for KV room in this class: a higher one is always admitted first."""
    weight: float = 1.0
    """Its share, against the other tenants waiting in its class, of the KV room that comes back."""
    cache: CacheMode = "tenant"
    """``tenant``: its prompts share cached prefix blocks with its own requests only (its name salts
    their block hashes); ``shared``: with every request of a shared tenant (as without tenants)."""

    @property
    def salt_scope(self) -> str | None:
        """The tenant's part of its requests' cache salt (``pdrouter.core.hashing.cache_salt_key``)."""
        return self.name if self.cache == "tenant" else None


UNLIMITED_DEFAULT = Tenant(DEFAULT_TENANT, cache="shared")


class RateLimitError(CapacityError):
    """A tenant is over one of its limits: HTTP 429 with ``Retry-After``, gRPC RESOURCE_EXHAUSTED.
    ``limit`` names which (:data:`LIMIT_NAMES`); OpenAI's ``error.code`` is ``rate_limit_exceeded``."""

    openai_code = "rate_limit_exceeded"

    def __init__(self, message: str, limit: str, retry_after_s: int) -> None:
        super().__init__(message, retry_after_s=retry_after_s, reason=limit)
        self.limit = limit


class RateLimitTooLargeError(RateLimitError):
    """One request alone needs more than its tenant's limit per minute: it will never pass (do not retry)."""

    retryable = False


def key_digest(key: bytes) -> bytes:
    """The SHA-256 digest API keys are known by (``api_key_sha256`` holds their hex)."""
    return hashlib.sha256(key).digest()


class Tenants:
    """The tenants of one router, and which API key belongs to which. Immutable; safe to share.

    ``for_key`` finds a presented key's tenant comparing its digest with every known key's digest
    in constant time, as the key check itself does (``pdrouter.router.frontdoor.auth``)."""

    __slots__ = ("_by_name", "_default", "_digests", "_names")

    def __init__(self, tenants: Iterable[Tenant], key_tenants: Mapping[bytes, str] | None = None,
                 default: Tenant = UNLIMITED_DEFAULT) -> None:
        """``key_tenants``: key digest (:func:`key_digest`) → tenant name."""
        self._by_name = {t.name: t for t in tenants}
        if default.name != DEFAULT_TENANT:
            raise ConfigError(f"the default tenant is named {DEFAULT_TENANT!r}")
        self._by_name[DEFAULT_TENANT] = default
        self._default = default
        for name in (key_tenants or {}).values():
            if name not in self._by_name:
                raise ConfigError(f"an API key names tenant {name!r}, which the tenants file does not define")
        pairs = sorted((key_tenants or {}).items())
        self._digests = tuple(d for d, _ in pairs)
        self._names = tuple(n for _, n in pairs)

    def __len__(self) -> int:
        return len(self._by_name)

    def __repr__(self) -> str:
        return f"Tenants({sorted(self._by_name)}, {len(self._digests)} keys)"

    @property
    def names(self) -> list[str]:
        return sorted(self._by_name)

    @property
    def default(self) -> Tenant:
        return self._default

    def get(self, name: str) -> Tenant:
        return self._by_name[name]

    def for_key(self, key: bytes | None) -> Tenant:
        """The tenant of API key ``key`` (the token after ``Bearer``; None: none presented)."""
        if key is None or not self._digests:
            return self._default
        presented = key_digest(key)
        found = 0
        for i, digest in enumerate(self._digests):
            found |= (i + 1) * hmac.compare_digest(presented, digest)
        return self._by_name[self._names[found - 1]] if found else self._default

    def for_authorization(self, authorization: bytes | str | None) -> Tenant:
        """The tenant of a request's ``Authorization`` value (``Bearer <key>``)."""
        if authorization is None:
            return self._default
        if isinstance(authorization, str):
            authorization = authorization.encode("utf-8", "surrogateescape")
        scheme, _, token = authorization.strip().partition(b" ")
        return self.for_key(token.strip() if scheme.lower() == b"bearer" else None)


# -- the file ------------------------------------------------------------------------------------


def _positive_int(value: Any, where: str) -> int:
    if type(value) is not int or value <= 0:
        raise ConfigError(f"{where} must be a positive integer, got {value!r}")
    return value


def _priority(value: Any, where: str) -> int:
    if isinstance(value, str):
        if value not in PRIORITY_CLASSES:
            raise ConfigError(f"{where} must be one of {sorted(PRIORITY_CLASSES)} or an integer, got {value!r}")
        return PRIORITY_CLASSES[value]
    if type(value) is not int or abs(value) > MAX_PRIORITY:
        raise ConfigError(f"{where} must be a class name or an integer in [-{MAX_PRIORITY}, {MAX_PRIORITY}], "
                          f"got {value!r}")
    return value


def _weight(value: Any, where: str) -> float:
    if type(value) not in (int, float) or not math.isfinite(value) or not 0 < value <= 1e6:
        raise ConfigError(f"{where} must be a number in (0, 1e6], got {value!r}")
    return float(value)


def _digests(value: Any, where: str) -> list[bytes]:
    if not isinstance(value, list):
        raise ConfigError(f"{where} must be a list of SHA-256 digests (hex), got {type(value).__name__}")
    out = []
    for item in value:
        if not isinstance(item, str) or not re.fullmatch(r"[0-9a-fA-F]{64}", item):
            raise ConfigError(f"{where} holds {item!r}: each entry is a key's SHA-256 digest, 64 hex digits "
                              f"(printf %s KEY | sha256sum)")
        out.append(bytes.fromhex(item))
    return out


def _tenant(name: str, body: Any, where: str, default_cache: CacheMode) -> tuple[Tenant, list[bytes]]:
    if body is None:
        body = {}
    if not isinstance(body, dict):
        raise ConfigError(f"{where} must be a mapping of settings, got {type(body).__name__}")
    unknown = sorted(set(body) - _TENANT_FIELDS)
    if unknown:
        raise ConfigError(f"{where}: unknown setting {unknown[0]!r} (known: {', '.join(sorted(_TENANT_FIELDS))})")
    limits = TenantLimits(**{k: _positive_int(body[k], f"{where}.{k}") for k in LIMIT_NAMES if body.get(k) is not None})
    cache = body.get("cache", default_cache)
    if cache not in ("tenant", "shared"):
        raise ConfigError(f"{where}.cache must be tenant or shared, got {cache!r}")
    tenant = Tenant(name, limits, _priority(body.get("priority", 0), f"{where}.priority"),
                    _weight(body.get("weight", 1), f"{where}.weight"), cache)
    keys = _digests(body["api_key_sha256"], f"{where}.api_key_sha256") if "api_key_sha256" in body else []
    return tenant, keys


def check_tenant_name(name: Any, where: str) -> str:
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise ConfigError(f"{where}: tenant names are 1-64 characters of A-Z a-z 0-9 . _ -, got {name!r}")
    return name


def parse_tenants(data: Any, key_tenants: Mapping[str, str] | None = None, where: str = "tenants file") -> Tenants:
    """Tenants from a parsed tenants file; ``key_tenants``: API key → tenant name from the key file.
    ConfigError naming the setting for anything wrong."""
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"{where} must be a mapping with 'tenants' (and 'default'), got {type(data).__name__}")
    unknown = sorted(set(data) - {"tenants", "default"})
    if unknown:
        raise ConfigError(f"{where}: unknown section {unknown[0]!r} (known: default, tenants)")
    section = data.get("tenants") or {}
    if not isinstance(section, dict):
        raise ConfigError(f"{where}: 'tenants' must map tenant names to their settings")
    tenants: list[Tenant] = []
    digests: dict[bytes, str] = {}

    def add_key(digest: bytes, name: str) -> None:
        if digests.setdefault(digest, name) != name:
            raise ConfigError(f"{where}: one API key belongs to both {digests[digest]!r} and {name!r}")

    for name, body in section.items():
        check_tenant_name(name, f"{where}: tenants")
        if name == DEFAULT_TENANT:
            raise ConfigError(f"{where}: {DEFAULT_TENANT!r} is set in its own section, 'default:'")
        tenant, keys = _tenant(name, body, f"{where}: tenants.{name}", "tenant")
        tenants.append(tenant)
        for digest in keys:
            add_key(digest, name)
    default_body = data.get("default")
    if isinstance(default_body, dict) and "api_key_sha256" in default_body:
        raise ConfigError(f"{where}: default.api_key_sha256: the default tenant is that of keys naming none")
    default, _ = _tenant(DEFAULT_TENANT, default_body, f"{where}: default", "shared")
    for key, name in (key_tenants or {}).items():
        check_tenant_name(name, "--api-key-file")
        add_key(key_digest(key.encode()), name)
    return Tenants(tenants, digests, default)


def load_tenants(path: Path, key_tenants: Mapping[str, str] | None = None) -> Tenants:
    """The tenants of a ``--tenants`` file (ConfigError, one line, for an unreadable or invalid one)."""
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"--tenants {path}: cannot read it ({type(exc).__name__})") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"--tenants {path}: not valid YAML ({str(exc).splitlines()[0]})") from None
    return parse_tenants(data, key_tenants, f"--tenants {path}")
