"""The placement policies by name: what the router's configuration chooses from."""

from __future__ import annotations

from pdrouter.core.errors import ConfigError
from pdrouter.router.placement.cache_aware import CacheAware, CacheAwareConfig
from pdrouter.router.placement.least_loaded import LeastLoaded
from pdrouter.router.placement.policy import PlacementPolicy

POLICIES = (LeastLoaded.name, CacheAware.name)


def make_policy(name: str, cache_aware: CacheAwareConfig | None = None) -> PlacementPolicy:
    """The policy called ``name`` (one of ``POLICIES``); ``cache_aware``: the cache-aware policy's weights."""
    if name == CacheAware.name:
        return CacheAware(cache_aware)
    if name == LeastLoaded.name:
        return LeastLoaded()
    raise ConfigError(f"unknown placement policy {name!r}: use one of {', '.join(POLICIES)}")
