"""Which prefill routes a decode worker may call (``DecodeWorker.Serve`` calls them itself).

A route comes from the caller, so before calling it a decode worker with a registry checks it
(:class:`RegisteredPrefillWorkers`): it must name a prefill worker registered in the decode
worker's pool, at the addresses that worker registered. Whoever can reach a decode worker's port
cannot make it open connections (and send KV targets) to arbitrary addresses. The connections
themselves are ``pdrouter.wire.prefill_links.PrefillLinks``; the prefill worker checks the KV
target it is given the same way (``decode_targets``).
"""

from __future__ import annotations

from redis.exceptions import RedisError

from pdrouter.core.workers import WorkerRecord, WorkerRole
from pdrouter.state.registry import WorkerRegistry
from pdrouter.wire.prefill_links import RouteAddress
from pdrouter.worker.roles.registry_view import RegistryView


class RegisteredPrefillWorkers(RegistryView):
    """Which prefill routes a decode worker may call: those of prefill workers registered in its pool.

    A route passes when its worker id is registered with the prefill role and each address it
    names (gRPC, lane) is the one that worker registered. How the registered workers are read and
    kept (a known route costs no Redis call, an unknown one waits for a fresh, shared read) is
    :class:`~pdrouter.worker.roles.registry_view.RegistryView`'s. With Redis unreachable, known
    routes still pass and others are refused.
    """

    def __init__(self, registry: WorkerRegistry, min_refresh_s: float = 0.2, max_age_s: float = 5.0) -> None:
        super().__init__(registry, WorkerRole.PREFILL, min_refresh_s, max_age_s)

    async def refusal(self, route: RouteAddress) -> str | None:
        """None when ``route`` may be called, else why not (for the report and the log)."""

        def at_its_addresses(record: WorkerRecord) -> bool:
            return ((not route.address or route.address == record.address)
                    and (not route.lane_address or route.lane_address == record.lane_address))

        try:
            if await self.find(route.worker_id, at_its_addresses) is not None:
                return None
        except (RedisError, OSError) as exc:
            return f"cannot check prefill worker {route.worker_id!r} against the registry ({exc})"
        record = self.known(route.worker_id)
        if record is None:
            return (f"{route.worker_id!r} is not a prefill worker registered in pool "
                    f"{self.registry.keys.pool!r}")
        return (f"prefill worker {route.worker_id!r} registered address {record.address!r} and lane "
                f"{record.lane_address or 'none'!r}, not {route.address!r} and {route.lane_address!r}")
