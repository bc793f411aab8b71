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

Redis Cluster: ``redis+cluster://[[user]:password@]host:port[,host:port…][?option=value…]`` (and
``rediss+cluster://`` for TLS) gives a :class:`BoundedRedisCluster`, redis-py's asyncio
``RedisCluster`` with the same bound: at most ``max_connections - PUBSUB_RESERVE`` commands (and
pipelines) in flight at once, so no node ever holds more than ``max_connections`` of this client's
connections, and a call over the bound waits up to ``pool_timeout_s``. Every ``host:port`` is a
startup node (the client learns the rest of the cluster from the first one that answers); only
database 0 exists on a cluster. The keys of one pool share one hash tag (``pdrouter/state/keys.py``),
so every script and multi-key command of the pool runs on the one shard owning its slot. The
cluster's own failures that redis-py does not report as a ``RedisError`` (no node reachable, a slot
not covered during a failover) are raised as ``redis.exceptions.ConnectionError``, as for a
standalone Redis that does not answer, so every caller's ``except RedisError`` handles them.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
from collections.abc import AsyncIterator
from typing import Any, TypeAlias
from urllib.parse import quote, urlsplit, urlunsplit

import redis.asyncio as aioredis
from redis.asyncio.cluster import ClusterNode, ClusterPipeline, RedisCluster
from redis.asyncio.connection import SSLConnection, parse_url
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisClusterException, SlotNotCoveredError

from pdrouter.core.errors import ConfigError

MIN_CONNECTIONS = 4
"""The smallest pool accepted: a subscription holds one connection, calls need the others."""

PUBSUB_RESERVE = 1
"""Connections per Redis Cluster node kept for this client's pub/sub subscriptions (the router
keeps one: the pool's ``credit-wanted`` channel); commands may use the rest."""

CLUSTER_SCHEMES = {"redis+cluster": "redis", "rediss+cluster": "rediss"}
"""URL schemes of a Redis Cluster, and the plain scheme each one's nodes speak."""

RedisClient: TypeAlias = "aioredis.Redis | RedisCluster"
"""What :func:`redis_client` returns: a standalone client or a Redis Cluster client. Both run
the scripts, single-slot multi-key commands, non-transactional pipelines and pub/sub the state
layer uses."""


def is_cluster_url(url: str) -> bool:
    """True for ``redis+cluster://`` and ``rediss+cluster://`` URLs."""
    return urlsplit(url).scheme.lower() in CLUSTER_SCHEMES


def is_cluster_client(client: object) -> bool:
    """True for a Redis Cluster client (what :func:`redis_client` gives for a cluster URL)."""
    return isinstance(client, RedisCluster)


def redis_client(url: str, *, max_connections: int, pool_timeout_s: float, connect_timeout_s: float = 2.0,
                 socket_timeout_s: float = 5.0) -> RedisClient:
    """An asyncio client of ``url`` over a blocking pool of ``max_connections`` (nothing is dialled yet).

    A ``redis+cluster://`` or ``rediss+cluster://`` URL gives a :class:`BoundedRedisCluster` (at most
    ``max_connections`` connections per node). Closing the client (``aclose``) closes its pool.
    ConfigError for a pool below ``MIN_CONNECTIONS``, a wait that is not positive, or a cluster URL
    that names no node, a database other than 0 or an option redis-py does not know.
    """
    if max_connections < MIN_CONNECTIONS:
        raise ConfigError(f"the Redis connection pool needs at least {MIN_CONNECTIONS} connections, "
                          f"got {max_connections}")
    if pool_timeout_s <= 0:
        raise ConfigError(f"the wait for a free Redis connection must be > 0 s, got {pool_timeout_s:g}")
    if is_cluster_url(url):
        return cluster_client(url, max_connections=max_connections, pool_timeout_s=pool_timeout_s,
                              connect_timeout_s=connect_timeout_s, socket_timeout_s=socket_timeout_s)
    pool = aioredis.BlockingConnectionPool.from_url(
        url, max_connections=max_connections, timeout=pool_timeout_s,
        socket_connect_timeout=connect_timeout_s, socket_timeout=socket_timeout_s)
    return aioredis.Redis.from_pool(pool)


def cluster_nodes(url: str) -> tuple[str, list[tuple[str, int]]]:
    """A cluster URL split into one plain node URL (scheme, credentials, options; first node) and
    the ``(host, port)`` of every startup node. ConfigError when it names no node or a bad port."""
    parts = urlsplit(url)
    scheme = CLUSTER_SCHEMES.get(parts.scheme.lower())
    if scheme is None:
        raise ConfigError(f"not a Redis Cluster URL (redis+cluster:// or rediss+cluster://): {parts.scheme}://")
    userinfo, at, hosts = parts.netloc.rpartition("@")
    nodes: list[tuple[str, int]] = []
    for entry in hosts.split(","):
        entry = entry.strip()
        if not entry:
            continue
        if entry.startswith("["):  # [IPv6]:port
            host, _, rest = entry[1:].partition("]")
            port_s = rest.removeprefix(":")
        else:
            host, _, port_s = entry.rpartition(":") if ":" in entry else (entry, "", "")
        try:
            port = int(port_s) if port_s else 6379
        except ValueError:
            raise ConfigError(f"bad port {port_s!r} in the Redis Cluster URL") from None
        if not host or not 0 < port < 65536:
            raise ConfigError(f"bad node {entry!r} in the Redis Cluster URL")
        nodes.append((host, port))
    if not nodes:
        raise ConfigError("the Redis Cluster URL names no node (redis+cluster://host:port[,host:port…])")
    first = f"[{nodes[0][0]}]" if ":" in nodes[0][0] else nodes[0][0]
    netloc = f"{userinfo}{at}{first}:{nodes[0][1]}"
    return urlunsplit((scheme, netloc, parts.path, parts.query, parts.fragment)), nodes


def cluster_client(url: str, *, max_connections: int, pool_timeout_s: float, connect_timeout_s: float = 2.0,
                   socket_timeout_s: float = 5.0) -> BoundedRedisCluster:
    """A :class:`BoundedRedisCluster` for a ``redis+cluster://`` URL (see :func:`redis_client`)."""
    if max_connections < MIN_CONNECTIONS:
        raise ConfigError(f"the Redis connection pool needs at least {MIN_CONNECTIONS} connections, "
                          f"got {max_connections}")
    plain, nodes = cluster_nodes(url)
    try:
        options: dict[str, Any] = dict(parse_url(plain))
    except ValueError as exc:
        raise ConfigError(f"bad Redis Cluster URL: {exc}") from None
    options.pop("host", None)
    options.pop("port", None)
    if int(options.pop("db", 0) or 0) != 0:
        raise ConfigError("a Redis Cluster has only database 0: drop the /<db> of the URL")
    if options.pop("connection_class", None) is SSLConnection:
        options["ssl"] = True
    options.setdefault("socket_connect_timeout", connect_timeout_s)
    options.setdefault("socket_timeout", socket_timeout_s)
    try:
        return BoundedRedisCluster(startup_nodes=[ClusterNode(host, port) for host, port in nodes],
                                   max_connections=max_connections, pool_timeout_s=pool_timeout_s, **options)
    except TypeError as exc:  # an option of the URL the cluster client does not take
        raise ConfigError(f"bad Redis Cluster URL option: {exc}") from None
    except RedisClusterException as exc:
        raise ConfigError(f"bad Redis Cluster URL: {exc}") from None


_GATED: contextvars.ContextVar[bool] = contextvars.ContextVar("pdrouter_redis_gated", default=False)
"""True inside a call that holds a slot of the cluster client's bound (so nested calls do not wait)."""


class BoundedRedisCluster(RedisCluster):
    """redis-py's asyncio ``RedisCluster`` whose callers wait for room instead of failing.

    redis-py's cluster nodes raise ``MaxConnectionsError`` when a node's connections are all busy;
    here at most ``max_connections - PUBSUB_RESERVE`` commands and pipelines run at once (each uses
    at most one connection per node), so no node needs more than ``max_connections`` connections,
    and a call finding no room waits up to ``pool_timeout_s`` (then ``ConnectionError``, as a busy
    standalone pool). Failures of the cluster that redis-py raises outside ``RedisError`` (no
    startup node answers, a slot not covered while a master fails over) become ``ConnectionError``.
    Pipelines are non-transactional unless asked (a cluster ``MULTI`` is confined to one slot).
    """

    def __init__(self, *, max_connections: int, pool_timeout_s: float, **kwargs: Any) -> None:
        super().__init__(max_connections=max_connections, **kwargs)
        self.max_calls = max(1, max_connections - PUBSUB_RESERVE)
        self.pool_timeout_s = pool_timeout_s
        self._calls = asyncio.Semaphore(self.max_calls)

    @contextlib.asynccontextmanager
    async def gate(self) -> AsyncIterator[None]:
        """Hold one of the ``max_calls`` slots for the duration (at once when the caller holds one)."""
        if _GATED.get():
            yield
            return
        if self._calls.locked():
            try:
                async with asyncio.timeout(self.pool_timeout_s):
                    await self._calls.acquire()
            except TimeoutError:
                raise RedisConnectionError(f"no free Redis Cluster connection within {self.pool_timeout_s:g} s "
                                           f"({self.max_calls} calls in flight)") from None
        else:
            await self._calls.acquire()
        token = _GATED.set(True)
        try:
            yield
        finally:
            _GATED.reset(token)
            self._calls.release()

    async def execute_command(self, *args: Any, **kwargs: Any) -> Any:
        async with self.gate():
            try:
                return await super().execute_command(*args, **kwargs)
            except SlotNotCoveredError as exc:
                raise _unreachable(exc) from exc
            except AttributeError as exc:
                # redis-py's cluster client, refreshing its node table after a failover, disconnects a
                # node's connections while calls are using them; such a call then fails inside the
                # library on the vanished stream ("'NoneType' object has no attribute 'writelines'")
                # instead of with a ConnectionError. It is the same outage, so it is raised as one.
                if "NoneType" not in str(exc):
                    raise
                raise RedisConnectionError(f"a Redis Cluster connection closed under a call while the "
                                           f"cluster changed: {exc}") from exc

    async def initialize(self, additional_startup_nodes_info: list[tuple[str, int]] | None = None,
                         last_failed_node_name: str | None = None) -> RedisCluster:
        try:
            return await super().initialize(additional_startup_nodes_info, last_failed_node_name)
        except RedisClusterException as exc:  # no startup node answers, or their slots do not cover all
            raise _unreachable(exc) from exc

    def pipeline(self, transaction: Any | None = None, shard_hint: Any | None = None) -> ClusterPipeline:
        if shard_hint:
            raise RedisClusterException("shard_hint is deprecated in cluster mode")
        return _BoundedPipeline(self, transaction)  # type: ignore[abstract]  # as redis-py's own


class _BoundedPipeline(ClusterPipeline):
    """A cluster pipeline whose ``execute`` holds one slot of its client's bound."""

    async def execute(self, raise_on_error: bool = True, allow_redirections: bool = True) -> list[Any]:
        client = self.cluster_client
        gate = client.gate() if isinstance(client, BoundedRedisCluster) else contextlib.nullcontext()
        async with gate:
            try:
                return await super().execute(raise_on_error, allow_redirections)
            except SlotNotCoveredError as exc:
                raise _unreachable(exc) from exc


def _unreachable(exc: RedisClusterException) -> RedisConnectionError:
    """A failure of the cluster's topology as the ConnectionError every caller handles. (Other
    ``RedisClusterException`` s, such as the keys of one command in different slots, are usage
    errors and stay what they are.)"""
    return RedisConnectionError(f"Redis Cluster unavailable: {exc}")


PASSWORD_ENV = "PDROUTER_REDIS_PASSWORD"
"""The Redis password, for URLs that carry none (or ``PDROUTER_REDIS_PASSWORD_FILE``: a file holding it)."""

PASSWORD_SCHEMES = ("redis", "rediss", *CLUSTER_SCHEMES)
"""URL schemes that take a password from ``PDROUTER_REDIS_PASSWORD``."""


def url_with_password(url: str, password: str | None) -> str:
    """``url`` with ``password`` as its password; ``url`` itself when there is none to add.

    Works for ``redis://``, ``rediss://``, ``redis+cluster://`` and ``rediss+cluster://`` (a
    cluster's password is every node's). ConfigError when the URL already has a different password
    (two sources, one of them wrong).
    """
    if not password:
        return url
    parts = urlsplit(url)
    if parts.scheme.lower() not in PASSWORD_SCHEMES:
        raise ConfigError(f"{PASSWORD_ENV} applies to redis://, rediss://, redis+cluster:// and "
                          f"rediss+cluster:// URLs, not {parts.scheme}://")
    if parts.password is not None:
        if parts.password != password:
            raise ConfigError(f"the Redis URL has a password and {PASSWORD_ENV} another: give one")
        return url
    user = quote(parts.username or "", safe="")
    host = parts.netloc.rpartition("@")[2]
    return urlunsplit(parts._replace(netloc=f"{user}:{quote(password, safe='')}@{host}"))
