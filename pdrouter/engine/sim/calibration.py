"""How close a simulated GPU gets to its datasheet: utilization factors and fixed costs.

The timing model (:mod:`pdrouter.engine.sim.timing`) divides a step's FLOPs by ``peak × mfu`` and
its bytes by ``bandwidth × mbu``, then adds the fixed costs below. Each default is fitted to one
published measurement (each field says which); ``benchmarks/sim_fidelity.py`` compares the model
with them and with the measurements that were held out of the fit.

A file overrides any subset of the fields (JSON, or YAML for a ``.yaml``/``.yml`` suffix)::

    {"mbu": 0.8, "step_overhead_s": 0.002}

``Calibration.from_file`` refuses unknown keys, nulls, non-numbers, negative values and
utilizations outside (0, 1] with a one-line ``ConfigError`` naming the field and the file. In code,
``Calibration().with_overrides(mbu=0.8)`` (or ``dataclasses.replace``) derives a variant; both run
the same validation.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pdrouter.core.errors import ConfigError

_FRACTIONS = ("mfu", "mbu")
_UNIT_INTERVAL = ("serial_fraction",)
_POSITIVE = ("fp8_speedup",)


@dataclass(frozen=True)
class Calibration:
    """Utilization factors and fixed per-step costs of one engine on one kind of GPU.

    The defaults are fitted, one field per published measurement, by ``benchmarks/sim_fidelity.py
    --fit`` (rounded to two digits); the sources are cited there and in ``docs/simulation.md``.
    """

    mfu: float = 0.71
    """Fraction of peak FLOP/s a compute-bound step reaches. Fitted to TensorRT-LLM's first-token
    latency of Llama-2-7B, FP16, 2048 tokens on one A100 (133 ms; TensorRT-LLM
    ``docs/source/performance.md``, v0.5 figures)."""
    mbu: float = 0.66
    """Fraction of peak memory bandwidth a bandwidth-bound step reaches, before the fixed costs
    below. Fitted so that Llama-2-70B FP16 at batch 1 on 2×H100 (TP 2) shows the end-to-end MBU
    of 60% that Databricks measured on its TensorRT-LLM-based server ("LLM Inference Performance
    Engineering: Best Practices", 2023)."""
    step_overhead_s: float = 0.0016
    """Fixed cost of one engine step (scheduling, input preparation, sampling, launch gaps) that
    no roofline term covers. Fitted to vLLM's nightly latency test on one H200: Llama-3.1-8B,
    8 prompts of 32 tokens, 128 tokens each, 833 ms (Buildkite ``performance-benchmark`` build
    9515). Engine-specific: vLLM's own profile of v0.5.3 serving Llama-3-8B on an H100 found the
    API server and the scheduler taking 33% and 29% of the time (vLLM blog, "vLLM v0.6.0: 2.7x
    Throughput Improvement and 5x Latency Reduction", 2024)."""
    serial_fraction: float = 0.59
    """Fraction of the smaller of a step's compute and memory times that does not overlap with the
    larger one: the step's roofline time is ``max(c, m) + serial_fraction × min(c, m)`` (0: perfect
    overlap, the plain roofline; 1: none). It matters where the two are close: short prefills and
    large decode batches. Fitted to TensorRT-LLM's first-token latency of Llama-2-7B, FP16, 128
    tokens on one A100 (16 ms; the same v0.5 table as ``mfu``)."""
    per_seq_overhead_s: float = 0.0
    """Additional cost per sequence in the step. No published figure isolates it from the step
    overhead; 0 by default, set it from a profile of the engine being modeled."""
    allreduce_latency_s: float = 8.8e-6
    """Fixed latency of one tensor-parallel all-reduce, added to its bandwidth term. Fitted to
    NVIDIA NIM 1.8.0's inter-token latency of Llama-3.3-70B FP8 on 2×H100 (TP 2) at concurrency
    1, 500 prompt / 2000 output tokens: 18.91 ms (NIM benchmarking guide, "Performance")."""
    fp8_speedup: float = 1.4
    """Compute speedup of FP8 weights over BF16 on GPUs with FP8 tensor cores (elsewhere FP8
    weights compute at the BF16 rate). The datasheets' peak ratio is 2; end to end it is less,
    as attention and the elementwise kernels stay in BF16. Fitted to the same NIM table's time to
    first token for a 5000-token prompt: 406.77 ms."""

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            _check_value(f.name, getattr(self, f.name))

    def with_overrides(self, **overrides: Any) -> Calibration:
        """A copy with some fields replaced (validated like a file); ConfigError for unknown names."""
        unknown = sorted(set(overrides) - _field_names())
        if unknown:
            raise ConfigError(f"unknown calibration field {unknown[0]!r}; fields: {', '.join(sorted(_field_names()))}")
        return dataclasses.replace(self, **overrides)

    @classmethod
    def from_mapping(cls, data: Any, source: str = "calibration") -> Calibration:
        """Build from a parsed mapping (all keys optional); ``source`` names it in error messages."""
        if not isinstance(data, dict):
            raise ConfigError(f"{source}: a calibration must be a mapping of field to number, "
                              f"got {type(data).__name__}")
        known = _field_names()
        for key, value in data.items():
            if key not in known:
                raise ConfigError(f"{source}: unknown calibration field {key!r}; fields: "
                                  f"{', '.join(sorted(known))}")
            try:
                _check_value(str(key), value)
            except ConfigError as exc:
                raise ConfigError(f"{source}: {exc.message}") from None
        return cls(**{key: float(value) for key, value in data.items()})

    @classmethod
    def from_file(cls, path: str | Path) -> Calibration:
        """Read a JSON file, or YAML for a ``.yaml``/``.yml`` suffix; ConfigError naming the file."""
        p = Path(path)
        try:
            text = p.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise ConfigError(f"{p}: cannot read the calibration file ({exc.__class__.__name__}: {exc})") from None
        if p.suffix.lower() in (".yaml", ".yml"):
            import yaml

            try:
                data = yaml.safe_load(text)
            except yaml.YAMLError as exc:
                raise ConfigError(f"{p}: not valid YAML ({' '.join(str(exc).split())})") from None
        else:
            try:
                data = json.loads(text)
            except json.JSONDecodeError as exc:
                raise ConfigError(f"{p}: not valid JSON ({exc})") from None
        return cls.from_mapping({} if data is None else data, source=str(p))


def _field_names() -> set[str]:
    return {f.name for f in dataclasses.fields(Calibration)}


def _check_value(name: str, value: Any) -> None:
    """One field's value: a finite number >= 0; (0, 1] for the utilizations; > 0 for the FP8 speedup."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        shown = "null" if value is None else repr(value)
        raise ConfigError(f"calibration field {name!r} must be a number, got {shown}")
    if not math.isfinite(value):
        raise ConfigError(f"calibration field {name!r} must be finite, got {value}")
    if name in _UNIT_INTERVAL and not 0.0 <= value <= 1.0:
        raise ConfigError(f"calibration field {name!r} must be in [0, 1], got {value}")
    if name in _FRACTIONS and not 0.0 < value <= 1.0:
        raise ConfigError(f"calibration field {name!r} must be in (0, 1], got {value}")
    if name in _POSITIVE and value <= 0:
        raise ConfigError(f"calibration field {name!r} must be > 0, got {value}")
    if value < 0:
        raise ConfigError(f"calibration field {name!r} must be >= 0, got {value}")
