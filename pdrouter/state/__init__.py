"""Redis-backed shared state: the worker registry, the prefix index and KV reservations.

Every key of one pool's registry and prefix index shares a hash tag (``pdr:{<pool>}:…``), so the
server-side scripts touching several of them run on one slot of a Redis Cluster too. On a cluster
(``redis+cluster://``) the pool's bookings move under a tag of their own (``pdr:{<pool>#kv}:…``,
``PoolKeys.bookings_apart``), so a pool's load spreads over two shards; see ``docs/scale.md``.
"""
