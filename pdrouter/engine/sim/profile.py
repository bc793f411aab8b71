"""Measured mode: profiled operator times of one model on one GPU at one TP, interpolated.

Where a user has profiled their model (per-operator time against the step's tokens, collective
time against message bytes), the timing model uses those times instead of the roofline's matmul
and elementwise terms, and falls back to the roofline outside the profiled range. The format read
is Vidur's (microsoft/vidur, ``data/profiling/``), whose published profiles cover Llama-2/3 and
others on A100 and H100:

* ``mlp.csv``: one row per (tokens, TP): ``num_tokens``, ``num_tensor_parallel_workers`` and, per
  operator, ``time_stats.<op>.median`` in milliseconds. The per-layer operators are the attention's
  input and output projections, rotary, the two norms, the MLP's up and down projections, the
  activation and the residual add (``LAYER_OPS``); the embedding is not per layer and not used.
* ``all_reduce.csv``: one row per (ranks, bytes, rank): ``num_workers``, ``devices_per_node``,
  ``size`` (bytes) and ``time_stats.all_reduce.median`` in milliseconds. Rows within one node at the
  model's TP are used (the median over ranks per size).

A collective profile can also come alone (``--collective-profile FILE``, :func:`read_allreduce_profile`):
Vidur's ``all_reduce.csv``, or the output of nccl-tests' ``all_reduce_perf`` run on the user's own host
(``all_reduce_perf -b 8 -e 256M -f 2 -g N``: one result row per message size, the out-of-place time in
microseconds). Over PCIe, what an all-reduce costs depends on the host more than on the GPU (peer-to-peer
or copies through host memory, one CPU socket or two), so a measurement of the host beats any preset.

Times are interpolated linearly between profiled sizes; a size outside the table returns None, and
the caller falls back to the roofline. Nothing here imports numpy or torch.
"""

from __future__ import annotations

import bisect
import csv
import dataclasses
import re
import statistics
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from pdrouter.core.errors import ConfigError

LAYER_OPS = ("input_layernorm", "attn_pre_proj", "attn_rope", "attn_post_proj", "post_attention_layernorm",
             "mlp_up_proj", "mlp_act", "mlp_down_proj", "add")
"""The per-layer operators of a Vidur ``mlp.csv`` (attention itself is profiled separately)."""

_MS = 1e-3


@dataclass(frozen=True)
class Curve:
    """Seconds against a size (tokens or bytes), sorted by size; linear in between, None outside."""

    sizes: tuple[float, ...]
    seconds: tuple[float, ...]

    def __post_init__(self) -> None:
        if len(self.sizes) != len(self.seconds) or not self.sizes:
            raise ValueError("a curve needs as many times as sizes, and at least one")
        if any(b <= a for a, b in zip(self.sizes, self.sizes[1:], strict=False)):
            raise ValueError("a curve's sizes must increase")

    @classmethod
    def from_points(cls, points: Iterable[tuple[float, float]]) -> Curve:
        pts = sorted(points)
        return cls(tuple(p[0] for p in pts), tuple(p[1] for p in pts))

    def covers(self, size: float) -> bool:
        return self.sizes[0] <= size <= self.sizes[-1]

    def at(self, size: float) -> float | None:
        if not self.covers(size):
            return None
        i = bisect.bisect_left(self.sizes, size)
        if self.sizes[i] == size:
            return self.seconds[i]
        x0, x1, y0, y1 = self.sizes[i - 1], self.sizes[i], self.seconds[i - 1], self.seconds[i]
        return y0 + (y1 - y0) * (size - x0) / (x1 - x0)


@dataclass(frozen=True)
class OperatorProfile:
    """One model's profiled operators on one GPU at one TP (and, optionally, its all-reduce)."""

    source: str
    tp: int
    ops: dict[str, Curve]
    """Per-layer operator → seconds against the step's tokens."""
    allreduce: Curve | None = field(default=None)
    """All-reduce seconds against the bytes of each rank's buffer, at this TP."""

    def op_time(self, op: str, tokens: float) -> float | None:
        """One operator's seconds for a step of ``tokens`` tokens; None outside the profile."""
        return self.ops[op].at(tokens)

    def layer_time(self, tokens: float) -> float | None:
        """One layer's profiled operators, summed, for ``tokens`` tokens; None outside the profile (or
        without operators: a collective profile alone)."""
        if not self.ops:
            return None
        total = 0.0
        for curve in self.ops.values():
            t = curve.at(tokens)
            if t is None:
                return None
            total += t
        return total

    def allreduce_time(self, nbytes: float) -> float | None:
        """One all-reduce of ``nbytes``; None without a collective profile or outside it."""
        return None if self.allreduce is None else self.allreduce.at(nbytes)

    @classmethod
    def load(cls, tp: int, folder: str | Path | None = None, collective: str | Path | None = None
             ) -> OperatorProfile | None:
        """What ``--operator-profile DIR`` and ``--collective-profile FILE`` give a worker at ``tp``: the
        folder's profile, its all-reduce replaced by the file's; the file's alone; or None without either."""
        profile = cls.from_dir(folder, tp) if folder is not None else None
        if collective is None:
            return profile
        curve = read_allreduce_profile(collective, tp)
        if profile is None:
            return cls(source=str(collective), tp=tp, ops={}, allreduce=curve)
        return dataclasses.replace(profile, allreduce=curve)

    @classmethod
    def from_dir(cls, folder: str | Path, tp: int) -> OperatorProfile:
        """``mlp.csv`` and, if present, ``all_reduce.csv`` of a folder in Vidur's format."""
        folder = Path(folder)
        mlp = folder / "mlp.csv"
        if not mlp.is_file():
            raise ConfigError(f"{folder}: an operator profile folder needs mlp.csv (Vidur's format)")
        collective = folder / "all_reduce.csv"
        return cls.from_vidur(mlp, tp, collective if collective.is_file() else None)

    @classmethod
    def from_vidur(cls, mlp_csv: str | Path, tp: int, allreduce_csv: str | Path | None = None) -> OperatorProfile:
        """Read Vidur-format CSVs (see the module docstring); ConfigError naming the file and what is wrong."""
        rows = _read_csv(Path(mlp_csv), ("num_tokens", "num_tensor_parallel_workers",
                                         *(f"time_stats.{op}.median" for op in LAYER_OPS)))
        by_tp: dict[int, list[dict[str, str]]] = defaultdict(list)
        for row in rows:
            by_tp[_int(row, "num_tensor_parallel_workers", mlp_csv)].append(row)
        if tp not in by_tp:
            raise ConfigError(f"{mlp_csv}: no rows for TP {tp}; it profiles TP {', '.join(map(str, sorted(by_tp)))}")
        ops: dict[str, Curve] = {}
        for op in LAYER_OPS:
            points: dict[int, list[float]] = defaultdict(list)
            for row in by_tp[tp]:
                points[_int(row, "num_tokens", mlp_csv)].append(_float(row, f"time_stats.{op}.median", mlp_csv) * _MS)
            ops[op] = Curve.from_points((n, statistics.median(ts)) for n, ts in points.items())
        allreduce = None
        if allreduce_csv is not None and tp > 1:
            allreduce = _allreduce_curve(Path(allreduce_csv), tp)
        return cls(source=str(mlp_csv), tp=tp, ops=ops, allreduce=allreduce)


NCCL_TESTS_TYPE_BYTES = {"int8": 1, "uint8": 1, "int32": 4, "uint32": 4, "int64": 8, "uint64": 8, "half": 2,
                         "float": 4, "double": 8, "bfloat16": 2, "f8e4m3": 1, "f8e5m2": 1}
"""Element sizes of nccl-tests' ``type`` column (its ``-d`` names)."""
_RANK_LINE = re.compile(r"#\s*Rank\s+\d+\s")
_THREADS_LINE = re.compile(r"#\s*nThread\s+(\d+)\s+nGpus\s+(\d+)")


def read_allreduce_profile(path: str | Path, tp: int) -> Curve:
    """All-reduce seconds against each rank's buffer bytes at ``tp`` GPUs: from nccl-tests'
    ``all_reduce_perf`` output (its text, as printed) or a Vidur ``all_reduce.csv``. ConfigError naming
    the file and what is wrong (not an all-reduce, another GPU count, no result rows)."""
    path = Path(path)
    if tp <= 1:
        raise ConfigError(f"--collective-profile {path}: a worker at TP {tp} runs no all-reduce; it needs --tp > 1")
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{path}: cannot read the collective profile ({exc.__class__.__name__}: {exc})") from None
    first = next((line.strip() for line in text.splitlines() if line.strip()), "")
    if first.startswith("#") or "out-of-place" in text:  # (launchers and NCCL may log before the header)
        return _nccl_tests_curve(path, text, tp)
    return _allreduce_curve(path, tp)


def _nccl_tests_curve(path: Path, text: str, tp: int) -> Curve:
    """nccl-tests' output: ``#`` lines (the ranks' devices among them), then one row per size:
    ``size count type redop root time algbw busbw #wrong`` out of place, the same in place. Lines
    that are not result rows (NCCL's own log lines, warnings) are passed over."""
    ranks, threads = 0, None
    points: dict[int, list[float]] = defaultdict(list)
    for lineno, line in enumerate(text.splitlines(), 1):
        fields = line.split()
        if not fields:
            continue
        if fields[0].startswith("#"):
            ranks += bool(_RANK_LINE.match(line.strip()))
            if (m := _THREADS_LINE.match(line.strip())) is not None:
                threads = int(m.group(1)) * int(m.group(2))
            continue
        if len(fields) < 6 or not (fields[0].isdigit() and fields[1].isdigit()):
            continue
        size, count, dtype, redop, root = int(fields[0]), int(fields[1]), fields[2], fields[3], fields[4]
        if redop == "none" or root != "-1":
            raise ConfigError(f"{path}, line {lineno}: not an all-reduce (redop {redop!r}, root {root}); the "
                              f"profile must be all_reduce_perf's output")
        elem = NCCL_TESTS_TYPE_BYTES.get(dtype)
        if elem is not None and count * elem != size:
            raise ConfigError(f"{path}, line {lineno}: {count} {dtype} elements are not {size} bytes on each rank, "
                              f"as in an all-reduce; the profile must be all_reduce_perf's output")
        try:
            micros = float(fields[5])
        except ValueError:
            raise ConfigError(f"{path}, line {lineno}: the time {fields[5]!r} is not a number") from None
        if not micros > 0 or micros == float("inf"):
            raise ConfigError(f"{path}, line {lineno}: the time must be > 0 microseconds, got {fields[5]!r}")
        points[size].append(micros * 1e-6)
    if not points:
        raise ConfigError(f"{path}: no result rows; run all_reduce_perf (nccl-tests) and keep its output as printed")
    measured = ranks or threads
    if measured is None:
        raise ConfigError(f"{path}: it does not say over how many GPUs it ran (no '#  Rank' or 'nGpus' line)")
    if measured != tp:
        raise ConfigError(f"{path}: measured over {measured} GPUs; the worker runs at TP {tp} (run all_reduce_perf "
                          f"over {tp} GPUs, e.g. -g {tp})")
    return Curve.from_points((size, statistics.median(ts)) for size, ts in points.items())


def _allreduce_curve(path: Path, tp: int) -> Curve:
    rows = _read_csv(path, ("num_workers", "devices_per_node", "size", "time_stats.all_reduce.median"))
    points: dict[int, list[float]] = defaultdict(list)
    for row in rows:
        if _int(row, "num_workers", path) == tp and _int(row, "devices_per_node", path) == tp:
            points[_int(row, "size", path)].append(_float(row, "time_stats.all_reduce.median", path) * _MS)
    if not points:
        raise ConfigError(f"{path}: no all-reduce rows for {tp} GPUs within one node")
    return Curve.from_points((size, statistics.median(ts)) for size, ts in points.items())


def _read_csv(path: Path, columns: Sequence[str]) -> list[dict[str, str]]:
    try:
        with path.open(newline="", encoding="utf-8") as f:
            reader = csv.DictReader(f)
            missing = [c for c in columns if c not in (reader.fieldnames or ())]
            if missing:
                raise ConfigError(f"{path}: not a Vidur profile, it lacks the column {missing[0]!r}")
            rows = list(reader)
    except (OSError, UnicodeDecodeError, csv.Error) as exc:
        raise ConfigError(f"{path}: cannot read the profile ({exc.__class__.__name__}: {exc})") from None
    if not rows:
        raise ConfigError(f"{path}: the profile has no rows")
    return rows


def _float(row: dict[str, str], column: str, path: str | Path) -> float:
    try:
        value = float(row[column])
    except (TypeError, ValueError):
        raise ConfigError(f"{path}: {column} is not a number ({row[column]!r})") from None
    if not value >= 0:
        raise ConfigError(f"{path}: {column} must be a time >= 0, got {row[column]!r}")
    return value


def _int(row: dict[str, str], column: str, path: str | Path) -> int:
    value = _float(row, column, path)
    if value != int(value):
        raise ConfigError(f"{path}: {column} must be a whole number, got {row[column]!r}")
    return int(value)
