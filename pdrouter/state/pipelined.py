"""One Redis connection that carries many concurrent calls: the router's hot-path commands.

redis-py's asyncio client takes a connection from its pool for every call and gives it back after
the reply, through locks, retries and several layers of Python: under load that costs the router
more CPU than the command costs Redis. :class:`PipelinedRedis` keeps one connection of its own and
pipelines on it (RESP answers in order): ``call(*args)`` writes the command at once and returns a
future of its reply, the commands issued during one event-loop iteration leave in one ``send``, and
the replies are parsed by hiredis as they arrive. A caller may issue a command early and await its
reply later (the prefix lookup runs so while admission books): no task is needed for that.

What it keeps of the client it is made from (:meth:`PipelinedRedis.of`): the address (TCP or a Unix
socket), the user and password (``AUTH`` first on every connection) and the database (``SELECT``).
It makes none for a Redis Cluster client or a TLS connection (``of`` answers None: those callers
keep the client's own path), nor without hiredis.

Failures read as the client's: a lost or refused connection fails every call waiting on it with
``redis.exceptions.ConnectionError`` (the next call connects again); a call unanswered for the
client's socket timeout fails with ``TimeoutError`` and drops the connection (its later replies
could no longer be matched); an error reply raises ``ResponseError`` (``NoScriptError`` for
``NOSCRIPT``, ``AuthenticationError`` for a refused ``AUTH``). A caller that stops waiting leaves
its reply to be read and dropped: the calls after it still get their own.
"""

from __future__ import annotations

import asyncio
import collections
import time
from collections.abc import Sequence
from typing import Any

import hiredis
from redis.exceptions import AuthenticationError, NoScriptError, ResponseError
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from pdrouter.core.aio import BackgroundTasks
from pdrouter.state.client import RedisClient, is_cluster_client


def encode(args: Sequence[Any]) -> bytes:
    """A command as RESP: an array of bulk strings (str as UTF-8, int and float as their digits)."""
    parts = [b"*%d\r\n" % len(args)]
    for arg in args:
        if isinstance(arg, bytes):
            data = arg
        elif isinstance(arg, str):
            data = arg.encode()
        elif isinstance(arg, (int, float)) and not isinstance(arg, bool):
            data = repr(arg).encode()
        else:
            raise TypeError(f"a Redis argument must be bytes, str, int or float, not {type(arg).__name__}")
        parts.append(b"$%d\r\n" % len(data))
        parts.append(data)
        parts.append(b"\r\n")
    return b"".join(parts)


class Framed:
    """A command sent often with one argument that changes: its other arguments encoded once.

    ``Framed(args, at)`` keeps ``args`` (``args[at]`` a placeholder); ``with_arg(value)`` is
    ``encode`` of ``args`` with ``value`` at ``at``, a join of four pieces instead of a pass over every
    argument."""

    __slots__ = ("_after", "_before")

    def __init__(self, args: Sequence[Any], at: int) -> None:
        # ``encode`` of a slice, less its array header: the slice's bulk strings.
        self._before = b"*%d\r\n" % len(args) + encode(args[:at]).partition(b"\r\n")[2]
        self._after = encode(args[at + 1:]).partition(b"\r\n")[2]

    def with_arg(self, value: bytes) -> bytes:
        return b"".join((self._before, b"$%d\r\n" % len(value), value, b"\r\n", self._after))


def _error(reply: ResponseError) -> Exception:
    message = str(reply)
    if message.startswith("NOSCRIPT"):
        return NoScriptError(message)
    if message.startswith(("WRONGPASS", "NOAUTH", "NOPERM")):
        return AuthenticationError(message)
    return reply


class _Connection(asyncio.Protocol):
    """One connection: futures of the calls sent, answered in order."""

    def __init__(self, owner: PipelinedRedis) -> None:
        self.owner = owner
        self.loop = asyncio.get_running_loop()
        self.transport: asyncio.Transport | None = None
        self.reader = hiredis.Reader(replyError=ResponseError)
        self.waiting: collections.deque[tuple[asyncio.Future[Any], float]] = collections.deque()
        self.out: list[bytes] = []
        self.lost: Exception | None = None
        self.watch: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]  # a stream transport

    def send(self, command: bytes) -> asyncio.Future[Any]:
        fut = self.loop.create_future()
        if self.lost is not None:
            fut.set_exception(RedisConnectionError(str(self.lost)))
            return fut
        if not self.out:
            self.loop.call_soon(self._flush)
        self.out.append(command)
        self.waiting.append((fut, time.monotonic()))
        if self.watch is None:
            self.watch = self.loop.call_later(self.owner.timeout_s, self._check)
        return fut

    def _flush(self) -> None:
        out, self.out = self.out, []
        if out and self.transport is not None and self.lost is None:
            self.transport.write(out[0] if len(out) == 1 else b"".join(out))

    def data_received(self, data: bytes) -> None:
        reader, waiting = self.reader, self.waiting
        reader.feed(data)
        while True:
            try:
                reply = reader.gets()
            except hiredis.ProtocolError as exc:
                self._drop(RedisConnectionError(f"Redis sent what is not RESP: {exc}"))
                return
            if reply is False:
                return
            if not waiting:
                self._drop(RedisConnectionError("Redis sent a reply to no call"))
                return
            fut, _ = waiting.popleft()
            if fut.done():
                continue
            if isinstance(reply, ResponseError):
                fut.set_exception(_error(reply))
            else:
                fut.set_result(reply)

    def _check(self) -> None:
        """Every ``timeout_s`` while calls wait: the oldest unanswered too long drops the connection."""
        self.watch = None
        if not self.waiting or self.lost is not None:
            return
        timeout = self.owner.timeout_s
        age = time.monotonic() - self.waiting[0][1]
        if age >= timeout:
            self._drop(RedisTimeoutError(f"Redis did not answer within {timeout:g} s"))
            return
        self.watch = self.loop.call_later(timeout - age, self._check)

    def _drop(self, exc: Exception) -> None:
        if self.lost is None:
            self.lost = exc
        if self.watch is not None:
            self.watch.cancel()
            self.watch = None
        waiting, self.waiting = self.waiting, collections.deque()
        for fut, _ in waiting:
            if not fut.done():
                fut.set_exception(exc)
        if self.transport is not None:
            self.transport.abort()
        if self.owner._conn is self:
            self.owner._conn = None

    def connection_lost(self, exc: Exception | None) -> None:
        self._drop(RedisConnectionError(f"lost the Redis connection{f': {exc}' if exc else ''}"))


class PipelinedRedis:
    """One pipelined connection to the Redis of a client (see the module docstring)."""

    def __init__(self, host: str, port: int, path: str | None, username: str | None, password: str | None,
                 db: int, connect_timeout_s: float, timeout_s: float) -> None:
        self.host, self.port, self.path = host, port, path
        self.username, self.password, self.db = username, password, db
        self.connect_timeout_s = connect_timeout_s
        self.timeout_s = timeout_s
        self._conn: _Connection | None = None
        self._connecting: asyncio.Future[_Connection] | None = None
        self._tasks = BackgroundTasks()
        self._closed = False

    @classmethod
    def of(cls, client: RedisClient) -> PipelinedRedis | None:
        """A pipelined connection to ``client``'s Redis, or None where it cannot stand in for the client
        (a cluster, TLS, credentials from a provider, RESP3)."""
        if is_cluster_client(client):
            return None
        pool = getattr(client, "connection_pool", None)
        kwargs = getattr(pool, "connection_kwargs", None)
        kind = getattr(getattr(pool, "connection_class", None), "__name__", "")
        if not isinstance(kwargs, dict) or kind not in ("Connection", "UnixDomainSocketConnection") \
                or kwargs.get("credential_provider") is not None or kwargs.get("protocol") not in (None, 2, "2"):
            return None
        return cls(str(kwargs.get("host") or "localhost"), int(kwargs.get("port", 6379)), kwargs.get("path"),
                   kwargs.get("username"), kwargs.get("password"), int(kwargs.get("db") or 0),
                   float(kwargs.get("socket_connect_timeout") or 2.0), float(kwargs.get("socket_timeout") or 5.0))

    def call(self, *args: Any) -> asyncio.Future[Any]:
        """Send a command (now when connected, else once connected); the future of its reply."""
        return self.send(encode(args))

    def send(self, command: bytes) -> asyncio.Future[Any]:
        """``call`` of a command already encoded (``encode``, ``Framed``)."""
        conn = self._conn
        if conn is not None:
            return conn.send(command)
        fut: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._tasks.spawn(self._call_connected(command, fut))
        return fut

    async def evalsha(self, script: Any, keys: Sequence[Any], args: Sequence[Any]) -> Any:
        """Run a registered script (redis-py's ``Script``: its ``sha`` and ``script``) by its hash,
        loading it first when Redis does not have it (a Redis restarted since)."""
        try:
            return await self.call("EVALSHA", script.sha, len(keys), *keys, *args)
        except NoScriptError:
            await self.load(script)
            return await self.call("EVALSHA", script.sha, len(keys), *keys, *args)

    async def evalsha_all(self, script: Any, num_keys: int, calls: Sequence[Sequence[Any]]) -> list[Any]:
        """``evalsha`` once per argument list (its keys first), written at once and in order, their
        replies in order. When Redis had lost the script, it is loaded and every call sent again:
        for idempotent calls only (a partly applied batch is applied again)."""
        for attempt in (1, 2):
            replies = await asyncio.gather(*[self.call("EVALSHA", script.sha, num_keys, *args) for args in calls],
                                           return_exceptions=True)
            failed = [r for r in replies if isinstance(r, BaseException)]
            if not failed:
                return replies
            others = [r for r in failed if not isinstance(r, NoScriptError)]
            if others or attempt == 2:
                raise (others or failed)[0]
            await self.load(script)
        raise AssertionError("unreachable")

    async def load(self, script: Any) -> None:
        """``SCRIPT LOAD`` a registered script (after a ``NOSCRIPT`` reply to its hash)."""
        sha = await self.call("SCRIPT", "LOAD", script.script)
        script.sha = sha.decode() if isinstance(sha, bytes) else sha

    async def _call_connected(self, command: bytes, fut: asyncio.Future[Any]) -> None:
        try:
            conn = await self.connection()
        except Exception as exc:
            if not fut.done():
                fut.set_exception(exc)
            return
        if fut.done():
            return
        sent = conn.send(command)
        sent.add_done_callback(lambda done: _chain(done, fut))

    async def connection(self) -> _Connection:
        conn = self._conn
        if conn is not None:
            return conn
        if self._closed:
            raise RedisConnectionError("the pipelined Redis connection was closed")
        if self._connecting is None or self._connecting.done():  # one attempt at a time, shared by its callers
            self._connecting = asyncio.ensure_future(self._connect())
        return await asyncio.shield(self._connecting)

    async def _connect(self) -> _Connection:
        loop = asyncio.get_running_loop()
        conn: _Connection | None = None
        try:
            async with asyncio.timeout(self.connect_timeout_s):
                if self.path is not None:
                    _, conn = await loop.create_unix_connection(lambda: _Connection(self), self.path)
                else:
                    _, conn = await loop.create_connection(lambda: _Connection(self), self.host, self.port)
            setup = []
            if self.password is not None:
                setup.append(conn.send(encode(("AUTH", self.username, self.password) if self.username
                                              else ("AUTH", self.password))))
            if self.db:
                setup.append(conn.send(encode(("SELECT", self.db))))
            for fut in setup:
                await fut
        except BaseException as exc:
            if conn is not None:
                conn._drop(RedisConnectionError("connection set-up failed"))
            if isinstance(exc, (OSError, TimeoutError)) and not isinstance(exc, RedisConnectionError):
                where = self.path or f"{self.host}:{self.port}"
                raise RedisConnectionError(f"cannot connect to Redis at {where}: "
                                           f"{exc or f'timed out after {self.connect_timeout_s:g} s'}") from None
            raise
        if self._closed:
            conn._drop(RedisConnectionError("the pipelined Redis connection was closed"))
            raise RedisConnectionError("the pipelined Redis connection was closed")
        self._conn = conn
        return conn

    async def aclose(self) -> None:
        """Close the connection; calls still waiting fail with ConnectionError."""
        self._closed = True
        if self._connecting is not None and not self._connecting.done():
            self._connecting.cancel()
        await self._tasks.cancel_all()
        conn, self._conn = self._conn, None
        if conn is not None:
            conn._drop(RedisConnectionError("the pipelined Redis connection was closed"))


def _chain(done: asyncio.Future[Any], fut: asyncio.Future[Any]) -> None:
    if fut.done():
        return
    if done.cancelled():
        fut.cancel()
    elif done.exception() is not None:
        fut.set_exception(done.exception())  # type: ignore[arg-type]
    else:
        fut.set_result(done.result())
