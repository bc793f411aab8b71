"""The KV-transfer link between a simulated prefill worker and a decode worker.

A transfer of ``n`` bytes takes ``latency + n / bandwidth``. Only the sender's link is modeled: the
receiver's NIC, the switch fabric and any other sender sharing them are assumed not to be the
bottleneck. ``bandwidth`` is one direction's line rate, which a real stack reaches only with large
messages and several streams, so the figures are optimistic by the protocol's efficiency.

Presets (``LINK_PRESETS``, by name through :func:`get_link_preset`):

=============  ===============  ========  =====================================================
name           bandwidth        latency   source
=============  ===============  ========  =====================================================
``nvlink``     450 GB/s         10 µs     H100 NVLink 4: 900 GB/s per GPU is both directions
                                          together (NVIDIA H100 datasheet), one way carries
                                          half. Latency: launching a peer copy and signalling
                                          its completion, a few µs each (an estimate).
``rdma-400g``  50 GB/s          5 µs      400 Gb/s InfiniBand NDR / RoCE NIC = 50 GB/s. A
                                          one-sided RDMA write completes in a few µs (NIC, one
                                          switch hop, PCIe on both ends; an estimate).
``tcp-100g``   12.5 GB/s        50 µs     100 Gb/s Ethernet. Kernel TCP: an isolated request
                                          can cross 10GbE in about 10 µs end to end (Larsen et
                                          al., "Architectural Breakdown of End-to-End Latency
                                          in a TCP/IP Network", SBAC-PAD 2007); under load,
                                          interrupt moderation and the socket path make tens
                                          of µs usual, hence 50 µs.
``tcp-25g``    3.125 GB/s       50 µs     25 Gb/s Ethernet; the same stack as ``tcp-100g``.
=============  ===============  ========  =====================================================

:class:`SharedLink` adds contention: with ``shared=True`` transfers queue first-in first-out on
the wire. FIFO finishes a set of transfers at the same time as fair (processor) sharing of the
bandwidth would — the link is busy for the same total — but the per-transfer latencies differ:
under FIFO the first transfer finishes early and later ones wait, whereas fair sharing finishes
equal transfers together at the end. ``shared=False`` gives every transfer the whole link (a
fabric with a path per pair).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

from pdrouter.core.errors import ConfigError


@dataclass(frozen=True, slots=True)
class LinkSpec:
    """One direction of a link: its line rate and the fixed latency of one transfer."""

    name: str
    bandwidth_bytes_per_s: float
    latency_s: float

    def __post_init__(self) -> None:
        if not self.bandwidth_bytes_per_s > 0:
            raise ConfigError(f"link {self.name!r}: bandwidth must be > 0 bytes/s, got {self.bandwidth_bytes_per_s}")
        if not self.latency_s >= 0:
            raise ConfigError(f"link {self.name!r}: latency must be >= 0 s, got {self.latency_s}")

    def transfer_s(self, nbytes: int) -> float:
        """Seconds to move ``nbytes`` on an idle link: latency + nbytes ÷ bandwidth."""
        return self.latency_s + self.wire_s(nbytes)

    def wire_s(self, nbytes: int) -> float:
        """Seconds the bytes occupy the wire, latency excluded: nbytes ÷ bandwidth."""
        if nbytes < 0:
            raise ValueError(f"a transfer has >= 0 bytes, got {nbytes}")
        return nbytes / self.bandwidth_bytes_per_s


LINK_PRESETS: dict[str, LinkSpec] = {
    link.name: link
    for link in (
        LinkSpec("nvlink", 450e9, 10e-6),
        LinkSpec("rdma-400g", 50e9, 5e-6),
        LinkSpec("tcp-100g", 12.5e9, 50e-6),
        LinkSpec("tcp-25g", 3.125e9, 50e-6),
    )
}


def get_link_preset(name: str) -> LinkSpec:
    """A link preset by name (case-insensitive, ``_`` for ``-``); ConfigError listing the presets."""
    spec = LINK_PRESETS.get(name.strip().lower().replace("_", "-"))
    if spec is None:
        raise ConfigError(f"unknown link {name!r}; presets: {', '.join(LINK_PRESETS)}")
    return spec


class SharedLink:
    """The sender's link as several transfers see it; safe to call from any thread.

    ``reserve(nbytes, now)`` books a transfer that is ready at ``now`` (seconds on the caller's
    clock; calls need not come in time order) and returns when it completes. Shared: it starts
    when the wire is free (``max(now, busy_until)``), holds the wire for ``nbytes ÷ bandwidth``
    and completes a latency later; the latency does not hold the wire, so back-to-back transfers
    pipeline. Unshared: every transfer completes at ``now + transfer_s(nbytes)``.
    """

    def __init__(self, spec: LinkSpec, shared: bool = True) -> None:
        self.spec = spec
        self.shared = shared
        self._lock = threading.Lock()
        self._busy_until = float("-inf")

    @property
    def busy_until(self) -> float:
        """When the wire finishes the bytes booked so far (-inf before any transfer, or unshared)."""
        with self._lock:
            return self._busy_until

    def reserve(self, nbytes: int, now: float) -> float:
        """Book a transfer of ``nbytes`` ready at ``now``; the modeled completion time."""
        if not self.shared:
            return now + self.spec.transfer_s(nbytes)
        wire = self.spec.wire_s(nbytes)
        with self._lock:
            start = max(now, self._busy_until)
            self._busy_until = start + wire
            return self._busy_until + self.spec.latency_s
