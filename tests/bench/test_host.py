"""This machine's CPU during a run (``pdrouter.bench.host``): real ``/proc`` readings, real processes, and
the host-bound rule on samples."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pdrouter.bench.host import (
    CLIENT_BUSY,
    HOST_BUSY,
    MIN_JUDGED_S,
    HostSample,
    HostSampler,
    WaitCounter,
    cluster_parts,
    describe,
    host_figures,
    process_cpu_s,
    read_host_cpu,
)

linux_only = pytest.mark.skipif(not Path("/proc/stat").is_file(), reason="reads /proc")


def burn(seconds: float) -> None:
    """Spend about ``seconds`` of this process's CPU."""
    end = time.process_time() + seconds
    x = 0
    while time.process_time() < end:
        x += 1


@linux_only
def test_the_machines_busy_time_grows_by_at_least_this_processs_cpu() -> None:
    before = read_host_cpu()
    own = time.process_time()
    burn(0.3)
    after = read_host_cpu()
    used = time.process_time() - own
    assert before is not None and after is not None
    assert 0 < before[0] <= before[1] and after[1] > before[1]
    assert after[0] - before[0] >= used - 0.05  # (clock ticks are 10 ms)


@linux_only
def test_a_processs_cpu_is_its_clock_and_none_once_it_is_gone() -> None:
    own = time.process_time()
    assert process_cpu_s(os.getpid()) == pytest.approx(own, abs=0.05)
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    assert process_cpu_s(child.pid) is None


CHILD = """
import subprocess, sys, time
kids = [subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", "pdrouter", part])
        for part in ("router", "prefill", "decode")]
print(" ".join(str(k.pid) for k in kids), flush=True)
time.sleep(60)
"""


@linux_only
def test_a_clusters_processes_are_found_by_part_and_sampled() -> None:
    """A process tree shaped like ``pdrouter up``'s: the parent, a ``pdrouter router`` and two
    ``pdrouter worker`` command lines."""
    up = subprocess.Popen([sys.executable, "-c", CHILD], stdout=subprocess.PIPE, text=True)
    kids: list[int] = []
    try:
        assert up.stdout is not None
        kids = [int(p) for p in up.stdout.readline().split()]
        router, prefill, decode = kids
        parts = cluster_parts(up.pid)
        assert parts == {"other": [up.pid], "router": [router], "prefill": [prefill], "decode": [decode]}

        async def sample() -> HostSampler:
            sampler = HostSampler(parts, period_s=0.05)
            sampler.start(time.perf_counter())
            await asyncio.sleep(0.3)
            burn(0.2)  # the load generator's CPU, on the loop
            await sampler.stop()
            return sampler

        sampler = asyncio.run(sample())
        samples = sampler.samples
        assert len(samples) >= 4
        assert [s.t_s for s in samples] == sorted(s.t_s for s in samples)
        assert set(samples[-1].parts) == {"other", "router", "prefill", "decode"}
        figures = host_figures(samples, 0.0, samples[-1].t_s)
        # (CPU seconds over wall seconds: the burn's 0.2 s of CPU, whatever else shares the machine)
        assert figures["load_generator_cpu"] * figures["span_s"] >= 0.19 and figures["busy_share"] is not None
        assert set(figures["processes"]) == {"other", "router", "prefill", "decode"}
        assert set(figures["processes_wait"]) == {"other", "router", "prefill", "decode"}
        assert figures["load_generator_wait"] is not None and figures["load_generator_wait"]["cpus"] >= 0
    finally:
        for pid in kids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        up.kill()
        up.wait()
    assert cluster_parts(up.pid) == {}  # gone: nothing to sample


def test_a_fake_proc_tree_is_split_by_command_line(tmp_path: Path) -> None:
    """The rule on command lines alone: a worker's own children (vLLM's engine) count as the worker's."""
    tree = {1: (0, ["python", "-m", "pdrouter", "up"]), 2: (1, ["/venv/bin/redis-server 127.0.0.1:6379"]),
            3: (1, ["python", "-m", "pdrouter", "router", "--model", "m"]),
            4: (1, ["python", "-m", "pdrouter", "worker", "--backend", "vllm"]), 5: (4, ["VLLM::EngineCore"]),
            6: (1, ["python", "-m", "pdrouter", "prefill"]), 7: (1, ["python", "-m", "pdrouter", "decode"]),
            9: (0, ["python", "-m", "pdrouter", "worker"])}  # another tree's
    for pid, (parent, argv) in tree.items():
        (tmp_path / str(pid)).mkdir()
        (tmp_path / str(pid) / "stat").write_bytes(f"{pid} (x y) S {parent} 0 0 0 0 0 0 0 0 0 7 3 0 0".encode())
        (tmp_path / str(pid) / "cmdline").write_bytes("\0".join(argv).encode() + b"\0")
    parts = cluster_parts(1, proc=tmp_path)
    assert {k: sorted(v) for k, v in parts.items()} == {"other": [1], "redis": [2], "router": [3],
                                                         "workers": [4, 5], "prefill": [6], "decode": [7]}
    sampler = HostSampler(parts, proc=tmp_path)
    s = sampler.sample()
    assert s.busy_s is None and s.total_s is None  # no stat file of the machine here
    assert s.parts["workers"] == pytest.approx(2 * 10 / os.sysconf("SC_CLK_TCK"))  # utime 7 + stime 3, twice


BURNER = "import time\nend = time.process_time() + 60\nwhile time.process_time() < end: pass\n"


@linux_only
def test_two_processes_sharing_one_cpu_each_wait_for_it_and_a_sleeper_does_not() -> None:
    """Two burners pinned to one CPU run about half the time each and wait the other half."""
    cpu = min(os.sched_getaffinity(0))
    burners = [subprocess.Popen([sys.executable, "-c", BURNER]) for _ in range(2)]
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        for b in burners:
            os.sched_setaffinity(b.pid, {cpu})
        counter = WaitCounter()
        time.sleep(0.2)
        pids = [[b.pid] for b in burners] + [[sleeper.pid]]
        before = [counter.read(p) for p in pids]
        time.sleep(1.0)
        after = [counter.read(p) for p in pids]
        assert all(r is not None for r in (*before, *after))
        waited = [b[0] - a[0] for a, b in zip(before, after, strict=True)]  # type: ignore[index]
        runs = [b[1] - a[1] for a, b in zip(before, after, strict=True)]  # type: ignore[index]
        assert all(w >= 0.25 for w in waited[:2]), waited  # about 0.5 s each, less what else ran
        assert all(n >= 1 for n in runs[:2]) and waited[2] < 0.05, (waited, runs)
        together = counter.read([b.pid for b in burners])
        assert together is not None
        assert together[0] == pytest.approx(sum(r[0] for r in after[:2]), abs=0.05)  # type: ignore[index]
    finally:
        for p in (*burners, sleeper):
            p.kill()
            p.wait()
    assert WaitCounter().read([sleeper.pid]) is None  # gone, never seen by this counter


def test_a_thread_that_ended_keeps_what_it_was_last_seen_with(tmp_path: Path) -> None:
    def thread(tid: int, wait_ns: int, runs: int) -> None:
        (tmp_path / "5" / "task" / str(tid)).mkdir(parents=True, exist_ok=True)
        (tmp_path / "5" / "task" / str(tid) / "schedstat").write_text(f"900000000 {wait_ns} {runs}\n")

    thread(5, 100_000_000, 10)
    thread(6, 250_000_000, 30)
    counter = WaitCounter(proc=tmp_path)
    assert counter.read([5]) == (pytest.approx(0.35), 40)
    (tmp_path / "5" / "task" / "6" / "schedstat").unlink()
    (tmp_path / "5" / "task" / "6").rmdir()
    thread(5, 150_000_000, 15)
    assert counter.read([5]) == (pytest.approx(0.40), 45)
    assert counter.read([7]) is None  # never seen


def test_the_wait_over_a_window_is_in_cpus_and_a_mean_delay_per_run() -> None:
    samples = [HostSample(0.0, 0.0, 0.0, 0.0, {"router": 0.0}, (1.0, 100), {"router": (2.0, 1000)}),
               HostSample(4.0, 4.0, 8.0, 1.0, {"router": 2.0}, (3.0, 2100), {"router": (2.4, 1000)})]
    figures = host_figures(samples, 0.0, 4.0, cpus=2)
    assert figures["load_generator_wait"] == {"cpus": pytest.approx(0.5), "delay_ms": pytest.approx(1.0)}
    assert figures["processes_wait"] == {"router": {"cpus": pytest.approx(0.1), "delay_ms": None}}  # never run
    text = describe(figures)
    assert "the load generator 0.50 (1.0 ms a wake-up)" in text and "router 0.10" in text
    no_wait = host_figures([HostSample(0.0, 0.0, 0.0, 0.0), HostSample(4.0, 4.0, 8.0, 1.0)], 0.0, 4.0, cpus=2)
    assert no_wait["load_generator_wait"] is None and no_wait["processes_wait"] == {}
    assert "waited for a CPU" not in describe(no_wait)


def at(t: float, busy: float, total: float, own: float, **parts: float) -> HostSample:
    return HostSample(t, busy, total, own, dict(parts))


def test_the_window_is_read_between_the_samples_that_enclose_it() -> None:
    samples = [at(0.0, 0, 0, 0.0, router=0.0), at(1.0, 1.0, 2.0, 0.1, router=0.5),
               at(2.0, 2.9, 4.0, 0.3, router=1.4), at(3.0, 4.8, 6.0, 0.5, router=2.3), at(4.0, 5.0, 8.0, 0.5)]
    figures = host_figures(samples, 1.2, 2.8, cpus=2)  # from the sample at 1 s to the one at 3 s
    assert figures["span_s"] == 2.0
    assert figures["busy_share"] == pytest.approx((4.8 - 1.0) / (6.0 - 2.0))
    assert figures["load_generator_cpu"] == pytest.approx(0.2)
    assert figures["processes"] == {"router": pytest.approx(0.9)}
    assert figures["host_bound"] and figures["reason"] == "its 2 CPUs were 95% busy"
    quiet = host_figures(samples, 0.0, 1.0, cpus=2)
    assert quiet["busy_share"] == 0.5 and not quiet["host_bound"] and quiet["reason"] == ""
    assert host_figures(samples[:1], 0.0, 1.0) == {}


@pytest.mark.parametrize(("busy", "client", "bound"), [
    (HOST_BUSY - 0.01, CLIENT_BUSY - 0.01, False),
    (HOST_BUSY, 0.1, True),
    (0.5, CLIENT_BUSY, True),
    (None, 0.1, False),
])
def test_a_busy_machine_or_a_busy_load_generator_is_host_bound(busy: float | None, client: float,
                                                               bound: bool) -> None:
    samples = [HostSample(0.0, 0.0 if busy is not None else None, 0.0 if busy is not None else None, 0.0),
               HostSample(10.0, 20 * busy if busy is not None else None, 20.0 if busy is not None else None,
                          10 * client)]
    figures = host_figures(samples, 0.0, 10.0, cpus=2)
    assert figures["host_bound"] is bound
    text = describe(figures)
    assert ("**This machine was busy throughout**" in text) is bound
    assert f"the load generator used {client:.2f} of a CPU" in text
    assert ("busy unknown" in text) is (busy is None)


def test_the_run_report_says_whose_limit_a_saturated_point_was() -> None:
    from pdrouter.bench.report import markdown

    window = {"start_s": 1.0, "end_s": 9.0, "length_s": 8.0, "requests": 100, "warmup_s": 1.0, "steady": True,
              "reason": ""}
    summary = {"completed": 1, "failed": 0, "duration_s": 10.0, "request_rate": 1.0, "input_tokens_per_s": 1.0,
               "output_tokens_per_s": 1.0, "errors": {}, "tokens_per_chunk": None,
               **{k: {"count": 0} for k in ("ttft", "tpot", "itl", "e2e")}}
    doc = {"config": {"time_scale": 1}, "summary": summary, "router": {},
           "steady": {"window": window, "saturated": True, "summary": summary}}
    bound = host_figures([HostSample(0.0, 0.0, 0.0, 0.0), HostSample(9.0, 17.5, 18.0, 4.0)], 1.0, 9.0, cpus=2)
    text = markdown(doc | {"host": bound})
    assert "**This machine was busy throughout** (its 2 CPUs were 97% busy)" in text
    assert "The server was **saturated**" not in text and "Less than 90% of the rate offered was served" in text
    quiet = host_figures([HostSample(0.0, 0.0, 0.0, 0.0), HostSample(9.0, 9.0, 18.0, 1.0)], 1.0, 9.0, cpus=2)
    text = markdown(doc | {"host": quiet})
    assert "The server was **saturated**" in text and "This machine (2 CPUs): 50% busy" in text
    assert "busy throughout" not in text


def test_a_window_too_short_to_judge_is_not_called_host_bound() -> None:
    """A run that failed at once spans its start alone (imports, first connects): not judged."""
    samples = [HostSample(0.0, 0.0, 0.0, 0.0), HostSample(MIN_JUDGED_S / 2, 1.0, 1.0, MIN_JUDGED_S / 2)]
    figures = host_figures(samples, 0.0, 0.1, cpus=2)
    assert figures["load_generator_cpu"] == 1.0 and figures["busy_share"] == 1.0
    assert figures["host_bound"] is False and figures["reason"] == ""
