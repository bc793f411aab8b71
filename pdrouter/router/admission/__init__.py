"""KV-capacity admission: bookings on decode workers in Redis, credit, the wait queue, lease renewal."""
