"""Torch runtime shared by the workers: Llama-family model, paged KV cache, prefix caching, scheduler.

The worker-facing contract is :class:`pdrouter.engine.torch_engine.TorchEngine` (built from an
:class:`pdrouter.engine.config.EngineConfig`) and the value objects of :mod:`pdrouter.engine.outputs`. Modules:

* ``config``: the frozen engine configuration and KV pool sizing;
* ``model_io``: HF-format model folders (``make_model`` writes seeded random ones);
* ``model`` / ``attention``: the Llama decoder and attention over the paged pool;
* ``kv_cache``: the pool tensor, shaped ``pdrouter.core.kv_layout.KvLayout.shape``;
* ``block_manager`` / ``events``: block allocation, prefix reuse, LRU eviction, block events (pure Python);
* ``request`` / ``scheduler`` / ``validation``: request lifecycle, continuous batching, input checks;
* ``model_runner`` / ``sampler``: one model step, and next-token sampling;
* ``torch_engine`` / ``outputs``: the synchronous torch engine and what it hands to its driver.

Importing this package imports no torch; the router can use ``pdrouter.core.tokenizer`` cheaply.
"""
