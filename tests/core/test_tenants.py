"""The tenants file: tenants, their keys, limits, classes, weights and cache policy; every mistake
refused with one line naming the setting."""

from __future__ import annotations

import hashlib
import re
from pathlib import Path

import pytest

from pdrouter.core.errors import ConfigError
from pdrouter.core.tenants import DEFAULT_TENANT, Tenant, TenantLimits, load_tenants, parse_tenants

KEY_A, KEY_B, KEY_C = "a" * 24, "b" * 24, "c" * 24


def _hex(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


FILE = f"""
default:
  requests_per_minute: 10
tenants:
  team-a:
    api_key_sha256: [{_hex(KEY_A)}]
    requests_per_minute: 600
    prompt_tokens_per_minute: 200000
    output_tokens_per_minute: 40000
    max_concurrent: 64
    priority: interactive
    weight: 3
  batch.jobs:
    priority: batch
    weight: 0.5
    cache: shared
"""


def test_a_tenants_file_maps_keys_to_tenants(tmp_path: Path) -> None:
    path = tmp_path / "tenants.yaml"
    path.write_text(FILE)
    tenants = load_tenants(path, {KEY_B: "batch.jobs"})
    a = tenants.get("team-a")
    assert a == Tenant("team-a", TenantLimits(600, 200000, 40000, 64), priority=1, weight=3.0, cache="tenant")
    assert a.salt_scope == "team-a" and tenants.get("batch.jobs").salt_scope is None
    assert tenants.get("batch.jobs").priority == -1
    assert tenants.for_authorization(f"Bearer {KEY_A}") is a
    assert tenants.for_authorization(f"bearer  {KEY_B} ".encode()).name == "batch.jobs"
    default = tenants.for_authorization(f"Bearer {KEY_C}")
    assert default.name == DEFAULT_TENANT and default.limits.requests_per_minute == 10
    assert default.cache == "shared" and tenants.for_authorization(None) is default
    assert tenants.names == ["batch.jobs", "default", "team-a"]
    assert KEY_A not in repr(tenants)


def test_without_a_default_section_keys_of_no_tenant_are_unlimited() -> None:
    tenants = parse_tenants({"tenants": {"t": {"requests_per_minute": 1}}})
    assert not tenants.default.limits.limited and tenants.default.weight == 1.0
    assert not TenantLimits().limited and TenantLimits(max_concurrent=1).limited


@pytest.mark.parametrize(("text", "words"), [
    ("tenants:\n  t:\n    requests_per_min: 5\n", "tenants.t: unknown setting 'requests_per_min'"),
    ("tenants:\n  t:\n    requests_per_minute: 0\n", "requests_per_minute must be a positive integer, got 0"),
    ("tenants:\n  t:\n    max_concurrent: 2.5\n", "max_concurrent must be a positive integer"),
    ("tenants:\n  t:\n    priority: urgent\n", "priority must be one of ['batch', 'interactive', 'standard']"),
    ("tenants:\n  t:\n    priority: 1000\n", "an integer in [-100, 100]"),
    ("tenants:\n  t:\n    weight: 0\n", "weight must be a number in (0, 1e6]"),
    ("tenants:\n  t:\n    cache: none\n", "cache must be tenant or shared"),
    ("tenants:\n  t:\n    api_key_sha256: [abc]\n", "64 hex digits"),
    ("tenants:\n  'a b':\n    weight: 1\n", "tenant names are 1-64 characters"),
    ("tenants:\n  default:\n    weight: 1\n", "'default' is set in its own section"),
    ("limits: {}\n", "unknown section 'limits'"),
    ("tenants: [a, b]\n", "'tenants' must map tenant names"),
    ("tenants:\n  t: [1]\n", "must be a mapping of settings"),
    ("default:\n  api_key_sha256: []\n", "the default tenant is that of keys naming none"),
    (f"tenants:\n  x:\n    api_key_sha256: [{_hex(KEY_A)}]\n  y:\n    api_key_sha256: [{_hex(KEY_A)}]\n",
     "one API key belongs to both 'x' and 'y'"),
    ("tenants: {\n", "not valid YAML"),
])
def test_mistakes_are_one_line_naming_the_setting(tmp_path: Path, text: str, words: str) -> None:
    path = tmp_path / "tenants.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=re.escape(words)) as raised:
        load_tenants(path)
    assert "\n" not in raised.value.message


def test_keys_naming_unknown_tenants_are_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="names tenant 'nobody'"):
        parse_tenants({"tenants": {"t": None}}, {KEY_A: "nobody"})
    with pytest.raises(ConfigError, match="both 't' and 'u'"):
        parse_tenants({"tenants": {"t": {"api_key_sha256": [_hex(KEY_A)]}, "u": None}}, {KEY_A: "u"})
    with pytest.raises(ConfigError, match="cannot read it"):
        load_tenants(tmp_path / "missing.yaml")
