"""Worker roles: what a prefill, decode or colocated worker serves on top of the common process."""
