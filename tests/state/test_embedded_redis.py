"""The Redis fixture is a real server: it answers commands and can be stopped and restarted."""

from __future__ import annotations

import redis

from pdrouter.state.embedded_redis import EmbeddedRedis


def test_fixture_gives_an_empty_real_redis(redis_url: str) -> None:
    client = redis.Redis.from_url(redis_url)
    assert client.dbsize() == 0
    client.set("k", "v")
    assert client.get("k") == b"v"
    assert client.eval("return redis.call('GET', KEYS[1])", 1, "k") == b"v"
    client.close()


def test_restart_on_the_same_port_loses_data() -> None:
    with EmbeddedRedis() as server:
        client = redis.Redis.from_url(server.url)
        client.set("k", "v")
        server.stop()
        assert not server.running
        server.start()
        assert client.get("k") is None
        client.close()
    assert not server.running
