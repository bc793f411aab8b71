"""KV links: the transfer time, the presets, and FIFO queueing on a shared link."""

from __future__ import annotations

import threading

import pytest

from pdrouter.core.errors import ConfigError
from pdrouter.engine.sim.link import LINK_PRESETS, LinkSpec, SharedLink, get_link_preset


def test_transfer_time_is_latency_plus_bytes_over_bandwidth() -> None:
    link = LinkSpec("test", 1e9, 1e-3)
    assert link.transfer_s(0) == 1e-3
    assert link.transfer_s(500_000_000) == pytest.approx(0.501, rel=1e-15)
    with pytest.raises(ValueError):
        link.transfer_s(-1)


def test_presets() -> None:
    assert {name: link.bandwidth_bytes_per_s for name, link in LINK_PRESETS.items()} == {
        "nvlink": 450e9, "rdma-400g": 50e9, "tcp-100g": 12.5e9, "tcp-25g": 3.125e9}
    assert all(link.latency_s > 0 for link in LINK_PRESETS.values())
    assert get_link_preset("RDMA_400G") is LINK_PRESETS["rdma-400g"]
    # A 4k-token Llama-3-70B prompt (1.25 GiB of KV) over 400 Gb/s: about 27 ms.
    assert get_link_preset("rdma-400g").transfer_s(1_342_177_280) == pytest.approx(0.02685, rel=1e-3)
    with pytest.raises(ConfigError, match="nvlink, rdma-400g, tcp-100g, tcp-25g"):
        get_link_preset("infiniband")


def test_bad_specs_are_refused() -> None:
    with pytest.raises(ConfigError):
        LinkSpec("x", 0.0, 0.0)
    with pytest.raises(ConfigError):
        LinkSpec("x", 1e9, -1e-6)


def test_a_shared_link_queues_transfers_first_in_first_out() -> None:
    link = SharedLink(LinkSpec("test", 1e9, 1e-3), shared=True)
    assert link.reserve(1_000_000_000, now=0.0) == pytest.approx(1.001, rel=1e-15)
    assert link.busy_until == pytest.approx(1.0, rel=1e-15)
    # Ready at 0.5 s, but the wire is busy until 1.0 s: 0.5 s of bytes, then the latency.
    assert link.reserve(500_000_000, now=0.5) == pytest.approx(1.501, rel=1e-15)
    # Ready after the wire went idle: starts at once.
    assert link.reserve(100_000_000, now=2.0) == pytest.approx(2.101, rel=1e-15)
    # Back-to-back transfers pipeline: the latency does not hold the wire.
    assert link.reserve(0, now=2.0) == pytest.approx(2.101, rel=1e-15)


def test_an_unshared_link_gives_every_transfer_the_whole_bandwidth() -> None:
    link = SharedLink(LinkSpec("test", 1e9, 1e-3), shared=False)
    for _ in range(3):
        assert link.reserve(1_000_000_000, now=5.0) == pytest.approx(6.001, rel=1e-15)


def test_concurrent_reservations_lose_no_bytes() -> None:
    spec = LinkSpec("test", 1e6, 0.0)
    link = SharedLink(spec, shared=True)
    done: list[float] = []
    lock = threading.Lock()

    def book() -> None:
        for _ in range(200):
            end = link.reserve(1000, now=0.0)
            with lock:
                done.append(end)

    threads = [threading.Thread(target=book) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert link.busy_until == pytest.approx(1600 * 1e-3, rel=1e-9)
    assert sorted(done) == pytest.approx([k * 1e-3 for k in range(1, 1601)], rel=1e-9)
