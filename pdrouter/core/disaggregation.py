"""Conditional disaggregation: when a decode worker computes a prompt itself instead of a prefill worker.

A transfer pays off only for enough uncached tokens. The router sends a short prompt straight to
the decode worker (``DispatchConfig.local_prefill_tokens``: no prefix lookup, no route); the decode
worker decides again once it knows how much of the prompt its own prefix cache holds. Both of its
engines decide with this one rule: pd-router's (``pdrouter.worker.roles.decode_serve``) and vLLM's,
inside its KV connector (``pdrouter.transfer.vllm.scheduler_side``).
"""

from __future__ import annotations


def computes_locally(prompt_tokens: int, cached_tokens: int, local_prefill_tokens: int) -> bool:
    """Whether the decode worker computes the prompt itself: at most ``local_prefill_tokens`` of its
    ``prompt_tokens`` are not among the ``cached_tokens`` it holds."""
    return prompt_tokens - cached_tokens <= local_prefill_tokens
