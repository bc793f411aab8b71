"""Small facts about addresses."""

from __future__ import annotations

import contextlib
import ipaddress


def is_loopback(host: str) -> bool:
    """True when ``host`` (a bind address) is reachable from this machine only."""
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def raise_open_file_limit(wanted: int) -> None:
    """Raise this process's soft limit on open files to ``wanted`` where it is lower, up to the hard
    limit (many systems start processes at a soft 1,024, below a client's or a router's connections)."""
    with contextlib.suppress(ImportError, ValueError, OSError):
        import resource

        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        if soft != resource.RLIM_INFINITY and soft < wanted:
            target = wanted if hard == resource.RLIM_INFINITY else min(wanted, hard)
            if target > soft:
                resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
