"""Injected engine faults: what a test does to an engine to see how a worker fails. Off unless configured.

A worker reads one fault from ``PDROUTER_ENGINE_FAULT`` at start-up (``pdrouter worker | prefill |
decode``; the environment is read there and nowhere else) and wraps its model step in
:class:`FaultyStep`. The fault fires on the steps whose work holds a chosen token id, so a test picks
the moment by what it sends (a prompt holding that id) and every other request runs as usual:

* ``step-raises:<token id>``: the whole step raises, as a device fault or a bug in the model would.
  The engine stops for good; the worker reports NOT_SERVING (``pdrouter.worker.driver``).
* ``request-fails:<token id>``: the requests whose work holds the token get a
  :class:`~pdrouter.engine.batch_engine.RequestFault` instead of their token, as non-finite logits
  would give them; they fail alone and the engine serves on.

Never set it on a worker that serves real traffic.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from pdrouter.core.errors import ConfigError
from pdrouter.engine.batch_engine import ModelStep, RequestFault, StepWork

ENGINE_FAULT_ENV = "PDROUTER_ENGINE_FAULT"
FaultKind = Literal["step-raises", "request-fails"]
FAULT_KINDS: tuple[FaultKind, ...] = ("step-raises", "request-fails")
INJECTED = RequestFault(f"an injected fault ({ENGINE_FAULT_ENV})")


class InjectedFault(RuntimeError):
    """The error an injected ``step-raises`` fault raises inside the model step."""


@dataclass(frozen=True)
class EngineFault:
    """One injected fault: its kind, and the token id whose presence in a step's work triggers it."""

    kind: FaultKind
    token: int

    @classmethod
    def parse(cls, spec: str) -> EngineFault:
        """``<kind>:<token id>``; ConfigError naming the variable for anything else."""
        kind, _, token = spec.strip().partition(":")
        if kind not in FAULT_KINDS or not token.isdigit():
            raise ConfigError(f"{ENGINE_FAULT_ENV} must be <kind>:<token id> with kind one of "
                              f"{', '.join(FAULT_KINDS)}, got {spec!r}")
        return cls(kind, int(token))


class FaultyStep:
    """A :class:`ModelStep` that runs ``inner`` and injects ``fault`` on the steps it triggers on."""

    def __init__(self, inner: ModelStep, fault: EngineFault) -> None:
        self.inner = inner
        self.fault = fault

    def run(self, work: Sequence[StepWork]) -> Sequence[int | RequestFault]:
        token = self.fault.token
        hit = [token in w.token_ids for w in work]
        if not any(hit):
            return self.inner.run(work)
        if self.fault.kind == "step-raises":
            raise InjectedFault(f"injected fault: a step holding token {token} ({ENGINE_FAULT_ENV})")
        results = list(self.inner.run(work))
        rows = [h for h, w in zip(hit, work, strict=True) if w.samples]
        return [INJECTED if h else r for h, r in zip(rows, results, strict=True)]

    def kv_finite(self, block_ids: Sequence[int]) -> bool:
        return self.inner.kv_finite(block_ids)

    def clear_kv(self, block_ids: Sequence[int]) -> None:
        self.inner.clear_kv(block_ids)
