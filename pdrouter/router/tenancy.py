"""The tenants' gate: every request of a tenant passes its limits before it reaches the dispatcher.

``TenantGate`` is the dispatcher the front doors call on a router with a tenants file
(``pdrouter.core.tenants``). Per request of a tenant:

1. its limits, when it has any: one script in Redis shared by every router
   (``pdrouter.state.tenant_limits``). A refusal is a :class:`~pdrouter.core.tenants.RateLimitError`
   (HTTP 429 with ``Retry-After``, OpenAI ``code`` ``rate_limit_exceeded``, the message naming the
   limit; gRPC RESOURCE_EXHAUSTED), before anything is booked;
2. the dispatcher (``pdrouter.router.dispatch``), where its priority class and weight place it in the
   admission queue and its cache salt keeps its prefix apart;
3. when it ends, whatever ended it, its output tokens are settled in Redis (what it generated
   replaces its ``max_tokens``) and its place among the running requests freed, in the background.

While a request runs, the gate renews its place among its tenant's running requests (a lease, so a
router that dies frees its requests' places within ``lease_ms``). When Redis cannot be reached the
gate does what admission does (``AdmissionConfig.on_redis_error``): ``fail`` answers UNAVAILABLE,
``local`` serves without the tenant's limits. Per-tenant metrics are counted here (requests by
outcome, tokens, refusals by reason, in flight); the queue wait is the dispatcher's.

Requests without a tenant (a router without a tenants file) go straight to the dispatcher.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import uuid
from collections.abc import AsyncIterator
from contextlib import aclosing
from typing import Literal

from redis.exceptions import RedisError

from pdrouter.core.aio import BackgroundTasks, cancel_and_wait
from pdrouter.core.errors import CapacityError, UnavailableError
from pdrouter.core.tenants import RateLimitError, RateLimitTooLargeError, Tenant
from pdrouter.router.metrics import RouterMetrics
from pdrouter.router.request import Dispatcher, ModelInfo, RouterRequest, TokenDelta
from pdrouter.state.tenant_limits import LimitGrant, LimitRefusal, TenantLimiter

log = logging.getLogger(__name__)

_LIMIT_WORDS = {"requests_per_minute": "requests per minute", "prompt_tokens_per_minute": "prompt tokens per minute",
                "output_tokens_per_minute": "output tokens per minute", "max_concurrent": "requests at once"}


def refusal_error(tenant: Tenant, refusal: LimitRefusal, prompt_tokens: int, output_tokens: int) -> RateLimitError:
    """The client's error for a refusal: which limit, its value, and when to retry."""
    words = _LIMIT_WORDS[refusal.limit]
    if refusal.retry_after_ms < 0:
        need = prompt_tokens if refusal.limit == "prompt_tokens_per_minute" else output_tokens
        what = "prompt tokens" if refusal.limit == "prompt_tokens_per_minute" else "output tokens (max_tokens)"
        return RateLimitTooLargeError(
            f"this request's {need} {what} are over tenant {tenant.name}'s limit of {refusal.value} {words} "
            f"({refusal.limit}): it can never pass; send a smaller one", refusal.limit, 1)
    used = f"{refusal.used} running" if refusal.limit == "max_concurrent" else f"{refusal.used} in the last minute"
    return RateLimitError(f"tenant {tenant.name} is over its limit of {refusal.value} {words} ({refusal.limit}: "
                          f"{used}); retry in {refusal.retry_after_s} s", refusal.limit, refusal.retry_after_s)


class TenantGate:
    """Implements ``Dispatcher`` over ``inner`` (the dispatcher) for requests with a tenant.

    ``limiter``: the limits in Redis (None: no Redis, so limits are not enforced; the router warns
    at start). ``on_redis_error``: ``fail`` or ``local``, as admission's.
    """

    def __init__(self, inner: Dispatcher, limiter: TenantLimiter | None, metrics: RouterMetrics,
                 on_redis_error: Literal["fail", "local"] = "fail") -> None:
        self.inner = inner
        self.limiter = limiter
        self.metrics = metrics
        self.on_redis_error = on_redis_error
        self.owner = uuid.uuid4().hex[:12]
        self._seq = itertools.count()
        self._running: dict[str, LimitGrant] = {}
        """Requests holding a place among their tenant's running ones (renewed while they run)."""
        self._settles = BackgroundTasks(log, "settling a tenant's request failed (its place lapses on its own)")
        self._renewer: asyncio.Task[None] | None = None
        self.redis_ok = True

    def models(self) -> list[ModelInfo]:
        return self.inner.models()

    def start(self) -> None:
        if self.limiter is not None:
            self._renewer = asyncio.create_task(self._renew_loop(), name="tenant-renew")

    async def stop(self) -> None:
        await cancel_and_wait(self._renewer)
        await self._settles.wait()

    def generate(self, request: RouterRequest) -> AsyncIterator[TokenDelta]:
        tenant = request.tenant
        if tenant is None:
            return self.inner.generate(request)
        return self._generate(request, tenant)

    async def _admit(self, request: RouterRequest, tenant: Tenant) -> LimitGrant | None:
        """Pass the tenant's limits (RateLimitError when one refuses); None when it has none, or
        Redis is out of reach and ``on_redis_error`` is ``local``."""
        if self.limiter is None or not tenant.limits.limited:
            return None
        prompt, output = len(request.prompt_token_ids), request.sampling.max_tokens
        try:
            verdict = await self.limiter.acquire(tenant.name, tenant.limits, f"t-{self.owner}-{next(self._seq)}",
                                                 prompt, output)
        except (RedisError, OSError) as exc:
            if self.redis_ok:
                log.warning("tenants' limits unavailable (Redis: %s): %s", exc,
                            "serving without them" if self.on_redis_error == "local" else "refusing requests")
            self.redis_ok = False
            if self.on_redis_error == "local":
                return None
            raise UnavailableError("the router cannot reach Redis to check the tenant's limits now; retry later"
                                   ) from None
        if not self.redis_ok:
            log.info("tenants' limits available again")
            self.redis_ok = True
        if isinstance(verdict, LimitRefusal):
            raise refusal_error(tenant, verdict, prompt, output)
        return verdict

    async def _generate(self, request: RouterRequest, tenant: Tenant) -> AsyncIterator[TokenDelta]:
        counts = self.metrics.tenant(tenant.name)
        try:
            grant = await self._admit(request, tenant)
        except BaseException as exc:
            if isinstance(exc, CapacityError):
                counts.rejected(exc.reason)
            counts.finished(exc, 0, 0)
            raise
        if grant is not None and grant.running:
            self._running[grant.booking] = grant
        counts.in_flight.inc()
        produced = 0
        error: BaseException | None = None
        try:
            async with aclosing(self.inner.generate(request)) as stream:  # type: ignore[type-var]
                async for delta in stream:
                    produced += len(delta.token_ids)
                    yield delta
        except GeneratorExit:
            raise  # the consumer stopped (a stop string): the request ended well
        except BaseException as exc:
            error = exc
            if isinstance(exc, CapacityError):
                counts.rejected(exc.reason)
            raise
        finally:
            counts.in_flight.dec()
            counts.finished(error, len(request.prompt_token_ids), produced)
            if grant is not None:
                self._running.pop(grant.booking, None)
                self._settles.spawn(self._settle(grant, produced))

    async def _settle(self, grant: LimitGrant, produced: int) -> None:
        assert self.limiter is not None
        await self.limiter.settle(grant, produced)

    async def _renew_loop(self) -> None:
        assert self.limiter is not None
        while True:
            await asyncio.sleep(self.limiter.lease_ms / 3000)
            if not self._running:
                continue
            try:
                await self.limiter.renew(list(self._running.values()))
            except (RedisError, OSError) as exc:  # the places may lapse; the next round tries again
                log.warning("renewing tenants' running requests failed: %s", exc)
