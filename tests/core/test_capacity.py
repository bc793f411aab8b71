"""The capacity math reproduces the source document's figures."""

from __future__ import annotations

import pytest

from pdrouter.core.capacity import (
    MemoryQuota,
    blocks_for_tokens,
    check_utilization_against_quota,
    decode_tokens_per_s_bound,
    kv_bytes_for_context,
    kv_bytes_per_token,
    kv_pool_bytes,
    memory_quota_from_env,
    parse_memory_size,
    plan_capacity,
    plan_tp,
    pool_blocks_for_budget,
    quota_for_pool,
    resolve_utilization,
    tp_sizes,
    utilization_from_quota,
)
from pdrouter.core.errors import ConfigError
from pdrouter.core.gpu import GiB, get_gpu_preset
from pdrouter.core.model_spec import get_model_preset

H100 = get_gpu_preset("h100")
L70 = get_model_preset("llama-3-70b")
L8 = get_model_preset("llama-3-8b")


def test_llama3_70b_bf16_is_320_kib_per_token() -> None:
    assert kv_bytes_per_token(L70) == 2 * 80 * 8 * 128 * 2 == 320 * 1024


def test_a_4k_request_on_70b_is_1_25_gib() -> None:
    assert kv_bytes_for_context(L70, 4096) == int(1.25 * GiB)


def test_tp_splits_kv_heads() -> None:
    assert kv_bytes_per_token(L70, tp=8) == 320 * 1024 // 8
    # More ranks than KV heads: heads are replicated, one per rank.
    assert kv_bytes_per_token(L70, tp=16) == 2 * 80 * 1 * 128 * 2


def test_single_stream_decode_bound_70b_on_h100_is_about_24_tok_s() -> None:
    bound = decode_tokens_per_s_bound(L70, H100)
    assert 23.0 <= bound <= 24.5


def test_llama3_8b_on_one_h100_serves_100_plus_4k_requests() -> None:
    plan = plan_capacity(L8, H100, context=4096, utilization=0.9)
    assert 100 <= plan.max_concurrency <= 130
    assert plan.kv_bytes_per_request == 512 * 1024 * 1024


def test_32b_class_model_on_one_h100_has_single_digit_concurrency() -> None:
    plan = plan_capacity(get_model_preset("qwen2.5-32b"), H100, context=4096, utilization=0.9)
    assert 1 <= plan.max_concurrency <= 9


def test_70b_needs_tp8_for_reasonable_concurrency() -> None:
    with pytest.raises(ConfigError, match="does not fit"):
        plan_capacity(L70, H100, context=4096, utilization=0.9)
    plan = plan_capacity(L70, H100, tp=8, context=4096, utilization=0.9)
    assert plan.max_concurrency >= 100


def test_plan_is_internally_consistent() -> None:
    plan = plan_capacity(L8, H100, context=4096, utilization=0.9)
    expected_pool = int(80 * GiB * 0.9) - L8.weight_bytes - 2 * GiB
    assert plan.kv_pool_bytes == expected_pool
    assert plan.num_blocks == expected_pool // (131072 * 16)
    assert plan.max_concurrency == plan.num_blocks // 256
    assert pool_blocks_for_budget(L8, 80 * GiB, 0.9, overhead_bytes=2 * GiB) == plan.num_blocks


def test_hami_quota_40_on_80_gives_half_and_refuses_0_9() -> None:
    assert utilization_from_quota(40 * GiB, 80 * GiB) == 0.5
    plan = plan_capacity(L8, H100, utilization=None, quota_bytes=40 * GiB)
    assert plan.utilization == 0.5
    with pytest.raises(ConfigError) as info:
        check_utilization_against_quota(0.9, 40 * GiB, 80 * GiB)
    assert "72.0 GiB exceeds the 40.0 GiB memory quota" in info.value.message
    assert "utilization <= 0.50" in info.value.message
    with pytest.raises(ConfigError):
        plan_capacity(L8, H100, utilization=0.9, quota_bytes=40 * GiB)
    # Both given and consistent: accepted.
    assert plan_capacity(L8, H100, utilization=0.5, quota_bytes=40 * GiB).utilization == 0.5


def test_quota_for_pool_is_weights_plus_pool_plus_overhead() -> None:
    assert quota_for_pool(L8, 10 * GiB) == L8.weight_bytes + 10 * GiB + 2 * GiB


@pytest.mark.parametrize("kwargs", [
    {"utilization": 0.0}, {"utilization": 1.5}, {"context": 0}, {"context": -5},
    {"tp": 0}, {"tp": 3}, {"block_size": 0},
])
def test_bad_inputs_are_config_errors(kwargs: dict[str, float]) -> None:
    args = {"utilization": 0.9, "context": 4096, "tp": 1, "block_size": 16} | kwargs
    with pytest.raises(ConfigError):
        plan_capacity(L8, H100, **args)  # type: ignore[arg-type]


def test_pool_errors_and_block_rounding() -> None:
    with pytest.raises(ConfigError):
        kv_pool_bytes(0, 0.9, 0)
    with pytest.raises(ConfigError):
        kv_pool_bytes(GiB, 0.9, 0, overhead_bytes=-1)
    assert blocks_for_tokens(0) == 0
    assert blocks_for_tokens(1) == 1
    assert blocks_for_tokens(16) == 1
    assert blocks_for_tokens(17) == 2


# -- the smallest TP that fits -------------------------------------------------------------------


def test_tp_sizes_are_the_powers_of_two_that_split_the_kv_heads() -> None:
    assert tp_sizes(L70) == (1, 2, 4, 8)
    assert tp_sizes(get_model_preset("qwen2.5-7b")) == (1, 2, 4)
    assert tp_sizes(get_model_preset("tiny")) == (1, 2)


def test_plan_tp_marks_what_does_not_fit_instead_of_failing() -> None:
    sizing = plan_tp(L70, H100, context=4096)
    assert [(o.tp, o.fits) for o in sizing.options] == [(1, False), (2, True), (4, True), (8, True)]
    assert sizing.requested.plan is None and "131.4 GiB weights" in sizing.requested.shortfall
    assert not sizing.fits and sizing.chosen is not None and sizing.chosen.tp == 2
    assert sizing.chosen.plan == plan_capacity(L70, H100, tp=2, context=4096)
    assert sizing.figures.kv_bytes_per_token == 320 * 1024
    assert sizing.figures.kv_bytes_per_request == int(1.25 * GiB)
    assert sizing.figures.decode_tokens_per_s_bound == decode_tokens_per_s_bound(L70, H100)
    # A wanted concurrency moves the answer: 256 requests of 4k tokens need TP 8.
    wanted = plan_tp(L70, H100, context=4096, min_concurrency=256)
    assert wanted.chosen is not None and wanted.chosen.tp == 8
    assert "holds 118 4096-token requests" in next(o for o in wanted.options if o.tp == 4).shortfall


def test_plan_tp_starts_at_the_requested_tp_and_may_find_none() -> None:
    sizing = plan_tp(L8, H100, tp=4)
    assert sizing.fits and sizing.chosen is not None and sizing.chosen.tp == 4
    none = plan_tp(L70, get_gpu_preset("l40s"), utilization=None, quota_bytes=8 * GiB)
    assert none.chosen is None and not any(o.fits for o in none.options) and none.utilization == 1 / 6
    with pytest.raises(ConfigError, match="does not divide"):
        plan_tp(L70, H100, tp=3)
    with pytest.raises(ConfigError, match=r"exceeds the 40\.0 GiB memory quota"):
        plan_tp(L8, H100, utilization=0.9, quota_bytes=40 * GiB)


# -- memory quotas from the environment ----------------------------------------------------------


@pytest.mark.parametrize(("text", "size"), [
    ("40g", 40 * GiB), ("40G", 40 * GiB), ("40960m", 40 * GiB), ("40960M", 40 * GiB), ("41943040k", 40 * GiB),
    (str(40 * GiB), 40 * GiB), ("40Gi", 40 * GiB), ("40GiB", 40 * GiB), (" 1.5g ", int(1.5 * GiB)), ("0", 0),
])
def test_memory_sizes_read_as_hami_reads_them(text: str, size: int) -> None:
    assert parse_memory_size(text) == size


@pytest.mark.parametrize("text", ["", "g", "forty", "-40g", "40x", "40 g b"])
def test_bad_memory_sizes_are_config_errors(text: str) -> None:
    with pytest.raises(ConfigError, match="is not a memory size"):
        parse_memory_size(text)


def test_the_device_s_own_limit_wins_over_the_shared_one() -> None:
    env = {"CUDA_DEVICE_MEMORY_LIMIT": "20g", "CUDA_DEVICE_MEMORY_LIMIT_1": "40960m"}
    assert memory_quota_from_env(env, 1) == MemoryQuota(40 * GiB, "CUDA_DEVICE_MEMORY_LIMIT_1=40960m")
    assert memory_quota_from_env(env, 0) == MemoryQuota(20 * GiB, "CUDA_DEVICE_MEMORY_LIMIT=20g")
    assert memory_quota_from_env({}, 0) is None
    assert memory_quota_from_env({"CUDA_DEVICE_MEMORY_LIMIT_0": "0"}, 0) is None  # HAMi: no limit
    assert memory_quota_from_env({"CUDA_DEVICE_MEMORY_LIMIT_0": " "}, 0) is None
    with pytest.raises(ConfigError, match=r"^CUDA_DEVICE_MEMORY_LIMIT_0: 'lots' is not a memory size"):
        memory_quota_from_env({"CUDA_DEVICE_MEMORY_LIMIT_0": "lots"}, 0)


def test_resolve_utilization_derives_checks_and_names_the_quota() -> None:
    source = "CUDA_DEVICE_MEMORY_LIMIT_0=40g"
    assert resolve_utilization(None, 40 * GiB, 80 * GiB, default=0.9, source=source) == 0.5
    assert resolve_utilization(0.4, 40 * GiB, 80 * GiB, source=source) == 0.4
    assert resolve_utilization(None, None, 80 * GiB, default=0.9) == 0.9
    with pytest.raises(ConfigError) as info:
        resolve_utilization(0.9, 40 * GiB, 80 * GiB, source=source)
    assert "exceeds the 40.0 GiB memory quota (CUDA_DEVICE_MEMORY_LIMIT_0=40g): " in info.value.message
    with pytest.raises(ConfigError, match=r"^CUDA_DEVICE_MEMORY_LIMIT_0=100g: memory quota 100\.0 GiB exceeds"):
        resolve_utilization(None, 100 * GiB, 80 * GiB, source="CUDA_DEVICE_MEMORY_LIMIT_0=100g")
    with pytest.raises(ConfigError, match="give a utilization or a memory quota"):
        resolve_utilization(None, None, 80 * GiB)
