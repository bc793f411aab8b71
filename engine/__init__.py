"""Torch runtime shared by the workers: Llama-family model, paged KV cache, prefix caching, scheduler."""
