"""How many CPUs this process may use: its affinity mask, capped by a cgroup CPU limit.

``os.cpu_count()`` (and torch's default of one intra-op thread per core) sees every core of the
machine. In a container limited to two CPUs (``docker run --cpus 2``, a Kubernetes CPU limit) a
worker that runs a thread per core of a 64-core node gets throttled by the kernel's CPU quota
for most of every period. The limit is read from cgroup v2 (``cpu.max``) or v1
(``cpu.cfs_quota_us`` / ``cpu.cfs_period_us``), along the process's cgroup path and its ancestors
(the tightest wins), under the usual ``/sys/fs/cgroup`` mounts.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class CpuBudget:
    """The CPUs a process may run on (``affinity``) and its cgroup CPU limit (None: no limit)."""

    affinity: int
    limit: float | None

    @property
    def usable(self) -> int:
        """Threads worth running at once: the affinity count, capped by the limit rounded up."""
        if self.limit is None:
            return self.affinity
        return max(1, min(self.affinity, math.ceil(self.limit)))


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except OSError:
        return None


def _ancestors(root: Path, cgroup_path: str) -> list[Path]:
    """``root/cgroup_path`` and each parent up to ``root`` itself."""
    parts = [p for p in cgroup_path.split("/") if p]
    return [root.joinpath(*parts[:n]) for n in range(len(parts), -1, -1)]


def _v2_limit(root: Path, cgroup_path: str) -> float | None:
    limits = []
    for folder in _ancestors(root, cgroup_path):
        fields = (_read(folder / "cpu.max") or "").split()
        if len(fields) == 2 and fields[0] != "max" and fields[0].isdigit() and fields[1].isdigit() and int(fields[1]):
            limits.append(int(fields[0]) / int(fields[1]))
    return min(limits) if limits else None


def _v1_limit(root: Path, controllers: str, cgroup_path: str) -> float | None:
    limits = []
    for mount in (root / controllers, root / "cpu", root / "cpu,cpuacct"):
        for folder in _ancestors(mount, cgroup_path):
            quota, period = _read(folder / "cpu.cfs_quota_us"), _read(folder / "cpu.cfs_period_us")
            if quota and period and quota.isdigit() and period.isdigit() and int(quota) > 0 and int(period) > 0:
                limits.append(int(quota) / int(period))  # a quota of -1 means none
        if limits:
            break
    return min(limits) if limits else None


def cgroup_cpu_limit(proc_self_cgroup: str, cgroup_root: Path) -> float | None:
    """The CPU limit (in CPUs) that ``/proc/self/cgroup``'s text places this process under, or None."""
    for line in proc_self_cgroup.splitlines():
        hierarchy, _, rest = line.partition(":")
        controllers, _, path = rest.partition(":")
        if hierarchy == "0" and controllers == "":
            limit = _v2_limit(cgroup_root, path)
            if limit is not None:
                return limit
        elif "cpu" in controllers.split(","):
            limit = _v1_limit(cgroup_root, controllers, path)
            if limit is not None:
                return limit
    return None


def cpu_budget(cgroup_root: Path = Path("/sys/fs/cgroup"), proc_self_cgroup: str | None = None) -> CpuBudget:
    """This process's :class:`CpuBudget` (Linux; elsewhere every core, no limit)."""
    try:
        affinity = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        affinity = os.cpu_count() or 1
    if proc_self_cgroup is None:
        proc_self_cgroup = _read(Path("/proc/self/cgroup")) or ""
    return CpuBudget(affinity, cgroup_cpu_limit(proc_self_cgroup, cgroup_root))
