"""Redis users per component: what the router and the workers may do in Redis (ACL, Redis 6 and later).

Two users besides Redis's ``default`` (whose password, ``requirepass``, is the operator's and the
health checks'):

* :data:`ROUTER_USER`: reads the registry (``workers``, ``hb:*``), reads and prunes the prefix index
  (``px*``), owns the KV bookings (``kv:*``) and the tenants' limits (``<ns>:tenant:*``), publishes
  and hears the ``credit-wanted`` channel;
* :data:`WORKER_USER`: writes the registry (its record, its heartbeat, the ``epoch`` counter) and the
  prefix index; it cannot read or touch a booking, and hears no channel.

Both may run any command but Redis's ``@dangerous`` ones (``FLUSHALL``, ``KEYS``, ``CONFIG``,
``DEBUG``, ``SHUTDOWN``, ``ACL``, ``MONITOR``…), and only on their own keys and channels (the
patterns come from the layout itself, ``pdrouter.state.keys``). On Redis 7 and later the router's
access to the registry is read-only (``%R~``); Redis 6 has no read-only key patterns, so there the
router's user may also write the registry.

What the users do not enforce, and why: one worker's user is every worker's. The registry keeps all
records of a pool in one hash and the prefix index keeps shared structures (block bitmaps, the
slot table), and Redis's ACLs name keys, not hash fields or bitmap bits, so a per-worker user could
not be confined to its own entries without another key layout. A holder of the workers' Redis
password can therefore write any worker's record, or forge one; what stops such a record from
receiving work is the internal secret, which a worker must prove, as the address it is dialled at,
before the router or a decode worker sends it anything (``pdrouter.wire.security``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pdrouter.state.keys import PoolKeys, TenantKeys

ROUTER_USER = "pdrouter-router"
WORKER_USER = "pdrouter-worker"
COMMANDS = "+@all -@dangerous"
"""Every command but Redis's dangerous ones, for both users."""


def _patterns(namespace: str) -> tuple[list[str], list[str], list[str]]:
    """``(registry, prefix index, bookings)`` key patterns of every pool of ``namespace``."""
    keys = PoolKeys(namespace, "*")
    registry = [keys.workers, keys.heartbeat("*"), keys.epoch_counter]
    index = [f"{keys.tag}:px*"]  # px:<incarnation>, pxb:<block>, pxlive, pxslots, pxfree
    bookings = [f"{keys.bookings_tag}:kv:*"]  # kv:book:, kv:lease:, kv:used:; ``{*}`` also matches ``{pool#kv}``
    return registry, index, bookings


def acl_rules(user: str, namespace: str = "pdr", read_only_patterns: bool = True) -> str:
    """The ACL rules of ``user`` (:data:`ROUTER_USER` or :data:`WORKER_USER`) after its name and
    password: keys, channels, commands. ``read_only_patterns``: the server has ``%R~`` (Redis 7+)."""
    registry, index, bookings = _patterns(namespace)
    if user == WORKER_USER:
        keys = [f"~{p}" for p in (*registry, *index)]
        channels: list[str] = []
    elif user == ROUTER_USER:
        read = "%R~" if read_only_patterns else "~"
        tenants = [TenantKeys.pattern(namespace)]
        keys = [f"{read}{p}" for p in registry[:2]] + [f"~{p}" for p in (*index, *bookings, *tenants)]
        channels = [f"&{PoolKeys(namespace, '*').credit_wanted}"]
    else:
        raise ValueError(f"no such pd-router Redis user: {user!r}")
    return " ".join(["resetkeys", "resetchannels", *keys, *channels, COMMANDS])


@dataclass(frozen=True)
class RedisUser:
    """One ACL user: its name, password and rules (``user <name> on ><password> <rules>``)."""

    name: str
    password: str = field(repr=False)
    rules: str

    def config_line(self) -> str:
        """The user as a line of a Redis configuration file (or of ``ACL SETUSER``'s arguments)."""
        return f"user {self.name} on >{self.password} {self.rules}"


def component_users(router_password: str, worker_password: str, namespace: str = "pdr",
                    read_only_patterns: bool = True) -> tuple[RedisUser, RedisUser]:
    """The router's and the workers' users."""
    return (RedisUser(ROUTER_USER, router_password, acl_rules(ROUTER_USER, namespace, read_only_patterns)),
            RedisUser(WORKER_USER, worker_password, acl_rules(WORKER_USER, namespace, read_only_patterns)))
