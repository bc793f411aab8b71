"""The timing model reproduces the roofline arithmetic: decode ceiling, the knee, prefill FLOPs, TP."""

from __future__ import annotations

import dataclasses
import subprocess
import sys

import pytest

from pdrouter.core.capacity import decode_tokens_per_s_bound, kv_bytes_per_token, weight_bytes_per_rank
from pdrouter.core.errors import ConfigError
from pdrouter.core.gpu import get_gpu_preset
from pdrouter.core.model_spec import get_model_preset
from pdrouter.engine.sim.calibration import Calibration
from pdrouter.engine.sim.timing import SeqWork, TimingModel

H100 = get_gpu_preset("h100")
A100 = get_gpu_preset("a100")
L70 = get_model_preset("llama-3-70b")
L8 = get_model_preset("llama-3-8b")
IDEAL = Calibration(mfu=1.0, mbu=1.0, step_overhead_s=0.0, per_seq_overhead_s=0.0, allreduce_latency_s=0.0,
                    serial_fraction=0.0)


def _l8_non_embedding_params() -> int:
    """Llama-3-8B's layers and final norm, from its config.json figures."""
    h, q, kv, inter = 4096, 32 * 128, 8 * 128, 14336
    per_layer = h * q + 2 * h * kv + q * h + 3 * h * inter + 2 * h
    return 32 * per_layer + h


def _l8_attention_flops(new: int, cached: int) -> float:
    """4 × layers × heads × head_dim × Σ keys, position p attending to p + 1 keys."""
    keys = sum(p + 1 for p in range(cached, cached + new))
    return 4.0 * 32 * 32 * 128 * keys


def test_70b_bf16_batch_1_on_h100_is_bandwidth_over_weights() -> None:
    model = TimingModel(L70, H100, calibration=IDEAL)
    tps = model.decode_tokens_per_s(1, 16)
    read = L70.weight_bytes - L70.vocab_size * L70.hidden_size * 2  # the embedding gather is not counted
    assert tps == pytest.approx(3.35e12 / read, rel=0.005)
    assert 23.0 <= tps <= 24.5
    # The admission's ceiling reads the embedding table too (1.5% of the weights).
    assert tps == pytest.approx(decode_tokens_per_s_bound(L70, H100), rel=0.02)
    assert not model.decode_step(1, 16).compute_bound


def test_decode_throughput_is_linear_then_flat_with_the_knee_at_the_ridge_point() -> None:
    model = TimingModel(L70, H100, calibration=IDEAL)
    batches = sorted({2**k for k in range(11)} | {3, 6, 12, 24, 48, 96, 200, 300, 400, 600, 800})
    tps = {b: model.decode_tokens_per_s(b, 16) for b in batches}
    for b in (1, 2, 4, 8, 16, 32, 64):
        assert 1.95 <= tps[2 * b] / tps[b] <= 2.0
    for b in (600, 800):
        assert tps[1024] / tps[b] == pytest.approx(1.0, abs=0.01)
    assert tps[1024] / tps[512] == pytest.approx(1.0, abs=0.01)
    knee = next(b for b in range(1, 1025) if model.decode_step(b, 16).compute_bound)
    assert abs(knee - H100.ridge_point) <= 0.15 * H100.ridge_point
    assert not model.decode_step(knee - 1, 16).compute_bound


def test_4k_prefill_of_8b_is_compute_bound_at_2_params_per_token() -> None:
    mfu = 0.5
    model = TimingModel(L8, H100, calibration=dataclasses.replace(IDEAL, mfu=mfu))
    cost = model.prefill(4096)
    head = 2.0 * 4096 * 128256  # the LM head for the one sampled token
    flops = 2.0 * _l8_non_embedding_params() * 4096 + _l8_attention_flops(4096, 0) + head
    assert model.body_params == _l8_non_embedding_params()
    assert cost.flops == pytest.approx(flops, rel=1e-12)
    assert cost.seconds == pytest.approx(flops / (989e12 * mfu), rel=1e-12)
    assert cost.compute_bound and cost.memory_s < cost.compute_s / 10


def test_a_prefix_hit_saves_the_cached_tokens_flops() -> None:
    mfu = 0.6
    model = TimingModel(L8, H100, calibration=dataclasses.replace(IDEAL, mfu=mfu))
    full, hit = model.prefill(4096), model.prefill(4096, cached=2048)
    assert hit.compute_bound and full.compute_bound
    saved = 2.0 * _l8_non_embedding_params() * 2048 + _l8_attention_flops(4096, 0) - _l8_attention_flops(2048, 2048)
    assert saved == pytest.approx(_l8_attention_flops(2048, 0) + 2.0 * _l8_non_embedding_params() * 2048)
    assert full.seconds - hit.seconds == pytest.approx(saved / (989e12 * mfu), rel=1e-9)


def test_tp2_halves_the_weights_per_rank_and_adds_the_all_reduces() -> None:
    cal = dataclasses.replace(IDEAL, allreduce_latency_s=10e-6)
    one, two = TimingModel(L70, H100, calibration=cal), TimingModel(L70, H100, tp=2, calibration=cal)
    assert two.body_bytes + two.head_bytes == pytest.approx((one.body_bytes + one.head_bytes) / 2, rel=1e-9)
    assert two.body_bytes + two.head_bytes == pytest.approx(
        weight_bytes_per_rank(L70, 2) - L70.vocab_size * L70.hidden_size * 2 / 2, rel=1e-12)
    assert two.kv_bytes_per_token == kv_bytes_per_token(L70, 2) == one.kv_bytes_per_token // 2
    a, b = one.decode_step(8, 1000), two.decode_step(8, 1000)
    assert b.memory_s == pytest.approx(a.memory_s / 2, rel=1e-6)
    assert a.comm_s == 0.0
    ring = 2 * (2 - 1) / 2 * (8 * 8192 * 2) / (900e9 / 2)
    assert b.comm_s == pytest.approx(2 * 80 * (ring + 10e-6), rel=1e-12)
    assert b.seconds == pytest.approx(b.memory_s + b.comm_s, rel=1e-12)


def test_tp_all_reduces_run_over_the_gpus_interconnect() -> None:
    cal = dataclasses.replace(IDEAL, allreduce_latency_s=0.0)
    fast_link = dataclasses.replace(H100, interconnect_bytes_per_s=2 * H100.interconnect_bytes_per_s)
    normal = TimingModel(L70, H100, tp=4, calibration=cal).prefill(4096).comm_s
    faster = TimingModel(L70, fast_link, tp=4, calibration=cal).prefill(4096).comm_s
    assert faster == pytest.approx(normal / 2, rel=1e-12)
    assert normal == pytest.approx(2 * 80 * 2 * 3 / 4 * 4096 * 8192 * 2 / 450e9, rel=1e-12)
    with pytest.raises(ConfigError, match="interconnect"):
        TimingModel(L70, dataclasses.replace(H100, interconnect_bytes_per_s=0.0), tp=2)


def test_overheads_are_per_step_and_per_sequence() -> None:
    cal = dataclasses.replace(IDEAL, step_overhead_s=0.001, per_seq_overhead_s=0.0001)
    model = TimingModel(L8, H100, calibration=cal)
    cost = model.decode_step(10, 100)
    assert cost.overhead_s == pytest.approx(0.002)
    assert cost.seconds == pytest.approx(max(cost.compute_s, cost.memory_s) + 0.002)
    assert model.step([]).seconds == 0.0 and model.decode_step(0, 100).seconds == 0.0


def test_a_mixed_batch_sums_its_sequences() -> None:
    model = TimingModel(L8, H100)
    assert model.step([SeqWork(1, 100)] * 3) == model.decode_step(3, 100)
    mixed = model.step([SeqWork(1, 100), SeqWork(256, 0)])
    alone = [model.step([SeqWork(1, 100)]), model.step([SeqWork(256, 0)])]
    assert mixed.flops == pytest.approx(sum(c.flops for c in alone))
    # The weights are read once for the whole batch; the decoding sequence adds its KV: 100 cached
    # and 1 new token read, 1 written.
    assert mixed.bytes == pytest.approx(alone[1].bytes + (100 + 1 + 1) * model.kv_bytes_per_token, rel=1e-12)


def test_a_chunk_that_samples_nothing_skips_the_lm_head() -> None:
    model = TimingModel(L8, H100)
    sampled, chunk = model.step([SeqWork(512, 0)]), model.step([SeqWork(512, 0, samples=False)])
    assert sampled.flops - chunk.flops == pytest.approx(2.0 * 4096 * 128256)
    assert sampled.bytes - chunk.bytes == pytest.approx(128256 * 4096 * 2)


def test_fp8_weights_halve_the_bytes_and_use_the_fp8_rate_where_the_gpu_has_one() -> None:
    cal = dataclasses.replace(IDEAL, fp8_speedup=1.5)
    bf16, fp8 = TimingModel(L8, H100, calibration=cal), TimingModel(L8.with_dtype("fp8"), H100, calibration=cal)
    assert fp8.body_bytes == pytest.approx(bf16.body_bytes / 2, rel=1e-9)
    assert fp8.kv_bytes_per_token == bf16.kv_bytes_per_token // 2
    assert fp8.peak_flops == pytest.approx(989e12 * 1.5)
    assert TimingModel(L8.with_dtype("fp8"), A100, calibration=cal).peak_flops == pytest.approx(312e12)
    fp8_bf16_kv = TimingModel(L8.with_dtype("fp8"), H100, calibration=cal, kv_dtype="bf16")
    assert fp8_bf16_kv.kv_bytes_per_token == bf16.kv_bytes_per_token


def test_bad_work_is_refused() -> None:
    model = TimingModel(L8, H100)
    with pytest.raises(ValueError):
        SeqWork(0, 5)
    with pytest.raises(ValueError):
        SeqWork(1, -1)
    with pytest.raises(ValueError):
        model.prefill(100, cached=100)
    with pytest.raises(ValueError):
        model.decode_tokens_per_s(0, 10)
    with pytest.raises(ConfigError):
        TimingModel(L8, H100, tp=3)
    with pytest.raises(ConfigError):
        TimingModel(L8, H100, tp=0)


def test_the_sim_modules_import_no_torch() -> None:
    code = ("import sys\n"
            "import pdrouter.engine.sim.timing, pdrouter.engine.sim.calibration, pdrouter.engine.sim.link\n"
            "heavy = [m for m in ('torch', 'numpy', 'grpc', 'redis', 'yaml') if m in sys.modules]\n"
            "assert not heavy, heavy\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
