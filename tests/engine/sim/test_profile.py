"""Measured mode: Vidur-format operator profiles, interpolated, with the roofline outside them."""

from __future__ import annotations

import csv
import dataclasses
import re
import statistics
from pathlib import Path

import pytest

from pdrouter.core.errors import ConfigError
from pdrouter.core.gpu import get_gpu_preset
from pdrouter.core.model_spec import ModelSpec
from pdrouter.engine.sim.calibration import Calibration
from pdrouter.engine.sim.profile import LAYER_OPS, Curve, OperatorProfile, read_allreduce_profile
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


NCCL_TESTS_HEADER = """\
# nThread 1 nGpus {ranks} minBytes 8 maxBytes 33554432 step: 2(factor) warmup iters: 5 iters: 20 agg iters: 1
#
# Using devices
{devices}
host-a:4242:4242 [0] NCCL INFO Bootstrap : Using eth0:10.0.0.2<0>
#
#                                                              out-of-place                       in-place
#       size         count      type   redop    root     time   algbw   busbw #wrong     time   algbw   busbw #wrong
#        (B)    (elements)                               (us)  (GB/s)  (GB/s)            (us)  (GB/s)  (GB/s)
"""


def _nccl_tests(path: Path, rows: str, ranks: int = 4, rank_lines: bool = True) -> Path:
    devices = "\n".join(f"#  Rank {r:2d} Group  0 Pid   4242 on     host-a device {r:2d} [0x{r + 1:02x}] NVIDIA L40S"
                        for r in range(ranks)) if rank_lines else "#"
    path.write_text(NCCL_TESTS_HEADER.format(ranks=ranks, devices=devices) + rows
                    + "# Out of bounds values : 0 OK\n# Avg bus bandwidth    : 14.6\n#\n")
    return path


NCCL_ROWS = """\
           8             2     float     sum      -1    30.10    0.00    0.00      0    29.80    0.00    0.00      0
     2097152        524288     float     sum      -1    150.0   13.98   20.97      0    149.0   14.07   21.11      0
    33554432       8388608     float     sum      -1   2200.0   15.25   22.88      0   2190.0   15.32   22.98      0
"""


def test_nccl_tests_output_is_a_collective_profile_of_the_host(tmp_path: Path) -> None:
    path = _nccl_tests(tmp_path / "ar.txt", NCCL_ROWS)
    curve = read_allreduce_profile(path, 4)
    assert curve.sizes == (8, 2097152, 33554432)
    assert curve.seconds == pytest.approx((30.1e-6, 150e-6, 2200e-6))  # the out-of-place times
    assert curve.at(2097152 * 2) == pytest.approx(150e-6 + (2200e-6 - 150e-6) * 2097152 / (33554432 - 2097152))
    # Alone, it changes the collectives only: the layers stay on the roofline (no operator profile).
    profile = OperatorProfile.load(4, collective=path)
    assert profile is not None and profile.ops == {} and profile.layer_time(128) is None
    spec = dataclasses.replace(LLAMA2_7B, num_kv_heads=8)
    l40s = get_gpu_preset("l40s")
    measured = TimingModel(spec, l40s, tp=4, profile=profile)
    preset = TimingModel(spec, l40s, tp=4)
    tokens = 256  # 256 × 4096 × 2 bytes = 2 MiB, a profiled size
    step, roofline = measured.prefill(tokens), preset.prefill(tokens)
    assert not step.measured and step.matmul_s == roofline.matmul_s
    gather = l40s.link.allgather_s(32000 * 2, 4)
    assert step.comm_s == pytest.approx(2 * 32 * 150e-6 + gather)
    assert roofline.comm_s == pytest.approx(2 * 32 * l40s.link.allreduce_s(tokens * 4096 * 2, 4) + gather)
    huge = 33554432 * 4
    assert measured.allreduce_s(huge) == l40s.link.allreduce_s(huge, 4)  # outside the sizes: the preset's
    # Repeated sizes (two runs in one file) take the median; a file of threads × GPUs without rank lines counts them.
    twice = _nccl_tests(tmp_path / "twice.txt", NCCL_ROWS + NCCL_ROWS.replace("150.0", "170.0")
                        + NCCL_ROWS.replace("150.0", "160.0"), ranks=2, rank_lines=False)
    assert read_allreduce_profile(twice, 2).at(2097152) == pytest.approx(160e-6)


def test_a_collective_profile_replaces_the_folders_and_vidurs_file_serves_alone(tmp_path: Path) -> None:
    nccl = _nccl_tests(tmp_path / "ar.txt", NCCL_ROWS, ranks=2)
    both = OperatorProfile.load(2, VIDUR, nccl)
    folder = OperatorProfile.from_dir(VIDUR, 2)
    assert both is not None and both.ops == folder.ops and both.allreduce == read_allreduce_profile(nccl, 2)
    alone = OperatorProfile.load(2, collective=VIDUR / "all_reduce.csv")
    assert alone is not None and alone.allreduce == folder.allreduce and alone.ops == {}
    assert OperatorProfile.load(2) is None


def _row(redop: str = "sum", count: str = "262144", root: str = "-1", time: str = "80.0") -> str:
    """One all_reduce_perf result row of 1 MiB (out of place, then in place)."""
    return f"     1048576 {count:>13} float {redop:>7} {root:>7} {time:>8}  13.1  11.5  0  79.0  13.2  11.6  0\n"


@pytest.mark.parametrize(("rows", "ranks", "tp", "expected"), [
    (NCCL_ROWS, 4, 8, "measured over 4 GPUs; the worker runs at TP 8"),
    (_row(redop="none"), 4, 4, "not an all-reduce"),
    (_row(count="65536"), 4, 4, "are not 1048576 bytes on each rank"),
    (_row(root="0"), 4, 4, "not an all-reduce"),
    (_row(time="N/A"), 4, 4, "the time 'N/A' is not a number"),
    (_row(time="0.0"), 4, 4, "must be > 0 microseconds"),
    ("host-a: Test NCCL failure common.cu:1005 'unhandled system error'\n", 4, 4, "no result rows"),
    (NCCL_ROWS, 4, 1, "runs no all-reduce; it needs --tp > 1"),
])
def test_bad_collective_profiles_are_refused_with_the_file_and_the_reason(
        tmp_path: Path, rows: str, ranks: int, tp: int, expected: str) -> None:
    path = _nccl_tests(tmp_path / "ar.txt", rows, ranks=ranks)
    with pytest.raises(ConfigError, match=re.escape(expected)) as err:
        read_allreduce_profile(path, tp)
    assert str(path) in err.value.message


def test_a_collective_profile_that_is_neither_format_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read the collective profile"):
        read_allreduce_profile(tmp_path / "missing.txt", 2)
    (tmp_path / "notes.txt").write_text("all-reduce was fast\n")
    with pytest.raises(ConfigError, match="not a Vidur profile"):
        read_allreduce_profile(tmp_path / "notes.txt", 2)
    (tmp_path / "headless.txt").write_text("#  size  count  type  redop  root  time (out-of-place)\n" + NCCL_ROWS)
    with pytest.raises(ConfigError, match="does not say over how many GPUs"):
        read_allreduce_profile(tmp_path / "headless.txt", 2)
