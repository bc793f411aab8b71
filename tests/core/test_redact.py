"""``redact_url``: passwords in URLs become ``***``; everything else is kept; it never raises."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pdrouter.core.redact import redact_url


@pytest.mark.parametrize(("url", "shown"), [
    ("redis://:s3cret@cache:6379/0", "redis://:***@cache:6379/0"),
    ("redis://alice:s3cret@cache:6379/0", "redis://alice:***@cache:6379/0"),
    ("rediss://alice:s3cret@cache.example.com:6380/1", "rediss://alice:***@cache.example.com:6380/1"),
    ("rediss://:p%40ss@cache/0?ssl_cert_reqs=none", "rediss://:***@cache/0?ssl_cert_reqs=none"),
    ("redis://s3cret@cache", "redis://***@cache"),  # a userinfo with no colon may be the password alone
    ("redis://:pa@ss@cache", "redis://:***@cache"),  # an unescaped "@" in the password
    ("redis://alice:s3cret@[::1]:6379", "redis://alice:***@[::1]:6379"),
    ("unix://:s3cret@/run/redis.sock?db=0", "unix://:***@/run/redis.sock?db=0"),
    ("redis://cache:6379/0?password=s3cret&db=1", "redis://cache:6379/0?password=***&db=1"),
    ("redis://cache/0?PASSWORD=s3cret", "redis://cache/0?PASSWORD=***"),
    ("redis://alice:s3cret@cache:port/0", "redis://alice:***@cache:port/0"),  # a bad port: still masked
    ("redis://alice:s3cret@[::1", "redis://***@[::1"),  # does not parse: the whole userinfo goes
    ("redis://a:b@[::1?password=s3cret", "redis://***@[::1?password=***"),
])
def test_passwords_are_masked(url: str, shown: str) -> None:
    assert redact_url(url) == shown
    assert "s3cret" not in redact_url(url)


@pytest.mark.parametrize("url", [
    "redis://127.0.0.1:6379/0", "redis://cache", "rediss://cache.example.com:6380/2?ssl_cert_reqs=none",
    "unix:///run/redis.sock", "", "not a url", "redis://[::1",
])
def test_urls_without_credentials_are_unchanged(url: str) -> None:
    assert redact_url(url) == url


_SAFE = st.text(st.characters(codec="ascii", categories=["L", "N"]), min_size=1, max_size=12)


@settings(max_examples=200, derandomize=True)
@given(scheme=st.sampled_from(["redis", "rediss", "unix"]), user=st.one_of(st.just(""), _SAFE.map(lambda s: "u" + s)),
       password=_SAFE, host=st.sampled_from(["cache", "10.0.0.7:6379", "[::1]:6380", "/run/r.sock"]),
       tail=st.sampled_from(["", "/0", "/3?ssl_cert_reqs=none"]))
def test_the_password_never_survives(scheme: str, user: str, password: str, host: str, tail: str) -> None:
    secret = "pw" + password
    shown = redact_url(f"{scheme}://{user}:{secret}@{host}{tail}")
    assert secret not in shown
    assert shown == f"{scheme}://{user}:***@{host}{tail}"


@settings(max_examples=200, derandomize=True)
@given(st.text(max_size=60))
def test_any_text_is_accepted(text: str) -> None:
    assert isinstance(redact_url(text), str)
