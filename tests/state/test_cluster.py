"""The state layer on a real Redis Cluster (3 masters, a replica each): every script and multi-key
command runs on one shard, the keys land in the slots the layout says, callers wait for room in
the bounded client, and a master killed mid-load strands no booking."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import redis
from redis.asyncio.cluster import RedisCluster
from redis.crc import key_slot
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisError

from pdrouter.core.aio import BackgroundTasks
from pdrouter.core.errors import CapacityError, ConfigError, StaleEpochError
from pdrouter.core.ids import BlockHash, Epoch, WorkerId
from pdrouter.core.redact import redact_url
from pdrouter.core.workers import WorkerLoad, WorkerRecord, WorkerRole
from pdrouter.router.admission.signals import CreditWanted
from pdrouter.state.client import (
    BoundedRedisCluster,
    RedisClient,
    cluster_nodes,
    is_cluster_url,
    redis_client,
    url_with_password,
)
from pdrouter.state.keys import PoolKeys
from pdrouter.state.prefix_index import SCRIPT_BATCH, PrefixIndex
from pdrouter.state.registry import WorkerRegistry
from pdrouter.state.reservations import BookingId, DecodeCapacity, KvReservations
from pdrouter.testing.redis_cluster import EmbeddedRedisCluster, find_redis_cli, free_cluster_port

HASHES = [BlockHash(i.to_bytes(16, "little")) for i in range(1, 201)]


@pytest.fixture
async def client(redis_cluster_url: str) -> AsyncIterator[RedisClient]:
    c = redis_client(redis_cluster_url, max_connections=8, pool_timeout_s=2.0)
    yield c
    await c.aclose()


def record(worker_id: str, epoch: int, role: WorkerRole = WorkerRole.DECODE) -> WorkerRecord:
    return WorkerRecord(worker_id=WorkerId(worker_id), role=role, address="127.0.0.1:5000", epoch=Epoch(epoch),
                        model="tiny", model_compat_hash="m", kv_compat_hash="k", block_size=16,
                        capacity_blocks=100)


def every_key(cluster: EmbeddedRedisCluster) -> dict[bytes, int]:
    """Every key of the cluster → the port of the master holding it (a SCAN of each master)."""
    found: dict[bytes, int] = {}
    for shard in cluster.shards():
        node = redis.Redis(host="127.0.0.1", port=shard.master_port)
        try:
            for key in node.scan_iter(count=1000):
                found[key] = shard.master_port
        finally:
            node.close()
    return found


# -- URLs --------------------------------------------------------------------------------------
def test_cluster_urls_name_their_startup_nodes() -> None:
    assert is_cluster_url("redis+cluster://h:1") and is_cluster_url("rediss+cluster://h:1")
    assert not is_cluster_url("redis://h:1/0")
    plain, nodes = cluster_nodes("rediss+cluster://u:p%40ss@a:7000,b:7001,[::1]:7002?ssl_ca_certs=/ca.pem")
    assert plain == "rediss://u:p%40ss@a:7000?ssl_ca_certs=/ca.pem"
    assert nodes == [("a", 7000), ("b", 7001), ("::1", 7002)]
    client = redis_client("redis+cluster://127.0.0.1:7000,127.0.0.1:7001", max_connections=8, pool_timeout_s=1.0)
    assert isinstance(client, BoundedRedisCluster) and client.max_calls == 7
    with pytest.raises(ConfigError, match="database 0"):
        redis_client("redis+cluster://h:7000/2", max_connections=8, pool_timeout_s=1.0)
    with pytest.raises(ConfigError, match="names no node"):
        redis_client("redis+cluster://", max_connections=8, pool_timeout_s=1.0)
    with pytest.raises(ConfigError, match="bad port"):
        redis_client("redis+cluster://h:port", max_connections=8, pool_timeout_s=1.0)
    with pytest.raises(ConfigError, match="at least 4"):
        redis_client("redis+cluster://h:7000", max_connections=2, pool_timeout_s=1.0)
    with pytest.raises(ConfigError, match="bad Redis Cluster URL"):
        redis_client("redis+cluster://h:7000?socket_timeout=soon", max_connections=8, pool_timeout_s=1.0)
    with pytest.raises(ConfigError, match="option"):
        redis_client("redis+cluster://h:7000?no_such_option=1", max_connections=8, pool_timeout_s=1.0)


def test_cluster_urls_take_the_password_and_hide_it() -> None:
    assert url_with_password("redis+cluster://a:1,b:2", "s3/cret") == "redis+cluster://:s3%2Fcret@a:1,b:2"
    assert url_with_password("rediss+cluster://ops@a:1", "pw") == "rediss+cluster://ops:pw@a:1"
    with pytest.raises(ConfigError, match="give one"):
        url_with_password("redis+cluster://:one@a:1", "two")
    assert redact_url("redis+cluster://ops:pw@a:1,b:2?password=x") == "redis+cluster://ops:***@a:1,b:2?password=***"


def test_a_missing_redis_cli_is_a_config_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    server = tmp_path / "redis-server"
    server.write_text("")
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    with pytest.raises(ConfigError, match="no redis-cli"):
        find_redis_cli(str(server))
    (tmp_path / "redis-cli").write_text("")
    assert find_redis_cli(str(server)) == str(tmp_path / "redis-cli")
    with pytest.raises(ConfigError, match="at least 3 masters"):
        EmbeddedRedisCluster(masters=2)


async def test_an_unreachable_cluster_is_a_connection_error() -> None:
    port = free_cluster_port()
    client = redis_client(f"redis+cluster://127.0.0.1:{port}", max_connections=4, pool_timeout_s=1.0,
                          connect_timeout_s=0.5)
    with pytest.raises(RedisConnectionError, match="Redis Cluster unavailable"):
        await client.ping()
    await client.aclose()


# -- the state classes on the cluster ----------------------------------------------------------
async def test_registry_register_heartbeat_list(client: RedisClient) -> None:
    registry = WorkerRegistry(client, "tiny", heartbeat_ttl_ms=300)
    e1, e2 = await registry.new_epoch(), await registry.new_epoch()
    assert e2 > e1
    await registry.register(record("decode-0", e1))
    await registry.register(record("prefill-0", e2, WorkerRole.PREFILL))
    await registry.heartbeat(WorkerId("decode-0"), e1, WorkerLoad(running=3, free_blocks=90, total_blocks=100))
    live = await registry.live_workers(WorkerRole.DECODE)
    assert [(w.record.worker_id, w.load.running) for w in live] == [("decode-0", 3)]
    assert len(await registry.live_workers()) == 2
    with pytest.raises(StaleEpochError):
        await registry.heartbeat(WorkerId("decode-0"), Epoch(e1 - 1), WorkerLoad())
    assert await registry.deregister(WorkerId("prefill-0"), e2)
    await asyncio.sleep(0.35)  # decode-0's heartbeat lapses
    assert await registry.live_workers() == []


async def test_prefix_index_publish_lookup_evict_sweep(client: RedisClient) -> None:
    index = PrefixIndex(client, "tiny", ttl_ms=1000)
    w1, w2 = (WorkerId("p1"), Epoch(1)), (WorkerId("p2"), Epoch(2))
    assert not await index.apply(*w1, [(True, HASHES)])  # more than SCRIPT_BATCH: a pipeline of scripts
    assert len(HASHES) > SCRIPT_BATCH and await index.size(*w1) == len(HASHES)
    await index.add(*w2, HASHES[:20])
    matches = await index.lookup(HASHES[:50], [w1, w2])
    assert [(m.worker_id, m.blocks) for m in matches] == [("p1", 50), ("p2", 20)]
    await index.remove(*w1, HASHES[10:])  # evicted: the tail goes first
    assert await index.matched_blocks(HASHES[:50], [w1, w2]) == {"p1": 10, "p2": 20}
    while True:  # p2 keeps refreshing, p1 stops and lapses
        assert await index.touch(*w2)
        await asyncio.sleep(0.1)
        if await index.sweep() > 0:
            break
    assert await index.size(*w1) == 0 and await index.size(*w2) == 20
    assert await index.clear(*w2) == 20
    assert [m.blocks for m in await index.lookup(HASHES[:5], [w1, w2])] == [0, 0]


async def test_reservations_book_renew_release(client: RedisClient) -> None:
    res = KvReservations(client, "tiny", resize_delay_s=0.0)
    d0, d1 = DecodeCapacity(WorkerId("d0"), Epoch(1), 100), DecodeCapacity(WorkerId("d1"), Epoch(1), 60)
    first = await res.reserve(BookingId("a"), 30, [d0, d1], lease_ms=10_000)
    second = await res.reserve(BookingId("b"), 50, [d0, d1], lease_ms=10_000)
    assert (first.worker_id, second.worker_id) == ("d0", "d0")  # 70 free, then 20 free beside d1's 60
    with pytest.raises(CapacityError, match="most free: 60"):
        await res.reserve(BookingId("c"), 61, [d0, d1], lease_ms=10_000)
    assert await res.renew(first, lease_ms=150)
    assert await res.release(second) == 50
    assert await res.release(second) == 0
    await asyncio.sleep(0.2)  # first's shortened lease runs out: the next call on d0 drops it
    assert (await res.used("d0", 1), await res.used("d1", 1)) == (0, 0)
    assert not await res.renew(first)
    assert await res.bookings("d0", 1) == {}


async def test_credit_wanted_crosses_the_cluster(redis_cluster_url: str) -> None:
    """Two routers on two clients: one asks for room, the other hears it (and not itself)."""
    a_client = redis_client(redis_cluster_url, max_connections=4, pool_timeout_s=2.0)
    b_client = redis_client(redis_cluster_url, max_connections=4, pool_timeout_s=2.0)
    channel = PoolKeys("pdr", "tiny").credit_wanted
    tasks = BackgroundTasks()
    heard: list[str] = []
    a = CreditWanted(a_client, channel, "router-a", enabled=True, ask_every_s=0.0, tasks=tasks,
                     on_wanted=lambda: heard.append("a"))
    b = CreditWanted(b_client, channel, "router-b", enabled=True, ask_every_s=0.0, tasks=tasks,
                     on_wanted=lambda: heard.append("b"))
    a.start()
    b.start()
    try:
        deadline = time.monotonic() + 10
        while "a" not in heard and time.monotonic() < deadline:
            b.ask()
            await asyncio.sleep(0.05)
        assert "a" in heard and "b" not in heard
    finally:
        await a.stop()
        await b.stop()
        await tasks.wait()
        await a_client.aclose()
        await b_client.aclose()


async def test_keys_of_a_pool_land_in_their_two_slots(client: RedisClient,
                                                      redis_cluster: EmbeddedRedisCluster) -> None:
    """Registry, prefix index and channel under ``{pool}``; bookings under ``{pool#kv}``; nothing else."""
    pool = "tiny"
    registry = WorkerRegistry(client, pool)
    await registry.register(record("decode-0", await registry.new_epoch()))
    index = PrefixIndex(client, pool)
    await index.add(WorkerId("p1"), 1, HASHES[:70])
    res = KvReservations(client, pool)
    assert res.keys.bookings_apart and not KvReservations(client, pool, bookings_apart=False).keys.bookings_apart
    await res.reserve(BookingId("a"), 5, [DecodeCapacity(WorkerId("decode-0"), Epoch(1), 100)], lease_ms=10_000)
    keys = PoolKeys("pdr", pool, bookings_apart=True)
    pool_slot, bookings_slot = key_slot(pool.encode()), key_slot(f"{pool}#kv".encode())
    assert keys.kv_used("decode-0", 1) == "pdr:{tiny#kv}:kv:used:decode-0:1"
    assert key_slot(keys.workers.encode()) == key_slot(keys.credit_wanted.encode()) == pool_slot
    assert key_slot(keys.prefix_block(HASHES[0])) == key_slot(keys.prefix_live.encode()) == pool_slot
    assert key_slot(keys.prefix_slots.encode()) == key_slot(keys.prefix_free.encode()) == pool_slot
    found = every_key(redis_cluster)
    # workers, hb, epoch; pxlive, pxslots, px own set, 70 blocks; 3 booking keys
    assert len(found) == 3 + 1 + 1 + 1 + 70 + 3
    owners = {s.master_port: s for s in redis_cluster.shards()}
    for key, port in found.items():
        slot = key_slot(key)
        expected = bookings_slot if b":kv:" in key else pool_slot
        assert slot == expected, key
        assert owners[port].owns(slot)


async def test_the_client_waits_for_room_and_bounds_connections(redis_cluster_url: str) -> None:
    client = redis_client(redis_cluster_url, max_connections=4, pool_timeout_s=10.0)
    assert isinstance(client, BoundedRedisCluster)
    try:
        index = PrefixIndex(client, "tiny")
        await index.add(WorkerId("p1"), 1, HASHES[:100])
        # 200 concurrent calls (lookups and pipelined writes) through 3 slots: they all get through.
        lookups = [index.lookup(HASHES[:100], [(WorkerId("p1"), Epoch(1))]) for _ in range(150)]
        writes = [index.add(WorkerId(f"p{i}"), 1, HASHES[:100]) for i in range(2, 52)]
        results, _ = await asyncio.gather(asyncio.gather(*lookups), asyncio.gather(*writes))
        assert all(r[0].blocks == 100 for r in results)
        assert all(len(node._connections) <= 4 for node in client.get_nodes())
        release, holding = asyncio.Event(), list[int]()

        async def hold() -> None:  # a call in flight until released
            async with client.gate():
                holding.append(1)
                await release.wait()

        holders = [asyncio.create_task(hold()) for _ in range(client.max_calls)]
        while len(holding) < client.max_calls:
            await asyncio.sleep(0.01)
        client.pool_timeout_s = 0.2
        started = time.monotonic()  # every slot taken: the next call waits, then fails
        with pytest.raises(RedisConnectionError, match="no free Redis Cluster connection"):
            await client.ping()
        assert time.monotonic() - started >= 0.19
        async def ping() -> bool:
            return bool(await client.ping())

        client.pool_timeout_s = 10.0
        waiting = asyncio.create_task(ping())  # one that finds room within the wait gets through
        await asyncio.sleep(0.05)
        release.set()
        assert await waiting
        await asyncio.gather(*holders)
    finally:
        await client.aclose()


# -- failover ----------------------------------------------------------------------------------
def pool_on_one_master(cluster: EmbeddedRedisCluster) -> str:
    """A pool name whose two hash tags (``{pool}``, ``{pool#kv}``) both live on one master."""
    for i in range(1000):
        name = f"failover-{i}"
        keys = PoolKeys("pdr", name, bookings_apart=True)
        if cluster.master_index_of(keys.workers) == cluster.master_index_of(keys.kv_used("d", 1)):
            return name
    raise AssertionError("no pool name found")


async def test_failover_mid_load_strands_no_booking(redis_cluster_url: str,
                                                    redis_cluster: EmbeddedRedisCluster) -> None:
    """Bookings and releases go on while the master holding them is killed -9: calls fail with
    Redis errors (which the router reports as unavailable), or wait it out inside the cluster
    client's own retries, until the replica takes over, then
    succeed again; once the leases ran out no booking is left anywhere, and the credit-wanted
    listener is subscribed again."""
    lease_ms = 1500
    pool = pool_on_one_master(redis_cluster)
    client = redis_client(redis_cluster_url, max_connections=16, pool_timeout_s=2.0)
    other = redis_client(redis_cluster_url, max_connections=4, pool_timeout_s=2.0)
    res = KvReservations(client, pool, resize_delay_s=0.0)
    decodes = [DecodeCapacity(WorkerId(f"d{i}"), Epoch(1), 1000) for i in range(2)]
    tasks = BackgroundTasks()
    heard: list[float] = []
    asker = CreditWanted(client, res.keys.credit_wanted, "a", enabled=True, ask_every_s=0.0, tasks=tasks,
                         on_wanted=lambda: None)
    listener = CreditWanted(other, res.keys.credit_wanted, "b", enabled=True, ask_every_s=0.0, tasks=tasks,
                            on_wanted=lambda: heard.append(time.monotonic()))
    listener.start()
    stop = asyncio.Event()
    done = {"before": 0, "after": 0}
    failures: list[BaseException] = []
    promoted_at = [float("inf")]
    longest = [0.0]  # the longest successful book-and-release: one that rode out the failover in retries

    async def book_and_release(i: int) -> None:
        n = 0
        while not stop.is_set():
            n += 1
            began = time.monotonic()
            try:
                booking = await res.reserve(BookingId(f"{i}-{n}"), 3, decodes, lease_ms)
                await asyncio.sleep(0.005)
                await res.release(booking)
                longest[0] = max(longest[0], time.monotonic() - began)
                done["after" if time.monotonic() > promoted_at[0] else "before"] += 1
            except (RedisError, OSError) as exc:
                failures.append(exc)
                await asyncio.sleep(0.05)

    async def ask() -> None:
        while not stop.is_set():
            asker.ask()
            await asyncio.sleep(0.05)

    loops = [asyncio.create_task(book_and_release(i)) for i in range(6)] + [asyncio.create_task(ask())]
    try:
        deadline = time.monotonic() + 10
        while (done["before"] < 20 or not heard) and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        assert done["before"] >= 20 and heard
        port = await asyncio.to_thread(redis_cluster.kill_master, redis_cluster.master_index_of(res.keys.workers))
        await asyncio.to_thread(redis_cluster.wait_promoted, port)
        promoted_at[0] = time.monotonic()
        deadline = promoted_at[0] + 15
        while (done["after"] < 20 or not heard or heard[-1] < promoted_at[0]) and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
        assert done["after"] >= 20, (done, failures[-3:])
        assert heard[-1] > promoted_at[0]  # the listener subscribed again on the new master
    finally:
        stop.set()
        await asyncio.gather(*loops)
        await res.flush()
        await listener.stop()
        await tasks.wait()
    # The master was down for at least the cluster's failure-detection time: the load saw it, as
    # errors or as calls the client held in its retries for a good part of that time.
    assert failures or longest[0] >= redis_cluster.node_timeout_ms / 2000, ("the outage was not noticed", longest)
    assert all(isinstance(e, (RedisError, OSError)) for e in failures)
    await asyncio.sleep(lease_ms / 1000 + 0.2)  # bookings whose release was lost expire
    assert [await res.used(d.worker_id, d.epoch) for d in decodes] == [0, 0]  # as any router's next booking
    stranded = 0
    for key, port in every_key(redis_cluster).items():
        node = redis.Redis(host="127.0.0.1", port=port)
        try:
            if b":kv:used:" in key:
                stranded += int(node.get(key) or 0)
            elif b":kv:book:" in key:
                stranded += int(node.hlen(key))
        finally:
            node.close()
    assert stranded == 0
    await client.aclose()
    await other.aclose()
    await asyncio.to_thread(redis_cluster.revive)


async def test_a_planned_failover_switches_master_and_replica(client: RedisClient,
                                                             redis_cluster: EmbeddedRedisCluster) -> None:
    res = KvReservations(client, "tiny", resize_delay_s=0.0)
    d0 = DecodeCapacity(WorkerId("d0"), Epoch(1), 100)
    booking = await res.reserve(BookingId("a"), 10, [d0], lease_ms=10_000)
    index = redis_cluster.master_index_of(res.keys.kv_used("d0", 1))
    before = redis_cluster.shards()[index]
    new_master = await asyncio.to_thread(redis_cluster.failover, index, kill=False)
    assert new_master == before.replica_ports[0]
    assert await res.used("d0", 1) == 10  # nothing lost: the replica was in sync
    assert await res.release(booking) == 10
    await asyncio.to_thread(redis_cluster.wait_healthy)
    assert redis_cluster.shards()[index].replica_ports == (before.master_port,)


async def test_cluster_client_types() -> None:
    """The cluster client is redis-py's RedisCluster: every state class takes it."""
    client = redis_client("redis+cluster://127.0.0.1:7000", max_connections=4, pool_timeout_s=1.0)
    assert isinstance(client, RedisCluster)
    assert KvReservations(client, "tiny").keys.bookings_tag == "pdr:{tiny#kv}"
    assert WorkerRegistry(client, "tiny").keys.tag == PrefixIndex(client, "tiny").keys.tag == "pdr:{tiny}"
    await client.aclose()
