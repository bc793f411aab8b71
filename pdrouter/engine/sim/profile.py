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

Times are interpolated linearly between profiled sizes; a size outside the table returns None, and
the caller falls back to the roofline. Nothing here imports numpy or torch.
"""

from __future__ import annotations

import bisect
import csv
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
        """One layer's profiled operators, summed, for ``tokens`` tokens; None outside the profile."""
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
