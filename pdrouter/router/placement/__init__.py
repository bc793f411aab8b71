"""Where a request goes: the live worker pool, placement policies (one module each, chosen by name
in ``policies``), per-worker circuit breakers."""
