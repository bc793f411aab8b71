"""Which decode workers a prefill worker sends KV to (``PrefillWorker.Prefill`` is handed the target).

The KV target of a ``Prefill`` call comes from the caller. A prefill worker checks it before it
computes anything, and so before it opens any connection:

* with a registry (``--redis``), :class:`RegisteredDecodeWorkers`: the target must name a decode
  worker registered in the prefill worker's pool (``target.worker_id``), at the KV receiver address
  and epoch that worker registered;
* without one, :class:`StaticDecodeTargets`: the target's address must be one of the configured
  ``--decode-kv-addresses``; with none configured, every target is refused.

Whoever can reach a prefill worker's port cannot make it dial an address of their choosing and
send a KV handshake there. It is the mirror of the decode worker's check of the prefill routes
it is given (``prefill_routes``).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol

from redis.exceptions import RedisError

from pdrouter.core.errors import FailedPreconditionError, PdRouterError, UnavailableError
from pdrouter.core.workers import WorkerRecord, WorkerRole
from pdrouter.state.registry import WorkerRegistry
from pdrouter.transfer.target import TransferTarget
from pdrouter.worker.roles.registry_view import RegistryView


class DecodeTargets(Protocol):
    """The check a KV target passes before a prefill worker does anything for it."""

    async def refusal(self, worker_id: str, target: TransferTarget) -> PdRouterError | None:
        """None when KV may go to ``target`` on decode worker ``worker_id``, else the error to answer."""
        ...


class RegisteredDecodeWorkers(RegistryView):
    """KV goes only to decode workers registered in the pool, at the KV address and epoch they registered.

    Reads of the registry are :class:`~pdrouter.worker.roles.registry_view.RegistryView`'s (a known
    target costs no Redis call; an unknown one waits for a fresh, shared read). A target that is not
    registered is FAILED_PRECONDITION; one that cannot be checked because Redis is unreachable is
    UNAVAILABLE (retryable: the decode worker tries its next prefill route).
    """

    def __init__(self, registry: WorkerRegistry, min_refresh_s: float = 0.2, max_age_s: float = 5.0) -> None:
        super().__init__(registry, WorkerRole.DECODE, min_refresh_s, max_age_s)

    async def refusal(self, worker_id: str, target: TransferTarget) -> PdRouterError | None:
        def registered_there(record: WorkerRecord) -> bool:
            return record.kv_address == target.peer and record.epoch == target.epoch

        try:
            if await self.find(worker_id, registered_there) is not None:
                return None
        except (RedisError, OSError) as exc:
            return UnavailableError(f"cannot check decode worker {worker_id!r} against the registry now "
                                    f"({type(exc).__name__}); retry later")
        record = self.known(worker_id)
        if record is None:
            # Refused all the same; UNAVAILABLE because a real decode worker is missing from the registry only
            # while it re-registers (Redis restarted empty): the caller may retry, and clients get 503.
            return UnavailableError(f"target.worker_id {worker_id!r} is not a decode worker registered in "
                                    f"pool {self.registry.keys.pool!r} (now); KV goes only to registered ones")
        return FailedPreconditionError(
            f"decode worker {worker_id!r} registered KV address {record.kv_address!r} (epoch {record.epoch}), "
            f"not {target.peer!r} (epoch {target.epoch})")


class StaticDecodeTargets:
    """Without a registry: KV goes only to the configured receiver addresses (none: nowhere)."""

    def __init__(self, addresses: Iterable[str]) -> None:
        self.addresses = frozenset(addresses)

    async def refusal(self, worker_id: str, target: TransferTarget) -> PdRouterError | None:
        if target.peer in self.addresses:
            return None
        if not self.addresses:
            return FailedPreconditionError("this prefill worker has no registry (--redis) and no "
                                           "--decode-kv-addresses: it sends KV to no decode worker")
        return FailedPreconditionError(f"target.address {target.peer!r} is not one of this prefill worker's "
                                       f"--decode-kv-addresses")
