"""What dead worker incarnations may leave behind, counted (the churn test and benchmark).

Each count must reach zero once the leases and the index's liveness deadlines have passed: the
booking entries, leases and booked blocks of dead decode incarnations, their prefix-index entries
(own sets, liveness members, slots and their bits in the block bitmaps), work still running or blocks
still allocated on the live workers, and blocks booked anywhere. ``closed_loop`` is the load the
workers die under, each request classified: a completion, a clean error, hung or broken.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass, field

import httpx

from pdrouter.core.workers import WorkerRole
from pdrouter.state.client import RedisClient
from pdrouter.state.keys import PoolKeys
from pdrouter.state.registry import WorkerRegistry

Incarnation = tuple[str, int]
"""(worker id, epoch)."""


async def booking_parts(client: RedisClient, keys: PoolKeys, dead: list[Incarnation]) -> tuple[int, int, int]:
    """(booking entries, leases, booked blocks) left on the dead decode incarnations."""
    entries = leases = blocks = 0
    for worker, epoch in dead:
        entries += int(await client.hlen(keys.kv_bookings(worker, epoch)))
        leases += int(await client.zcard(keys.kv_leases(worker, epoch)))
        blocks += int(await client.get(keys.kv_used(worker, epoch)) or 0)
    return entries, leases, blocks


async def dead_bookings(client: RedisClient, keys: PoolKeys, dead: list[Incarnation]) -> int:
    """Everything of the dead decode incarnations' bookings: entries, leases and booked blocks together."""
    return sum(await booking_parts(client, keys, dead))


async def dead_index_entries(client: RedisClient, keys: PoolKeys, dead: list[Incarnation]) -> int:
    """Entries of the dead incarnations anywhere in the prefix index: own sets, liveness members,
    slots still given to them and their bits in the block bitmaps (one Redis: SCAN of the block keys)."""
    left = sum([int(await client.scard(keys.prefix_set(w, e))) for w, e in dead])
    names = [PoolKeys.incarnation(w, e) for w, e in dead]
    live = {m.decode() if isinstance(m, bytes) else str(m) for m in await client.zrange(keys.prefix_live, 0, -1)}
    left += sum(1 for name in names if name in live)
    slots = [int(s) for s in await client.hmget(keys.prefix_slots, names) if s is not None]
    left += len(slots)
    cursor, match = 0, keys.prefix_block_prefix.encode() + b"*"
    while slots:  # one pipeline of GETBITs per page of block keys
        cursor, page = await client.scan(cursor, match=match, count=1000)
        if page:
            async with client.pipeline(transaction=False) as pipe:
                for key in page:
                    for slot in slots:
                        pipe.getbit(key, slot)
                left += sum(int(x) for x in await pipe.execute())
        if not cursor:
            break
    return left


async def count_leftovers(client: RedisClient, registry: WorkerRegistry, keys: PoolKeys, dead: list[Incarnation],
                          dead_decode: list[Incarnation]) -> dict[str, int]:
    """``leaked_bookings``, ``dead_index_entries``, ``stranded_work`` (requests running and blocks
    allocated on the live workers) and ``bookings`` (blocks booked on any decode incarnation)."""
    live = await registry.live_workers()
    incarnations = dead_decode + [(w.record.worker_id, int(w.record.epoch)) for w in live
                                  if w.record.role is WorkerRole.DECODE]
    return {"leaked_bookings": await dead_bookings(client, keys, dead_decode),
            "dead_index_entries": await dead_index_entries(client, keys, dead),
            "stranded_work": sum(w.load.running + w.load.allocated_blocks for w in live),
            "bookings": sum([int(await client.get(keys.kv_used(w, e)) or 0) for w, e in incarnations])}


@dataclass
class LoadOutcomes:
    """How the requests of ``closed_loop`` ended."""

    ok: int = 0
    failed_cleanly: int = 0
    """An HTTP error status with the API's error object."""
    hung: int = 0
    """No answer within the request bound."""
    broken: list[str] = field(default_factory=list)
    """Answers that were neither a completion nor a clean error (a dropped connection, a body that
    is not the API's error object), described."""


async def closed_loop(port: int, outcomes: LoadOutcomes, *, model: str, prompts: Sequence[str], concurrency: int,
                      until: float, bound_s: float, max_tokens: int = 32) -> None:
    """``concurrency`` slots each sending ``/v1/completions`` to the router on ``port`` one after
    another until ``until`` (loop time): a shared prompt (slot and request number pick which) and
    a unique question, every answer classified into ``outcomes``."""
    loop = asyncio.get_running_loop()
    # Idle connections go before the router's keep-alive timeout (5 s) could close one under a new
    # request (a dropped connection the client would have to retry, not the router's doing).
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency, keepalive_expiry=2.0)
    async with httpx.AsyncClient(timeout=bound_s, limits=limits) as http:
        async def slot(i: int) -> None:
            n = 0
            while loop.time() < until:
                prompt = prompts[(i + n) % len(prompts)] + f"Question {i}-{n}: why is the sky blue?"
                n += 1
                try:
                    resp = await http.post(f"http://127.0.0.1:{port}/v1/completions", json={
                        "model": model, "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True})
                except httpx.TimeoutException:
                    outcomes.hung += 1
                    continue
                except httpx.HTTPError as exc:
                    outcomes.broken.append(repr(exc))
                    continue
                body = resp.json() if resp.headers.get("content-type", "").startswith("application/json") else {}
                if resp.status_code == 200 and body.get("choices"):
                    outcomes.ok += 1
                elif resp.status_code >= 400 and "error" in body:
                    outcomes.failed_cleanly += 1
                else:
                    outcomes.broken.append(f"{resp.status_code} {resp.text[:200]}")

        await asyncio.gather(*(slot(i) for i in range(concurrency)))
