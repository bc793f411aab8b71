"""Redis-backed shared state: the worker registry, the prefix index and KV reservations.

Every key of one pool shares a hash tag (``pdr:{<pool>}:…``) so a pool's keys live on one slot
and server-side scripts touching several of them also run on Redis Cluster.
"""
