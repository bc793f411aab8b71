"""Small facts about addresses."""

from __future__ import annotations

import ipaddress


def is_loopback(host: str) -> bool:
    """True when ``host`` (a bind address) is reachable from this machine only."""
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False
