"""What the connector's scheduler side tells its worker side each engine step (vLLM's connector metadata).

vLLM builds one ``StepPlan`` per step in its scheduler process and hands it to every worker
process before the step's forward pass (pickled with the scheduler's output). vLLM passes the
metadata through untouched, so the plan is a plain value and this module imports no vLLM. The
items name vLLM's request ids, which only the two halves of one engine's connector share;
everything that leaves the engine names the order's ``key``.
"""

from __future__ import annotations

from dataclasses import dataclass

from pdrouter.transfer.target import TransferTarget


@dataclass(frozen=True)
class ReceivePlan:
    """Decode: blocks were reserved for ``key``; invite its KV into them."""

    req_id: str
    key: str
    dst_block_ids: tuple[int, ...]
    """The prompt's blocks, in order."""
    skip_blocks: int
    """Leading blocks this engine holds already (its prefix cache): not sent."""
    timeout_s: float


@dataclass(frozen=True)
class LocalPlan:
    """Decode: ``key``'s prompt is computed here (little of it is not cached here)."""

    key: str
    cached_tokens: int


@dataclass(frozen=True)
class SendPlan:
    """Prefill: this step completes ``key``'s prompt; push ``src_block_ids`` to the targets."""

    req_id: str
    key: str
    targets: tuple[TransferTarget, ...]
    src_block_ids: tuple[int, ...]
    """The prompt's blocks in this engine, in order."""
    hold_s: float


@dataclass(frozen=True)
class Cancel:
    """The request ended in vLLM (finished, aborted): drop whatever the worker side holds for it."""

    req_id: str
    key: str


@dataclass(frozen=True)
class StepPlan:
    """One step's instructions; empty on most steps."""

    receives: tuple[ReceivePlan, ...] = ()
    locals: tuple[LocalPlan, ...] = ()
    sends: tuple[SendPlan, ...] = ()
    cancels: tuple[Cancel, ...] = ()

    @property
    def empty(self) -> bool:
        return not (self.receives or self.locals or self.sends or self.cancels)
