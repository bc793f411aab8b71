"""Prefill worker: runs prompts through the engine and pushes KV to decode workers."""
