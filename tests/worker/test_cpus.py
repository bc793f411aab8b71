"""The CPUs a worker may use: affinity capped by a cgroup limit, read from v2 and v1 layouts."""

from __future__ import annotations

import os
from pathlib import Path

from pdrouter.worker.cpus import CpuBudget, cgroup_cpu_limit, cpu_budget


def write(root: Path, rel: str, text: str) -> None:
    path = root / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text + "\n")


def test_usable_threads_round_the_limit_up_and_never_exceed_the_affinity() -> None:
    assert CpuBudget(64, None).usable == 64
    assert CpuBudget(64, 2.0).usable == 2
    assert CpuBudget(64, 1.5).usable == 2
    assert CpuBudget(64, 0.25).usable == 1
    assert CpuBudget(4, 16.0).usable == 4


def test_cgroup_v2_limit_along_the_path_the_tightest_wins(tmp_path: Path) -> None:
    write(tmp_path, "cpu.max", "max 100000")
    write(tmp_path, "kubepods/cpu.max", "800000 100000")
    write(tmp_path, "kubepods/pod1/cpu.max", "250000 100000")
    write(tmp_path, "kubepods/pod1/ctr/cpu.max", "max 100000")
    assert cgroup_cpu_limit("0::/kubepods/pod1/ctr\n", tmp_path) == 2.5
    assert cgroup_cpu_limit("0::/kubepods\n", tmp_path) == 8.0
    assert cgroup_cpu_limit("0::/\n", tmp_path) is None  # "max": no limit
    assert cgroup_cpu_limit("0::/elsewhere\n", tmp_path) is None


def test_cgroup_v1_quota_and_a_container_view_of_its_own_cgroup(tmp_path: Path) -> None:
    write(tmp_path, "cpu,cpuacct/cpu.cfs_quota_us", "200000")
    write(tmp_path, "cpu,cpuacct/cpu.cfs_period_us", "100000")
    # A container sees its own cgroup at the mount's root while /proc names the host's path.
    text = "12:memory:/docker/abc\n4:cpu,cpuacct:/docker/abc\n0::/\n"
    assert cgroup_cpu_limit(text, tmp_path) == 2.0
    write(tmp_path, "cpu,cpuacct/cpu.cfs_quota_us", "-1")  # unlimited
    assert cgroup_cpu_limit(text, tmp_path) is None


def test_this_process_has_a_budget() -> None:
    budget = cpu_budget()
    assert budget.affinity == len(os.sched_getaffinity(0)) and 1 <= budget.usable <= budget.affinity
    assert cpu_budget(Path("/nonexistent"), "0::/\n") == CpuBudget(budget.affinity, None)
