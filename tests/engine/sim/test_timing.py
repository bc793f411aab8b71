"""The timing model reproduces the roofline arithmetic (decode ceiling, the knee, prefill FLOPs, TP) and puts
each cost where it arises (per layer, per graph-captured step, per collective, per expert)."""

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
NO_LATENCY = 1e-15
"""An all-reduce latency that rounds to nothing (0 means: the interconnect's own)."""
IDEAL = Calibration(mfu=1.0, mbu=1.0, kv_mbu=1.0, attention_mfu=1.0, step_overhead_s=0.0, decode_step_overhead_s=0.0,
                    layer_overhead_s=0.0, fp8_layer_overhead_s=0.0, decode_layer_overhead_s=0.0, per_seq_overhead_s=0.0,
                    allreduce_latency_s=NO_LATENCY, serial_fraction=0.0, activation_traffic=0.0)


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
    model = TimingModel(L8, H100, calibration=dataclasses.replace(IDEAL, mfu=mfu, attention_mfu=mfu))
    cost = model.prefill(4096)
    head = 2.0 * 4096 * 128256  # the LM head for the one sampled token
    flops = 2.0 * _l8_non_embedding_params() * 4096 + _l8_attention_flops(4096, 0) + head
    assert model.body_params == _l8_non_embedding_params()
    assert cost.flops == pytest.approx(flops, rel=1e-12)
    written = 4096 * model.kv_bytes_per_token / 3.35e12  # the new tokens' KV, written once
    assert cost.seconds == pytest.approx(flops / (989e12 * mfu) + written, rel=1e-12)
    assert cost.compute_bound and cost.memory_s < cost.compute_s / 10


def test_a_prefix_hit_saves_the_cached_tokens_flops() -> None:
    mfu = 0.6
    model = TimingModel(L8, H100, calibration=dataclasses.replace(IDEAL, mfu=mfu, attention_mfu=mfu))
    full, hit = model.prefill(4096), model.prefill(4096, cached=2048)
    assert hit.compute_bound and full.compute_bound
    saved = 2.0 * _l8_non_embedding_params() * 2048 + _l8_attention_flops(4096, 0) - _l8_attention_flops(2048, 2048)
    assert saved == pytest.approx(_l8_attention_flops(2048, 0) + 2.0 * _l8_non_embedding_params() * 2048)
    unwritten = 2048 * model.kv_bytes_per_token / 3.35e12
    assert full.seconds - hit.seconds == pytest.approx(saved / (989e12 * mfu) + unwritten, rel=1e-9)


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
    # Two ring all-reduces per layer of the 8 tokens' hidden states over NVLink 4's measured bus
    # bandwidth, each after the engine's latency; then the 8 rows of logits gathered.
    ring = 2 * (2 - 1) / 2 * (8 * 8192 * 2) / 350e9
    gather = (2 - 1) / 2 * (8 * 128256 * 2) / 350e9
    assert b.comm_s == pytest.approx(2 * 80 * (ring + 10e-6) + gather + 10e-6, rel=1e-12)
    assert b.seconds == pytest.approx(b.matmul_s + b.attention_s + b.comm_s, rel=1e-12)


def test_collectives_run_over_the_gpus_interconnect() -> None:
    cal = dataclasses.replace(IDEAL, allreduce_latency_s=NO_LATENCY)
    nvlink5 = dataclasses.replace(H100, interconnect="nvlink5")
    # 160 all-reduces and one gather, each paying the one-shot kernel's latency at 4 GPUs.
    latency = (2 * 80 + 1) * H100.link.collective_latency_s(4, NO_LATENCY)
    assert latency == pytest.approx(161 * 2 * H100.link.peer_latency_s, rel=1e-6)
    normal = TimingModel(L70, H100, tp=4, calibration=cal).prefill(4096).comm_s - latency
    faster = TimingModel(L70, nvlink5, tp=4, calibration=cal).prefill(4096).comm_s - latency
    assert faster == pytest.approx(normal / 2, rel=1e-9)
    assert normal == pytest.approx(2 * 80 * 2 * 3 / 4 * 4096 * 8192 * 2 / 350e9 + 3 / 4 * 128256 * 2 / 350e9,
                                   rel=1e-9)
    with pytest.raises(ConfigError, match="interconnect"):
        TimingModel(L70, dataclasses.replace(H100, interconnect_bytes_per_s=0.0), tp=2)
    with pytest.raises(ConfigError, match="unknown interconnect"):
        dataclasses.replace(H100, interconnect="carrier-pigeon")


def test_small_all_reduces_pay_the_engines_latency_over_nvlink_and_nccls_over_pcie() -> None:
    engine = dataclasses.replace(IDEAL, allreduce_latency_s=5e-6)
    nccl = dataclasses.replace(IDEAL, allreduce_latency_s=0.0)
    l40s = get_gpu_preset("l40s")
    assert TimingModel(L70, H100, tp=2, calibration=engine).allreduce_s(0.5) == pytest.approx(5e-6, rel=1e-6)
    assert TimingModel(L70, H100, tp=2, calibration=nccl).allreduce_s(0.5) == pytest.approx(H100.link.latency_s,
                                                                                           rel=1e-6)
    assert TimingModel(L70, l40s, tp=2, calibration=engine).allreduce_s(0.5) == pytest.approx(l40s.link.latency_s,
                                                                                              rel=1e-6)
    # The bus efficiency rises with the message: half of the bus bandwidth at s½.
    link, half = H100.link, H100.link.half_efficiency_bytes(8)
    assert 2 * 7 / 8 * half / link.allreduce_s(half, 8) == pytest.approx(link.bus_bytes_per_s / 2, rel=1e-9)
    assert link.allreduce_s(1e6, 1) == 0.0 and link.allgather_s(1e6, 1) == 0.0


def test_a_one_shot_all_reduce_pays_per_gpu_and_two_rounds_past_the_directly_linked_group() -> None:
    nvswitch, hcm = A100.link, get_gpu_preset("a100-80g-hcm").link
    peer = nvswitch.peer_latency_s
    assert peer > 0 and hcm.peer_latency_s == peer
    # Behind an NVSwitch every GPU is one hop away: the engine's latency at 2 GPUs, plus each further peer.
    assert [nvswitch.collective_latency_s(n, 10e-6) for n in (2, 4, 8)] == pytest.approx(
        [10e-6, 10e-6 + 2 * peer, 10e-6 + 6 * peer], rel=1e-12)
    # A hybrid cube mesh links each GPU to its quad's 3 others (and one relay): up to 4 GPUs it is the same,
    # at 8 the kernel sums its quad, then exchanges with the relay after a second signal round.
    assert hcm.collective_latency_s(4, 10e-6) == nvswitch.collective_latency_s(4, 10e-6)
    assert hcm.collective_latency_s(8, 10e-6) == pytest.approx(2 * (10e-6 + 2 * peer), rel=1e-12)
    # NCCL's latency is a measured intercept and stays as measured.
    assert hcm.collective_latency_s(8) == nvswitch.collective_latency_s(2) == nvswitch.latency_s
    # The bandwidth term is the same on both.
    assert hcm.allreduce_s(1e6, 8, 0.0) - hcm.collective_latency_s(8, 0.0) == pytest.approx(
        nvswitch.allreduce_s(1e6, 8, 0.0) - nvswitch.collective_latency_s(8, 0.0), rel=1e-12)
    cal = dataclasses.replace(IDEAL, allreduce_latency_s=8e-6)
    at8 = TimingModel(L70, get_gpu_preset("a100-80g-hcm"), tp=8, calibration=cal).decode_step(1, 10)
    switched = TimingModel(L70, A100, tp=8, calibration=cal).decode_step(1, 10)
    assert at8.comm_s - switched.comm_s == pytest.approx(161 * (2 * (8e-6 + 2 * peer) - (8e-6 + 6 * peer)), rel=1e-9)
    with pytest.raises(ConfigError, match="full_mesh_ranks"):
        dataclasses.replace(nvswitch, full_mesh_ranks=1)
    with pytest.raises(ConfigError, match="latencies"):
        dataclasses.replace(nvswitch, peer_latency_s=-1e-6)


def test_a_kernel_that_reads_the_kv_per_query_head_is_bound_by_the_l2_or_the_dram() -> None:
    cal = dataclasses.replace(IDEAL, kv_group_rereads=1.0)
    group = L70.num_heads // L70.num_kv_heads
    xqa, pre = TimingModel(L70, H100, calibration=IDEAL), TimingModel(L70, H100, calibration=cal)
    read = 64 * 2001 * xqa.kv_bytes_per_token
    # Every read goes through the L2, the DRAM serves each byte once: the kernel takes the longer of the two.
    assert xqa.decode_step(64, 2000).attention_s - pre.decode_step(64, 2000).attention_s == pytest.approx(
        read / H100.bandwidth_bytes_per_s - read * group / H100.l2_bandwidth_bytes_per_s, rel=1e-9)
    assert group / H100.l2_bandwidth_bytes_per_s > 1 / H100.bandwidth_bytes_per_s
    # The same DRAM bytes either way.
    assert pre.decode_step(64, 2000).bytes == xqa.decode_step(64, 2000).bytes
    # A GPU without an L2 figure: the re-reads are not what binds, the DRAM is.
    nol2 = dataclasses.replace(H100, l2_bandwidth_bytes_per_s=0.0)
    assert (TimingModel(L70, nol2, calibration=cal).decode_step(64, 2000).attention_s
            == xqa.decode_step(64, 2000).attention_s)
    # A group whose re-reads fit in the L2's headroom costs nothing more (A100: L2 3.5x its DRAM).
    pairs = dataclasses.replace(L70, num_kv_heads=L70.num_heads // 2)
    assert (TimingModel(pairs, A100, calibration=cal).decode_step(64, 2000).attention_s
            == TimingModel(pairs, A100, calibration=IDEAL).decode_step(64, 2000).attention_s)
    # Without groups (one KV head per query head) there is nothing to re-read.
    mha = dataclasses.replace(L8, num_kv_heads=L8.num_heads)
    assert (TimingModel(mha, H100, calibration=cal).decode_step(8, 500).seconds
            == TimingModel(mha, H100, calibration=IDEAL).decode_step(8, 500).seconds)
    with pytest.raises(ConfigError, match="must be >= 0"):
        dataclasses.replace(H100, l2_bandwidth_bytes_per_s=-1.0)


def test_a_grouped_kernel_built_for_one_group_size_leaves_the_others_to_the_per_head_kernel() -> None:
    eight = dataclasses.replace(IDEAL, kv_group_kernel_size=8)
    per_head = dataclasses.replace(IDEAL, kv_group_rereads=1.0)
    four = dataclasses.replace(L70, name="g4", num_kv_heads=L70.num_heads // 4)
    assert L70.num_heads // L70.num_kv_heads == 8
    # Groups of 8 get the grouped kernel, groups of 4 the per-query-head one.
    assert TimingModel(L70, H100, calibration=eight).kv_group_reread == 0.0
    assert TimingModel(four, H100, calibration=eight).kv_group_reread == 1.0
    assert (TimingModel(four, H100, calibration=eight).decode_step(64, 2000).seconds
            == TimingModel(four, H100, calibration=per_head).decode_step(64, 2000).seconds)
    assert (TimingModel(L70, H100, calibration=eight).decode_step(64, 2000).seconds
            == TimingModel(L70, H100, calibration=IDEAL).decode_step(64, 2000).seconds)
    # 0: the grouped kernel serves every size.
    assert TimingModel(four, H100, calibration=IDEAL).kv_group_reread == 0.0
    # A model without groups has nothing to re-read under any setting.
    mha = dataclasses.replace(L8, num_kv_heads=L8.num_heads)
    assert TimingModel(mha, H100, calibration=eight).kv_group_reread == 0.0


def test_a_per_head_kernel_that_computes_in_fp32_is_bound_by_its_conversions() -> None:
    cal = dataclasses.replace(IDEAL, kv_group_rereads=1.0, kv_convert_ops=1.0)
    fp8 = dataclasses.replace(L8, dtype="float8")
    group = fp8.num_heads // fp8.num_kv_heads
    model = TimingModel(fp8, H100, calibration=cal)
    plain = TimingModel(fp8, H100, calibration=dataclasses.replace(cal, kv_convert_ops=0.0))
    b, ctx = 120, 1100
    elements = b * (ctx + 1) * 2 * fp8.num_layers * fp8.num_kv_heads * fp8.head_dim
    convert_s = elements * group / H100.int_convert_per_s
    dram_s = b * (ctx + 1) * model.kv_bytes_per_token / H100.bandwidth_bytes_per_s
    # One FP8 byte an element: each of the group's 4 query heads converts it, at 16 a clock per SM.
    assert convert_s > dram_s
    step, base = model.decode_step(b, ctx), plain.decode_step(b, ctx)
    assert step.attention_s - base.attention_s == pytest.approx(
        convert_s - max(dram_s, group * dram_s * H100.bandwidth_bytes_per_s / H100.l2_bandwidth_bytes_per_s),
        rel=1e-9)
    # The same kernel on one KV head per query head converts each element once: the DRAM still binds.
    mha = dataclasses.replace(fp8, num_kv_heads=fp8.num_heads)
    assert (TimingModel(mha, H100, calibration=cal).decode_step(b, ctx).seconds
            == TimingModel(mha, H100, calibration=dataclasses.replace(cal, kv_convert_ops=0.0))
            .decode_step(b, ctx).seconds)
    # A prefill's attention is compute-bound: the decode kernel's conversions do not enter it.
    assert model.prefill(2048).seconds == plain.prefill(2048).seconds


def test_weight_only_8bit_weights_convert_each_weight_and_compute_at_the_16bit_rate() -> None:
    cal = dataclasses.replace(IDEAL, fp8_speedup=1.5, dequant_convert_ops=1.0)
    w8a16 = dataclasses.replace(L8, dtype="float8", weight_only=True)
    on_a100 = TimingModel(w8a16, A100, calibration=cal)
    plain = TimingModel(w8a16, A100, calibration=dataclasses.replace(cal, dequant_convert_ops=0.0))
    step = on_a100.decode_step(1, 100)
    # Batch 1 is bandwidth-bound; the conversions sit on the compute side: 1 instruction per weight byte.
    converted = (on_a100.body_bytes + on_a100.head_bytes) / A100.int_convert_per_s
    assert step.compute_s - plain.decode_step(1, 100).compute_s == pytest.approx(converted, rel=1e-9)
    assert A100.int_convert_per_s == pytest.approx(16 * 108 * 1.41e9)
    # FP8 tensor cores are not used for a weight-only format, nor is the FP8 per-layer cost paid.
    assert TimingModel(w8a16, H100, calibration=cal).peak_flops == pytest.approx(989e12)
    fp8cost = dataclasses.replace(cal, fp8_layer_overhead_s=3e-5)
    assert TimingModel(w8a16, H100, calibration=fp8cost).prefill(128).overhead_s == 0.0
    assert TimingModel(L8.with_dtype("fp8"), H100, calibration=fp8cost).prefill(128).overhead_s > 0
    # A format that is not weight-only converts nothing.
    assert (TimingModel(L8.with_dtype("fp8"), A100, calibration=cal).decode_step(1, 100).compute_s
            == pytest.approx(TimingModel(L8.with_dtype("fp8"), A100, calibration=IDEAL).decode_step(1, 100).compute_s))
    with pytest.raises(ConfigError, match="weight_only"):
        dataclasses.replace(L8, weight_only=True)


def test_overheads_are_per_step_per_layer_and_per_sequence_and_graphs_pay_less() -> None:
    cal = dataclasses.replace(IDEAL, step_overhead_s=0.001, decode_step_overhead_s=0.0002, layer_overhead_s=3e-5,
                              decode_layer_overhead_s=5e-6, per_seq_overhead_s=0.0001, graph_max_batch=16)
    model = TimingModel(L8, H100, calibration=cal)
    graph = model.decode_step(10, 100)
    assert graph.graph and graph.overhead_s == pytest.approx(0.0002 + 32 * 5e-6 + 10 * 0.0001)
    assert graph.seconds == pytest.approx(graph.matmul_s + graph.attention_s + graph.overhead_s)
    eager = model.decode_step(17, 100)  # more sequences than the captured graphs hold
    assert not eager.graph and eager.overhead_s == pytest.approx(0.001 + 32 * 3e-5 + 17 * 0.0001)
    prefill = model.prefill(128)  # prefills and mixed steps are never captured
    assert not prefill.graph and prefill.overhead_s == pytest.approx(0.001 + 32 * 3e-5 + 0.0001)
    mixed = model.step([SeqWork(1, 100), SeqWork(64, 0)])
    assert not mixed.graph
    no_graphs = TimingModel(L8, H100, calibration=dataclasses.replace(cal, graph_max_batch=0))
    assert not no_graphs.decode_step(1, 100).graph
    assert model.step([]).seconds == 0.0 and model.decode_step(0, 100).seconds == 0.0


def test_an_eager_host_that_launches_while_the_gpu_runs_costs_the_longer_of_the_two() -> None:
    host_bound = dataclasses.replace(IDEAL, step_overhead_s=0.0, layer_overhead_s=7e-4, graph_max_batch=0)
    added = TimingModel(L8, H100, calibration=host_bound)
    overlapped = TimingModel(L8, H100, calibration=dataclasses.replace(host_bound, host_overlap=1.0))
    half = TimingModel(L8, H100, calibration=dataclasses.replace(host_bound, host_overlap=0.5))
    for step in ([SeqWork(1, 1024)], [SeqWork(8192, 0)]):  # host-bound, then GPU-bound
        a, o, h = added.step(step), overlapped.step(step), half.step(step)
        gpu = a.seconds - a.overhead_s
        assert a.hidden_s == 0.0 and a.seconds == pytest.approx(gpu + 32 * 7e-4)
        assert o.seconds == pytest.approx(max(gpu, 32 * 7e-4)) and o.hidden_s == pytest.approx(min(gpu, 32 * 7e-4))
        assert h.seconds == pytest.approx((a.seconds + o.seconds) / 2)
    assert overlapped.decode_step(1, 1024).seconds == pytest.approx(32 * 7e-4)  # 22.4 ms of launches
    with pytest.raises(ConfigError, match="host_overlap"):
        dataclasses.replace(IDEAL, host_overlap=1.5)


def test_fp8_pays_its_quantization_kernels_per_layer_in_eager_steps() -> None:
    cal = dataclasses.replace(IDEAL, layer_overhead_s=2e-5, fp8_layer_overhead_s=3e-5)
    fp8, bf16 = TimingModel(L8.with_dtype("fp8"), H100, calibration=cal), TimingModel(L8, H100, calibration=cal)
    assert fp8.prefill(128).overhead_s == pytest.approx(32 * 5e-5)
    assert bf16.prefill(128).overhead_s == pytest.approx(32 * 2e-5)
    # Weight-only FP8 on a GPU without FP8 tensor cores has no quantized matmul to feed.
    assert TimingModel(L8.with_dtype("fp8"), A100, calibration=cal).prefill(128).overhead_s == pytest.approx(32 * 2e-5)


def test_elementwise_kernels_move_activations_per_token_and_layer() -> None:
    cal = dataclasses.replace(IDEAL, activation_traffic=1.0)
    model = TimingModel(L8, H100, calibration=cal)
    per_token = 32 * (10 * 4096 + 2 * (4096 + 1024) + 3 * 14336) * 2
    assert model.prefill(1000).elementwise_s == pytest.approx(1000 * per_token / 3.35e12, rel=1e-12)
    half = TimingModel(L8, H100, calibration=dataclasses.replace(cal, activation_traffic=0.5))
    assert half.prefill(1000).elementwise_s == pytest.approx(model.prefill(1000).elementwise_s / 2, rel=1e-12)


def test_decode_attention_reads_the_kv_at_its_own_efficiency() -> None:
    slow = TimingModel(L8, H100, calibration=dataclasses.replace(IDEAL, kv_mbu=0.5))
    fast = TimingModel(L8, H100, calibration=IDEAL)
    for batch, context in ((1, 8000), (64, 2000)):
        read = batch * (context + 1) * fast.kv_bytes_per_token / 3.35e12
        written = batch * fast.kv_bytes_per_token / 3.35e12
        assert fast.decode_step(batch, context).attention_s == pytest.approx(read + written, rel=1e-9)
        assert slow.decode_step(batch, context).attention_s == pytest.approx(2 * read + written, rel=1e-9)


def test_a_mixture_of_experts_reads_the_experts_its_tokens_route_to() -> None:
    moe = get_model_preset("mixtral-8x7b")
    model = TimingModel(moe, H100, calibration=IDEAL)
    assert moe.param_count > 3 * moe.active_param_count
    expert_bytes = 3 * 4096 * 14336 * 2
    assert model.expert_bytes == expert_bytes
    # One token reads its 2 experts per layer; 4 tokens the expected distinct ones; 256 (nearly) all 8.
    assert model._weight_bytes(1, 1)[1] == pytest.approx(32 * 2 * expert_bytes)
    assert model._weight_bytes(4, 1)[1] == pytest.approx(32 * 8 * (1 - (6 / 8) ** 4) * expert_bytes, rel=1e-12)
    assert model._weight_bytes(256, 1)[1] == pytest.approx(32 * 8 * expert_bytes, rel=1e-9)
    assert model.decode_step(256, 100).memory_s > 3 * model.decode_step(1, 100).memory_s
    # FLOPs: 2 per active parameter (2 experts of 8), the experts' at expert_efficiency of the dense rate.
    routed_flops = 2 * 32 * 2 * (3 * 4096 * 14336) * 4096
    assert model.prefill(4096).flops > routed_flops and model.active_body_params < model.body_params / 3
    slow = TimingModel(moe, H100, calibration=dataclasses.replace(IDEAL, expert_efficiency=0.5))
    gap = slow.prefill(4096).matmul_s - model.prefill(4096).matmul_s
    assert gap == pytest.approx(routed_flops / 989e12, rel=1e-6)


def test_identical_tokens_route_to_the_same_experts() -> None:
    """A benchmark whose prompts repeat one token id (and decode greedily) routes every token of a step to the
    same k experts: a 128-token prefill reads 2 experts per layer, not (nearly) all 8."""
    moe = get_model_preset("mixtral-8x7b")
    uniform = TimingModel(moe, A100, tp=2, calibration=IDEAL)
    identical = TimingModel(moe, A100, tp=2, calibration=IDEAL, routing="identical")
    assert identical._weight_bytes(128, 1)[1] == pytest.approx(32 * 2 * identical.expert_bytes)
    assert uniform._weight_bytes(128, 1)[1] == pytest.approx(32 * 8 * uniform.expert_bytes, rel=1e-9)
    assert identical._weight_bytes(1, 1) == uniform._weight_bytes(1, 1)
    assert identical.prefill(128).memory_s < 0.5 * uniform.prefill(128).memory_s
    # A dense model has no experts to route.
    assert TimingModel(L8, A100, routing="identical").prefill(128) == TimingModel(L8, A100).prefill(128)
    with pytest.raises(ConfigError, match="routing"):
        TimingModel(moe, A100, routing="random")


def test_legacy_expert_kernels_run_at_the_16_bit_legacy_rate() -> None:
    """Experts on previous-generation 16-bit grouped GEMMs: no FP8 speedup, and on Hopper 2/3 of its 16-bit
    peak (mma.sync); on an A100 that is its native rate."""
    moe = dataclasses.replace(get_model_preset("mixtral-8x7b"), dtype="float8")
    expert_flops = 2 * 32 * 2 * (3 * 4096 * 14336) * 2048 / 2
    fp8 = dataclasses.replace(IDEAL, fp8_speedup=2.0)
    legacy = dataclasses.replace(fp8, legacy_expert_kernels=1.0)
    native = TimingModel(moe, H100, tp=2, calibration=fp8, routing="identical")
    old = TimingModel(moe, H100, tp=2, calibration=legacy, routing="identical")
    assert H100.legacy_mma_fraction == pytest.approx(2 / 3) and A100.legacy_mma_fraction == 1.0
    gap = old.prefill(2048).compute_s - native.prefill(2048).compute_s
    assert gap == pytest.approx(expert_flops / (989e12 * 2 / 3) - expert_flops / (989e12 * 2), rel=1e-6)
    bf16 = get_model_preset("mixtral-8x7b")
    on_a100 = dataclasses.replace(IDEAL, legacy_expert_kernels=1.0)
    assert (TimingModel(bf16, A100, tp=2, calibration=on_a100).prefill(2048)
            == TimingModel(bf16, A100, tp=2, calibration=IDEAL).prefill(2048))


def test_a_mixture_of_experts_pays_its_routing_kernels_per_layer_in_every_step() -> None:
    moe = get_model_preset("mixtral-8x7b")
    base = TimingModel(moe, H100, tp=2, calibration=IDEAL)
    costed = TimingModel(moe, H100, tp=2, calibration=dataclasses.replace(IDEAL, expert_layer_overhead_s=5e-5))
    steps = ((costed.prefill(128), base.prefill(128)), (costed.decode_step(8, 100), base.decode_step(8, 100)))
    for cost, plain in steps:
        assert cost.overhead_s - plain.overhead_s == pytest.approx(32 * 5e-5)
    dense = dataclasses.replace(IDEAL, expert_layer_overhead_s=5e-5)
    assert TimingModel(L8, H100, calibration=dense).prefill(128) == TimingModel(L8, H100,
                                                                               calibration=IDEAL).prefill(128)


def test_a_mixed_batch_sums_its_sequences() -> None:
    model = TimingModel(L8, H100)
    assert model.step([SeqWork(1, 100)] * 3) == model.decode_step(3, 100)
    mixed = model.step([SeqWork(1, 100), SeqWork(256, 0)])
    alone = [model.step([SeqWork(1, 100)]), model.step([SeqWork(256, 0)])]
    assert mixed.flops == pytest.approx(sum(c.flops for c in alone))
    # The weights are read once for the whole batch; the decoding sequence adds its KV: 100 cached
    # and 1 new token read, 1 written.
    assert mixed.bytes == pytest.approx(alone[1].bytes + (100 + 1 + 1) * model.kv_bytes_per_token
                                        + model._act_bytes_per_token, rel=1e-12)


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


def test_the_engines_unchecked_step_of_triples_equals_the_step_of_seq_works() -> None:
    model = TimingModel(L70, H100, tp=4)
    batch = [SeqWork(1, 900), SeqWork(1, 20), SeqWork(512, 0, samples=False), SeqWork(300, 512)]
    assert model.step_of([(w.num_new_tokens, w.context_before, w.samples) for w in batch]) == model.step(batch)
    assert model.step_of([]) == model.step([])
    with pytest.raises(ValueError, match="num_new_tokens >= 1"):  # the checked path still checks
        SeqWork(0, 5)


def test_a_group_of_four_on_the_trtllm_preset_decodes_at_the_conversion_rate_on_hopper() -> None:
    """TensorRT-LLM 0.9 built XQA for groups of 8 only: Mistral-7B (groups of 4) with FP8 KV runs the
    per-query-head kernel, bound by its conversions, which an H100 and an H200 issue at the same rate;
    a model of one KV head per query head is bound by the DRAM, which the H200 has more of."""
    trt = Calibration.preset("trtllm")
    mistral = dataclasses.replace(get_model_preset("mistral-7b"), dtype="float8")
    mha = dataclasses.replace(mistral, num_kv_heads=mistral.num_heads)
    h200 = get_gpu_preset("h200")
    assert H100.int_convert_per_s == h200.int_convert_per_s and h200.bandwidth_bytes_per_s > H100.bandwidth_bytes_per_s

    def attention(spec: object, gpu: object) -> float:
        return TimingModel(spec, gpu, calibration=trt).decode_step(120, 1100).attention_s  # type: ignore[arg-type]

    assert attention(mistral, H100) == pytest.approx(attention(mistral, h200), rel=0.01)
    assert attention(mha, h200) < 0.8 * attention(mha, H100)
    # On an L40S (0.86 TB/s of DRAM) the same kernel's conversions hide under its DRAM reads.
    l40s = get_gpu_preset("l40s")
    model = TimingModel(mistral, l40s, calibration=trt)
    assert model.kv_group_reread == 1.0
    assert model.decode_step(120, 1100).attention_s == pytest.approx(
        TimingModel(mistral, l40s, calibration=dataclasses.replace(trt, kv_convert_ops=0.0)).decode_step(120, 1100)
        .attention_s, rel=1e-9)
