"""What the worker side owes vLLM's scheduler: requests whose transfers are over (thread-safe).

The I/O loop records; the engine thread takes them at the end of each step
(``get_transfer_results``). A send is reported only once vLLM has also said the request
finished (its ``finished_req_ids``): vLLM frees a sent request's blocks when it hears of it, and
expects to hear only of requests it already finished.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable
from dataclasses import dataclass, field


@dataclass(frozen=True)
class StepReport:
    finished_sending: set[str] = field(default_factory=set)
    finished_recving: set[str] = field(default_factory=set)
    failed_recving: set[str] = field(default_factory=set)


class Reports:
    """Transfers over, waiting to be reported (see the module docstring)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)
        self._recving: set[str] = set()
        self._failed: set[str] = set()
        self._sends_over: set[str] = set()
        self._sends_finished: set[str] = set()
        """Send requests vLLM said finished, whose transfer may still run."""
        self._sends: set[str] = set()
        """Send requests not reported yet."""

    def received(self, req_id: str, *, failed: bool) -> None:
        with self._lock:
            self._recving.add(req_id)
            if failed:
                self._failed.add(req_id)
            self._changed.notify_all()

    def sending(self, req_id: str) -> None:
        """A send started (engine thread): report it once it is over and vLLM finished the request."""
        with self._lock:
            self._sends.add(req_id)

    def sent(self, req_id: str) -> None:
        with self._lock:
            self._sends_over.add(req_id)
            self._changed.notify_all()

    def wait(self, timeout: float) -> None:
        """Return once a transfer is over (or at once if one is waiting to be taken), at most ``timeout``."""
        with self._lock:
            if not (self._recving or self._sends_over):
                self._changed.wait(timeout)

    def take(self, finished_req_ids: Iterable[str]) -> StepReport:
        with self._lock:
            self._sends_finished.update(r for r in finished_req_ids if r in self._sends)
            done = self._sends_over & self._sends_finished
            self._sends_over -= done
            self._sends_finished -= done
            self._sends -= done
            report = StepReport(done, self._recving, self._failed)
            self._recving, self._failed = set(), set()
        return report

    @property
    def pending_sends(self) -> int:
        with self._lock:
            return len(self._sends)
