"""The checks every worker RPC starts with, before any engine work."""

from __future__ import annotations

from pdrouter.core.errors import IncompatibleError, InvalidRequestError


def check_request(request_id: str, model_compat_hash: str, expected_compat_hash: str) -> None:
    """The checks every worker RPC starts with: a request id, and the same model on both ends."""
    if not request_id:
        raise InvalidRequestError("request_id is required")
    if model_compat_hash != expected_compat_hash:
        raise IncompatibleError(f"model_compat_hash {model_compat_hash!r} does not match this worker's "
                                f"{expected_compat_hash!r} (different model, dtype or block size)")
