"""The pool's ``credit-wanted`` channel: routers tell each other that a request waits for room.

A request that waits tells the other routers (a Redis pub/sub message, repeated while it waits):
they give back their unused credit at once and book no more for a while, so one router's spare
credit does not hold another's requests back.

On a Redis Cluster this is classic pub/sub (``PUBLISH`` / ``SUBSCRIBE``): a cluster forwards every
``PUBLISH`` to every node over its bus, so a subscriber on any node hears every router. The
subscription is opened on the master owning the channel's slot (the pool's hash tag: the shard
that holds the pool's keys). Before each subscription the listener makes one keyed call through
the client: a cluster client learns the slots on its first call, and refreshes them when the
channel's master failed over (the subscription broke, the old master is gone), so it subscribes
on the slot's current owner. Sharded pub/sub (``SSUBSCRIBE`` / ``SPUBLISH``, Redis 7+) would keep
the messages on the pool's shard; it is not used because Redis 6.2 (the bundled server) lacks it,
and the messages are rare (at most one per ``ask_every_s`` per router with a request waiting), so
the broadcast costs the other shards next to nothing.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable

from pdrouter.core.aio import BackgroundTasks, cancel_and_wait
from pdrouter.state.client import RedisClient

log = logging.getLogger(__name__)


class CreditWanted:
    """Publishing "a request waits" on ``channel`` and acting on the other routers' messages.

    ``ask`` publishes this router's ``sender`` tag, at most once every ``ask_every_s`` (in a task
    of ``tasks``; a failed publish is logged at DEBUG and dropped). Once ``start`` ran, every
    message from another sender counts in ``heard`` and calls ``on_wanted``; messages carrying
    this router's own tag are ignored. When Redis drops the subscription it subscribes again a
    second later. With ``enabled`` false (no credit) nothing is published and nothing listened to.
    """

    def __init__(self, client: RedisClient, channel: str, sender: str, *, enabled: bool, ask_every_s: float,
                 tasks: BackgroundTasks, on_wanted: Callable[[], None]) -> None:
        self.client = client
        self.channel = channel
        self.sender = sender
        self.enabled = enabled
        self.ask_every_s = ask_every_s
        self._tasks = tasks
        self._on_wanted = on_wanted
        self._asked_at = 0.0  # when this router last asked the others for room
        self._listener: asyncio.Task[None] | None = None
        self.heard = 0
        """Times another router asked for room (and ``on_wanted`` ran)."""

    def start(self) -> None:
        if self.enabled:
            self._listener = asyncio.create_task(self._listen(), name="admission-credit-wanted")

    async def stop(self) -> None:
        await cancel_and_wait(self._listener)

    def ask(self) -> None:
        """Tell the other routers a request waits (at most every ``ask_every_s``)."""
        now = time.monotonic()
        if not self.enabled or now - self._asked_at < self.ask_every_s:
            return
        self._asked_at = now
        self._tasks.spawn(self._publish())

    async def _publish(self) -> None:
        try:
            await self.client.publish(self.channel, self.sender)
        except Exception as exc:  # Redis trouble: the others' credit still goes back when idle
            log.debug("could not ask the other routers for room: %s", exc)

    async def _listen(self) -> None:
        """Call ``on_wanted`` whenever another router has a request waiting for room."""
        while True:
            await self._reroute()
            pubsub = self.client.pubsub(ignore_subscribe_messages=True)
            try:
                await pubsub.subscribe(self.channel)
                async for message in pubsub.listen():
                    data = message.get("data")
                    if message.get("type") != "message" or data in (self.sender, self.sender.encode()):
                        continue  # our own request
                    self.heard += 1
                    self._on_wanted()
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # Redis gone: credit still goes back when idle; listen again soon
                log.debug("credit-wanted channel: %s", exc)
            finally:
                with contextlib.suppress(Exception):
                    await pubsub.aclose()
            await asyncio.sleep(1.0)

    async def _reroute(self) -> None:
        """One keyed call through the client before each subscription: a cluster client learns the
        slots on its first call, and one whose view is stale (the channel's master failed over)
        refreshes it on the way, so the subscription goes to the slot's current owner. Failures
        are left to the subscription that follows."""
        with contextlib.suppress(Exception):
            await self.client.exists(self.channel)
