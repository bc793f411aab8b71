"""The KV connections' TCP congestion control: set on both ends when configured, the host's default
otherwise; a name the kernel refuses is a ConfigError that says what it offers (real sockets)."""

from __future__ import annotations

from pathlib import Path

import pytest

from pdrouter.core.errors import ConfigError
from pdrouter.transfer import Backend, TransferState
from pdrouter.transfer.config import describe_tcp_congestion

from .factories import Pair, blocks_equal, make_config, make_layout


def host_default() -> str:
    return Path("/proc/sys/net/ipv4/tcp_congestion_control").read_text().strip()


def moved(pair: Pair) -> tuple[str, str]:
    """One transfer over the pair; the congestion control of the sender's and the receiver's socket."""
    handle = pair.receiver.expect("t-0", [3, 4], timeout_s=30)
    transfer = pair.sender.open_transfer(handle.target)
    transfer.send_layers([1, 2])
    transfer.finish(30)
    handle.wait_all(30)
    assert transfer.state is TransferState.DONE and blocks_equal(pair.src, [1, 2], pair.dst, [3, 4])
    [sending] = pair.sender._connections.values()
    [receiving] = pair.receiver._connections
    return sending.fs.congestion_control, receiving.fs.congestion_control


def test_a_configured_congestion_control_is_set_on_both_ends() -> None:
    # reno is the one every Linux kernel has and lets any process set
    pair = Pair(make_layout(), Backend.TCP, receiver={"tcp_congestion": "reno"}, sender={"tcp_congestion": "reno"})
    try:
        assert moved(pair) == ("reno", "reno")
        pair.assert_released()
    finally:
        pair.close()


def test_unset_the_connections_keep_the_hosts_default() -> None:
    pair = Pair(make_layout(), Backend.TCP)
    try:
        assert moved(pair) == (host_default(), host_default())
    finally:
        pair.close()


def test_a_name_the_kernel_refuses_is_a_clear_config_error() -> None:
    with pytest.raises(ConfigError, match=r"the kernel refused TCP congestion control 'no-such-cc' \(.+\): "
                                          r"available here: .*reno.*; allowed without CAP_NET_ADMIN: .*reno"):
        make_config(tcp_congestion="no-such-cc")
    for bad in ("", "two words", "x" * 16):
        with pytest.raises(ConfigError, match="must be an algorithm's name"):
            make_config(tcp_congestion=bad)


def test_what_a_worker_logs_at_start() -> None:
    assert describe_tcp_congestion("reno") == "KV connections: TCP congestion control reno"
    default = describe_tcp_congestion(None)
    assert default.startswith(f"KV connections: TCP congestion control {host_default()}, the host's default")
    assert "--kv-tcp-congestion" in default

