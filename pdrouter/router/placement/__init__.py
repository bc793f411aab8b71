"""Where a request goes: the live worker pool, placement policies, per-worker circuit breakers."""
