"""KV transfer: ships a request's paged KV blocks from a prefill worker into a decode worker's blocks."""
