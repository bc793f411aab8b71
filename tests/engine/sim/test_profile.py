"""Measured mode: Vidur-format operator profiles, interpolated, with the roofline outside them."""

from __future__ import annotations

import csv
import dataclasses
import statistics
from pathlib import Path

import pytest

from pdrouter.core.errors import ConfigError
from pdrouter.core.gpu import get_gpu_preset
from pdrouter.core.model_spec import ModelSpec
from pdrouter.engine.sim.calibration import Calibration
from pdrouter.engine.sim.profile import LAYER_OPS, Curve, OperatorProfile
from pdrouter.engine.sim.timing import TimingModel

VIDUR = Path(__file__).resolve().parents[3] / "benchmarks" / "data" / "vidur" / "h100_llama2_7b"
H100 = get_gpu_preset("h100")
LLAMA2_7B = ModelSpec(name="llama-2-7b", num_layers=32, hidden_size=4096, num_heads=32, num_kv_heads=32, head_dim=128,
                      intermediate_size=11008, vocab_size=32000, max_context=4096)


def _published(tp: int, tokens: int, op: str) -> float:
    """The published seconds of one operator: the median of the file's rows for that size (some repeat)."""
    with (VIDUR / "mlp.csv").open(newline="") as f:
        times = [float(r[f"time_stats.{op}.median"]) * 1e-3 for r in csv.DictReader(f)
                 if int(r["num_tensor_parallel_workers"]) == tp and int(r["num_tokens"]) == tokens]
    return statistics.median(times)


def test_the_profile_gives_back_the_published_operator_times() -> None:
    profile = OperatorProfile.from_dir(VIDUR, 1)
    for tokens in (1, 128, 512, 4096):
        for op in LAYER_OPS:
            assert profile.op_time(op, tokens) == pytest.approx(_published(1, tokens, op))
        assert profile.layer_time(tokens) == pytest.approx(sum(_published(1, tokens, op) for op in LAYER_OPS))


def test_between_profiled_sizes_it_interpolates_and_outside_it_says_so() -> None:
    curve = Curve.from_points([(8, 1.0), (16, 3.0)])
    assert curve.at(12) == pytest.approx(2.0) and curve.at(8) == 1.0 and curve.at(16) == 3.0
    assert curve.at(7) is None and curve.at(17) is None
    profile = OperatorProfile.from_dir(VIDUR, 1)
    assert profile.layer_time(5000) is None and profile.op_time("add", 0.5) is None
    with pytest.raises(ValueError):
        Curve((2.0, 1.0), (1.0, 1.0))


def test_the_timing_model_uses_the_profile_inside_it_and_the_roofline_outside() -> None:
    profile = OperatorProfile.from_dir(VIDUR, 1)
    cal = Calibration()
    measured = TimingModel(LLAMA2_7B, H100, calibration=cal, profile=profile)
    roofline = TimingModel(LLAMA2_7B, H100, calibration=cal)
    inside = measured.prefill(1024)
    layer = profile.layer_time(1024)
    assert inside.measured and layer is not None
    head = roofline.prefill(1024)  # the LM head stays on the roofline: the matmuls less the layers' profile
    assert inside.matmul_s > 32 * layer and inside.elementwise_s == 0.0
    assert inside.attention_s == pytest.approx(head.attention_s) and inside.overhead_s == head.overhead_s
    outside = measured.prefill(5000)
    assert not outside.measured and outside == roofline.prefill(5000)


def test_a_collective_profile_replaces_the_all_reduce_formula_within_its_sizes() -> None:
    profile = OperatorProfile.from_dir(VIDUR, 2)
    assert profile.allreduce is not None
    model = TimingModel(dataclasses.replace(LLAMA2_7B), H100, tp=2, profile=profile)
    size = profile.allreduce.sizes[3]
    assert model.allreduce_s(size) == pytest.approx(profile.allreduce.seconds[3])
    huge = profile.allreduce.sizes[-1] * 2
    assert model.allreduce_s(huge) == pytest.approx(H100.link.allreduce_s(huge, 2, Calibration().allreduce_latency_s))
    with pytest.raises(ConfigError, match="TP 2"):
        TimingModel(LLAMA2_7B, H100, tp=4, profile=profile)


def _write(path: Path, header: list[str], rows: list[list[object]]) -> Path:
    with path.open("w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(header)
        writer.writerows(rows)
    return path


def test_bad_profiles_are_refused_with_the_file_and_the_reason(tmp_path: Path) -> None:
    header = ["num_tokens", "num_tensor_parallel_workers", *(f"time_stats.{op}.median" for op in LAYER_OPS)]
    good = [[n, 1, *([0.01] * len(LAYER_OPS))] for n in (1, 2)]
    with pytest.raises(ConfigError, match=r"needs mlp\.csv"):
        OperatorProfile.from_dir(tmp_path, 1)
    with pytest.raises(ConfigError, match=r"lacks the column 'time_stats\.add\.median'"):
        OperatorProfile.from_vidur(_write(tmp_path / "a.csv", header[:-1], [r[:-1] for r in good]), 1)
    with pytest.raises(ConfigError, match="no rows for TP 4; it profiles TP 1"):
        OperatorProfile.from_vidur(_write(tmp_path / "b.csv", header, good), 4)
    with pytest.raises(ConfigError, match="is not a number"):
        OperatorProfile.from_vidur(_write(tmp_path / "c.csv", header, [[1, 1, "fast", *good[0][3:]]]), 1)
    with pytest.raises(ConfigError, match="whole number"):
        OperatorProfile.from_vidur(_write(tmp_path / "d.csv", header, [[1.5, 1, *good[0][2:]]]), 1)
    with pytest.raises(ConfigError, match="no rows"):
        OperatorProfile.from_vidur(_write(tmp_path / "e.csv", header, []), 1)
    with pytest.raises(ConfigError, match="cannot read"):
        OperatorProfile.from_vidur(tmp_path / "missing.csv", 1)
    mlp = _write(tmp_path / "mlp.csv", header, [[n, 2, *([0.01] * len(LAYER_OPS))] for n in (1, 2)])
    columns = ["num_workers", "devices_per_node", "size", "time_stats.all_reduce.median"]
    collective = _write(tmp_path / "ar.csv", columns, [[2, 1, 1024, 0.01]])
    with pytest.raises(ConfigError, match="no all-reduce rows for 2 GPUs within one node"):
        OperatorProfile.from_vidur(mlp, 2, collective)
