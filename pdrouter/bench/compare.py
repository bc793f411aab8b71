"""Colocated against disaggregated on equal GPUs: bring up each layout, run the same sweep, compare.

A layout is ``colocated`` (every GPU group a colocated worker) or ``XpYd`` (X prefill and Y decode
workers), on ``gpus`` GPUs of ``tp`` each per worker. ``pdrouter up`` brings each one up on this
machine (embedded Redis, workers, router) with one engine for all of them (``BACKENDS``: simulated
GPUs, or a real engine on this machine's CPUs, one worker per "GPU"), the same workload runs at
every rate of the sweep, and the results feed ``pdrouter.bench.plots`` and the Markdown verdict below.
"""

from __future__ import annotations

import contextlib
import itertools
import re
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from pdrouter.bench.client import CLIENT_CONNECTIONS
from pdrouter.core.errors import ConfigError, UnavailableError

_SPLIT = re.compile(r"^(\d+)p(\d+)d$")

BACKENDS = ("sim", "torch", "vllm")
"""The engines a comparison runs: ``sim`` (simulated GPUs, ``--gpu`` and ``--time-scale``), ``torch``
(the project's engine on the tiny model) and ``vllm`` (vLLM on the ``small`` model in bfloat16), the
last two on this machine's CPUs at time scale 1."""


@dataclass(frozen=True)
class Layout:
    """How ``gpus`` GPUs are split: colocated workers, or prefill + decode workers (each ``tp`` GPUs)."""

    name: str
    colocated: int = 0
    prefill: int = 0
    decode: int = 0
    tp: int = 1

    @property
    def gpus(self) -> int:
        return (self.colocated + self.prefill + self.decode) * self.tp

    def up_args(self) -> list[str]:
        if self.colocated:
            return ["--mode", "colocated", "--workers", str(self.colocated)]
        return ["--mode", "disaggregated", "--prefill", str(self.prefill), "--decode", str(self.decode)]


def parse_layouts(text: str, gpus: int, tp: int = 1) -> list[Layout]:
    """``colocated,2p6d,4p4d``: every layout must use exactly ``gpus`` GPUs (``all``: every split)."""
    if gpus <= 0 or tp <= 0 or gpus % tp:
        raise ConfigError(f"--gpus ({gpus}) must be a positive multiple of --tp ({tp})")
    workers = gpus // tp
    names = [n.strip().lower() for n in text.split(",") if n.strip()]
    if names == ["all"]:
        names = ["colocated"] + [f"{p}p{workers - p}d" for p in range(1, workers)]
    layouts: list[Layout] = []
    for name in names:
        if name == "colocated":
            layouts.append(Layout(f"colocated-{workers}", colocated=workers, tp=tp))
            continue
        m = _SPLIT.match(name)
        if m is None:
            raise ConfigError(f"--layouts: {name!r} is neither 'colocated' nor XpYd (e.g. 2p6d)")
        p, d = int(m.group(1)), int(m.group(2))
        if p < 1 or d < 1 or p + d != workers:
            raise ConfigError(f"--layouts: {name} uses {p + d} workers of {tp} GPU(s); --gpus {gpus} "
                              f"gives {workers}")
        layouts.append(Layout(name, prefill=p, decode=d, tp=tp))
    if len(layouts) < 2:
        raise ConfigError("--layouts: name at least two layouts to compare")
    return layouts


@dataclass
class LayoutResult:
    """One layout's sweep: per rate, the run's summary and router figures."""

    layout: Layout
    points: list[dict[str, Any]] = field(default_factory=list)

    def curve(self, key: str) -> list[tuple[float, float | None]]:
        """(rate, figure) for ``goodput``, ``ttft_p99``, ``itl_p99``, ``tpot_p99``, ``output_tokens_per_s``…"""
        out: list[tuple[float, float | None]] = []
        for p in self.points:
            s = p["summary"]
            if key in p and key not in ("rate", "summary", "router"):
                value = p[key]
            elif key.endswith(("_p50", "_p90", "_p99", "_mean")):
                metric, stat = key.rsplit("_", 1)
                value = s[metric][stat]
            else:
                value = s.get(key)
            out.append((float(p["rate"]), None if value is None else float(value)))
        return out


def _drain(stream: IO[str]) -> None:
    for _ in stream:
        pass


@dataclass(frozen=True)
class RunningCluster:
    """A layout brought up by ``pdrouter up``: the router's OpenAI base URL and the ``up`` process's pid
    (the router, the workers and Redis are its children)."""

    url: str
    pid: int
    banner: tuple[str, ...] = ()
    """What ``pdrouter up`` printed up to the router's line."""


@contextlib.contextmanager
def bring_up(layout: Layout, folder: Path, *, gpu: str, time_scale: float, backend: str = "sim",
             extra: Sequence[str] = ()) -> Iterator[RunningCluster]:
    """``pdrouter up`` for ``layout`` (simulated GPUs, or ``backend="torch"`` / ``"vllm"``: the folder's
    model on this machine's CPUs, one worker per "GPU"), until the ``with`` block ends."""
    if backend not in BACKENDS:
        raise ConfigError(f"unknown backend {backend!r}: one of {', '.join(BACKENDS)}")
    engine = (["--backend", "sim", "--gpu", gpu, "--tp", str(layout.tp), "--time-scale", str(time_scale)]
              if backend == "sim" else ["--backend", backend])
    # The comparison's own cluster, on loopback only: its doors are open to this machine (no API key). Its
    # router takes every request the client can have in flight (one a connection): at its default cap (512)
    # a rate whose requests last long enough (144 req/s of 8B chat at time scale 1: 680 at once in one
    # run, 1,300 at the peak in a later one) was refused in part with 503s, the router's limit measured
    # instead of the layout.
    # (Connections: the client's, and a few for the harness's own probes.)
    limits = ["--http-max-inflight", str(CLIENT_CONNECTIONS), "--http-max-connections", str(CLIENT_CONNECTIONS + 64)]
    argv = [sys.executable, "-m", "pdrouter", "up", *engine, "--model", str(folder), "--http-port", "0",
            "--grpc-port", "0", "--no-api-key", *limits, *layout.up_args(), *extra]
    up = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        assert up.stdout is not None
        seen: list[str] = []
        for line in up.stdout:
            seen.append(line)
            if line.startswith("router "):
                break
        else:
            raise UnavailableError(f"layout {layout.name} did not come up:\n" + "".join(seen[-20:]))
        threading.Thread(target=_drain, args=(up.stdout,), daemon=True).start()
        yield RunningCluster(line.split()[1], up.pid, tuple(x.rstrip("\n") for x in seen))  # router  http://…
    finally:
        up.send_signal(signal.SIGINT)
        try:
            up.wait(60)
        except subprocess.TimeoutExpired:
            up.kill()
            up.wait()


def slo_attainment(summary: dict[str, Any]) -> float | None:
    """The share (%) of a run's requests that met every SLO bound (DistServe's "SLO attainment");
    failed requests count as misses. None without an SLO or requests."""
    met, total = summary.get("slo_met"), summary.get("requests")
    return None if met is None or not total else 100.0 * met / total


def max_rate_within(result: LayoutResult, attainment: float) -> float | None:
    """The highest rate of the sweep up to which every point kept ``attainment`` % of its requests
    within the SLO (DistServe's goodput: the largest rate served at the attainment target); None
    when even the lowest rate missed it."""
    best: float | None = None
    for rate, share in sorted(result.curve("slo_met_percent")):
        if share is None or share < attainment:
            break
        best = rate
    return best


TIE = 0.03
"""Layouts whose goodput is within this fraction of the best are tied (a run's noise is about this)."""


def best_by_rate(results: Sequence[LayoutResult], key: str = "goodput") -> list[tuple[float, str]]:
    """The layout with the highest ``key`` at each rate; ``tie: a, b`` when several are within ``TIE``."""
    rates = sorted({float(p["rate"]) for r in results for p in r.points})
    winners: list[tuple[float, str]] = []
    for rate in rates:
        scored = [(dict(r.curve(key)).get(rate), r.layout.name) for r in results]
        valid = [(v, n) for v, n in scored if v is not None]
        if valid:
            top = max(v for v, _ in valid)
            best = [n for v, n in valid if v >= top * (1 - TIE)]
            winners.append((rate, best[0] if len(best) == 1 else "tie: " + ", ".join(best)))
    return winners


def crossovers(winners: Sequence[tuple[float, str]]) -> list[tuple[float, float, str, str]]:
    """Where the winner changes: (rate before, rate after, winner before, winner after)."""
    return [(r0, r1, w0, w1) for (r0, w0), (r1, w1) in itertools.pairwise(winners) if w0 != w1]


def why(results: Sequence[LayoutResult], rate: float, winner: str) -> str:
    """A reason for ``winner`` at ``rate``, in the source document's terms, read off the figures."""
    by_name = {r.layout.name: r for r in results}
    if winner.startswith("tie: "):
        tied = winner[5:].split(", ")
        if len(tied) == len(results):
            return "all within 3% of each other"
        rest = [r for r in results if r.layout.name in tied[:1] or r.layout.name not in tied]
        return "within 3% of each other; " + why(rest, rate, tied[0]).replace(
            "the layouts are within 1.5× of each other on TTFT and ITL here",
            "the others' TTFT and ITL are within 1.5× of theirs")
    w = by_name[winner]
    others = [r for r in results if r.layout.name != winner]
    reasons: list[str] = []
    w_itl = dict(w.curve("itl_p99")).get(rate)
    w_ttft = dict(w.curve("ttft_p99")).get(rate)
    for o in others:
        o_itl, o_ttft = dict(o.curve("itl_p99")).get(rate), dict(o.curve("ttft_p99")).get(rate)
        if w_itl is not None and o_itl is not None and o_itl > 1.5 * w_itl:
            reasons.append(f"{o.layout.name}'s ITL p99 is {o_itl / w_itl:.1f}× higher"
                           + (" (prefill chunks interfere with decode steps)" if o.layout.colocated else ""))
        if w_ttft is not None and o_ttft is not None and o_ttft > 1.5 * w_ttft:
            cause = ("too few prefill GPUs, or the KV transfer" if not o.layout.colocated
                     else "prefills queue behind decode batches")
            reasons.append(f"{o.layout.name}'s TTFT p99 is {o_ttft / w_ttft:.1f}× higher ({cause})")
        queue = max((p["router"].get("admission_queue_peak") or 0 for p in o.points if p["rate"] == rate),
                    default=0)
        if queue:
            reasons.append(f"{o.layout.name} ran out of KV room (admission queue {queue:g})")
    return "; ".join(reasons) or "the layouts are within 1.5× of each other on TTFT and ITL here"
