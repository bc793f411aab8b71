"""The Redis password kept out of the URL (``PDROUTER_REDIS_PASSWORD``) joins it exactly once."""

from __future__ import annotations

import pytest

from pdrouter.core.errors import ConfigError
from pdrouter.state.client import url_with_password


@pytest.mark.parametrize(("url", "password", "expected"), [
    ("redis://redis:6379/0", "s3cret", "redis://:s3cret@redis:6379/0"),
    ("rediss://cache.internal:6380/1?ssl_ca_certs=/ca.pem", "p@ss/word",
     "rediss://:p%40ss%2Fword@cache.internal:6380/1?ssl_ca_certs=/ca.pem"),
    ("redis://router@redis:6379/0", "pw", "redis://router:pw@redis:6379/0"),
    ("redis://:pw@redis:6379/0", "pw", "redis://:pw@redis:6379/0"),
    ("redis://redis:6379/0", None, "redis://redis:6379/0"),
])
def test_password_joins_the_url(url: str, password: str | None, expected: str) -> None:
    assert url_with_password(url, password) == expected


def test_two_different_passwords_are_refused() -> None:
    with pytest.raises(ConfigError, match="give one"):
        url_with_password("redis://:one@redis:6379/0", "two")
    with pytest.raises(ConfigError, match="unix://"):
        url_with_password("unix:///run/redis.sock", "pw")


async def test_the_password_opens_a_server_that_requires_it(redis_url: str) -> None:
    from redis.exceptions import AuthenticationError, ResponseError

    from pdrouter.state.client import redis_client

    admin = redis_client(redis_url, max_connections=4, pool_timeout_s=1.0)
    authed = redis_client(url_with_password(redis_url, "the-password"), max_connections=4, pool_timeout_s=1.0)
    stranger = redis_client(redis_url, max_connections=4, pool_timeout_s=1.0)
    await admin.config_set("requirepass", "the-password")
    try:
        assert await authed.ping()
        with pytest.raises((AuthenticationError, ResponseError)):
            await stranger.ping()
    finally:
        await authed.config_set("requirepass", "")  # the session's Redis is shared with other tests
        for client in (admin, authed, stranger):
            await client.aclose()
