"""What a worker asks of its vLLM engine's connector for one request, carried in ``kv_transfer_params``.

vLLM hands a request's ``kv_transfer_params`` (``SamplingParams.extra_args["kv_transfer_params"]``)
to the connector's scheduler side untouched. The worker puts one order under the ``"pdrouter"`` key:

* ``ReceiveOrder`` (decode engine): reserve the prompt's blocks, announce them on the side channel
  and wait for a prefill worker to fill them; compute the prompt here instead when at most
  ``local_prefill_tokens`` of it are not cached here.
* ``SendOrder`` (prefill engine): compute the prompt, push its blocks into ``targets`` (one per
  tensor-parallel rank, as the decode engine's ranks announced them), layer by layer, and hold
  them until the decode side confirmed or ``hold_s`` passed.

``key`` is the request's identity on both engines and on the channel (the router's request id, or
the transfer id the decode worker made of it); vLLM's own request ids never leave an engine.
The params cross vLLM's process boundary as msgpack, so the orders are plain dicts there.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any

from pdrouter.core.errors import InvalidRequestError
from pdrouter.transfer.target import MAX_TRANSFER_ID_BYTES, TransferTarget

PARAMS_KEY = "pdrouter"


def _key(value: object) -> str:
    if not isinstance(value, str) or not value or len(value.encode()) > MAX_TRANSFER_ID_BYTES - 16:
        raise InvalidRequestError(f"kv_transfer_params: key must be a string of 1..{MAX_TRANSFER_ID_BYTES - 16} "
                                  f"bytes, got {value!r}")
    return value


def _seconds(value: object, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not (0 < value < math.inf):
        raise InvalidRequestError(f"kv_transfer_params: {name} must be a positive number of seconds, got {value!r}")
    return float(value)


@dataclass(frozen=True)
class ReceiveOrder:
    """Decode engine: take the prompt's KV from a prefill worker into blocks reserved here."""

    key: str
    local_prefill_tokens: int = 0
    """Compute the prompt here when at most this many of its tokens are not cached here."""
    timeout_s: float = 60.0
    """How long the reserved blocks wait for the KV; then the prompt is computed here."""

    def __post_init__(self) -> None:
        _key(self.key)
        if isinstance(self.local_prefill_tokens, bool) or not isinstance(self.local_prefill_tokens, int) \
                or self.local_prefill_tokens < 0:
            raise InvalidRequestError(f"kv_transfer_params: local_prefill_tokens must be an int >= 0, "
                                      f"got {self.local_prefill_tokens!r}")
        _seconds(self.timeout_s, "timeout_s")

    def params(self) -> dict[str, Any]:
        return {PARAMS_KEY: {"receive": asdict(self)}}


@dataclass(frozen=True)
class SendOrder:
    """Prefill engine: push the prompt's blocks into the blocks a decode engine reserved."""

    key: str
    targets: tuple[TransferTarget, ...]
    """One per tensor-parallel rank, rank order; rank ``r`` sends its shard to ``targets[r]``."""
    hold_s: float = 60.0
    """The longest the prompt's blocks are held for the decode side after the prompt is computed."""

    def __post_init__(self) -> None:
        _key(self.key)
        if not self.targets:
            raise InvalidRequestError("kv_transfer_params: a send order needs at least one target")
        _seconds(self.hold_s, "hold_s")

    def params(self) -> dict[str, Any]:
        return {PARAMS_KEY: {"send": {"key": self.key, "hold_s": self.hold_s,
                                      "targets": [target_to_dict(t) for t in self.targets]}}}


Order = ReceiveOrder | SendOrder


def target_to_dict(target: TransferTarget) -> dict[str, Any]:
    fields = asdict(target)
    fields["dst_block_ids"] = list(target.dst_block_ids)
    return fields


def target_from_dict(fields: object) -> TransferTarget:
    if not isinstance(fields, Mapping):
        raise InvalidRequestError(f"kv_transfer_params: a target must be a map, got {type(fields).__name__}")
    try:
        return TransferTarget(**{**fields, "dst_block_ids": tuple(fields["dst_block_ids"])})
    except (TypeError, KeyError, ValueError) as exc:
        raise InvalidRequestError(f"kv_transfer_params: bad target ({exc})") from None


def order_from_params(params: Mapping[str, Any] | None) -> Order | None:
    """The order in a request's ``kv_transfer_params``; None when there is none for this connector.

    InvalidRequestError (naming the field) when the order is malformed.
    """
    if not params or PARAMS_KEY not in params:
        return None
    body = params[PARAMS_KEY]
    if not isinstance(body, Mapping) or len(body) != 1 or not {"receive", "send"} & set(body):
        raise InvalidRequestError(f"kv_transfer_params[{PARAMS_KEY!r}] must hold one of 'receive' or 'send'")
    kind, fields = next(iter(body.items()))
    if not isinstance(fields, Mapping):
        raise InvalidRequestError(f"kv_transfer_params[{PARAMS_KEY!r}][{kind!r}] must be a map")
    try:
        if kind == "receive":
            return ReceiveOrder(**fields)
        return SendOrder(key=fields["key"], hold_s=fields.get("hold_s", 60.0),
                         targets=tuple(target_from_dict(t) for t in fields.get("targets", ())))
    except (TypeError, KeyError) as exc:
        raise InvalidRequestError(f"kv_transfer_params[{PARAMS_KEY!r}][{kind!r}]: {exc}") from None
