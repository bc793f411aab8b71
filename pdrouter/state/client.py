"""The router's Redis client: a bounded connection pool that makes callers wait, never fail, when full.

redis-py's default asyncio pool opens up to 100 connections and then *raises* on the next call
(``MaxConnectionsError``), so a burst of concurrent calls (prefix lookups, bookings, releases,
renewals) turns into errors that look exactly like Redis being down. :func:`redis_client` builds
the client over a ``BlockingConnectionPool`` instead: at most ``max_connections`` connections,
and a call that finds them all busy waits up to ``pool_timeout_s`` for one to come back. Only a
Redis that does not answer (refused or timed-out connections, or a pool still busy after the
wait) raises ``redis.exceptions.ConnectionError`` / ``TimeoutError``.

A pub/sub subscription holds one connection for as long as it listens, so the pool must be larger
than the number of subscriptions the process keeps (``MIN_CONNECTIONS``).

URLs are redis-py's: ``redis://[[user]:password@]host:port/db``, ``rediss://`` for TLS (with e.g.
``?ssl_ca_certs=/path/ca.pem``), ``unix://``. :func:`url_with_password` adds a password kept out of
the URL (``PDROUTER_REDIS_PASSWORD[_FILE]``, read by the CLI).
"""

from __future__ import annotations

from urllib.parse import quote, urlsplit, urlunsplit

import redis.asyncio as aioredis

from pdrouter.core.errors import ConfigError

MIN_CONNECTIONS = 4
"""The smallest pool accepted: a subscription holds one connection, calls need the others."""


def redis_client(url: str, *, max_connections: int, pool_timeout_s: float, connect_timeout_s: float = 2.0,
                 socket_timeout_s: float = 5.0) -> aioredis.Redis:
    """An asyncio client of ``url`` over a blocking pool of ``max_connections`` (nothing is dialled yet).

    Closing the client (``aclose``) closes its pool. ConfigError for a pool below ``MIN_CONNECTIONS``
    or a wait that is not positive.
    """
    if max_connections < MIN_CONNECTIONS:
        raise ConfigError(f"the Redis connection pool needs at least {MIN_CONNECTIONS} connections, "
                          f"got {max_connections}")
    if pool_timeout_s <= 0:
        raise ConfigError(f"the wait for a free Redis connection must be > 0 s, got {pool_timeout_s:g}")
    pool = aioredis.BlockingConnectionPool.from_url(
        url, max_connections=max_connections, timeout=pool_timeout_s,
        socket_connect_timeout=connect_timeout_s, socket_timeout=socket_timeout_s)
    return aioredis.Redis.from_pool(pool)


PASSWORD_ENV = "PDROUTER_REDIS_PASSWORD"
"""The Redis password, for URLs that carry none (or ``PDROUTER_REDIS_PASSWORD_FILE``: a file holding it)."""


def url_with_password(url: str, password: str | None) -> str:
    """``url`` with ``password`` as its password; ``url`` itself when there is none to add.

    ConfigError when the URL already has a different password (two sources, one of them wrong).
    """
    if not password:
        return url
    parts = urlsplit(url)
    if parts.scheme not in ("redis", "rediss"):
        raise ConfigError(f"{PASSWORD_ENV} applies to redis:// and rediss:// URLs, not {parts.scheme}://")
    if parts.password is not None:
        if parts.password != password:
            raise ConfigError(f"the Redis URL has a password and {PASSWORD_ENV} another: give one")
        return url
    user = quote(parts.username or "", safe="")
    host = parts.netloc.rpartition("@")[2]
    return urlunsplit(parts._replace(netloc=f"{user}:{quote(password, safe='')}@{host}"))
