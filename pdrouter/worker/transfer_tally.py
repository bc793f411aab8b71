"""What a worker's KV transfers added up to since it started: bytes each way, time, failures.

The roles that move KV (prefill, decode) record each transfer here; the worker's heartbeats carry
the totals (``WorkerLoad.kv_*``), which routers export per worker (``pdrouter_worker_kv_transfer_*``).
Single-threaded: recorded and read on the worker's event loop.
"""

from __future__ import annotations

import dataclasses

from pdrouter.core.workers import WorkerLoad


@dataclasses.dataclass
class TransferTally:
    sent_bytes: int = 0
    received_bytes: int = 0
    seconds: float = 0.0
    """Wall time of the transfers (each from its start to its confirmation)."""
    failures: int = 0

    def sent(self, nbytes: int, seconds: float) -> None:
        self.sent_bytes += nbytes
        self.seconds += seconds

    def received(self, nbytes: int, seconds: float) -> None:
        self.received_bytes += nbytes
        self.seconds += seconds

    def failed(self) -> None:
        self.failures += 1

    def onto(self, load: WorkerLoad) -> WorkerLoad:
        """``load`` carrying these totals."""
        return dataclasses.replace(load, kv_sent_bytes=self.sent_bytes, kv_received_bytes=self.received_bytes,
                                   kv_transfer_s=self.seconds, kv_transfer_failures=self.failures)
