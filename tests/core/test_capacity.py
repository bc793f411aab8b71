"""The capacity math reproduces the source document's figures."""

from __future__ import annotations

import pytest

from pdrouter.core.capacity import (
    blocks_for_tokens,
    check_utilization_against_quota,
    decode_tokens_per_s_bound,
    kv_bytes_for_context,
    kv_bytes_per_token,
    kv_pool_bytes,
    plan_capacity,
    pool_blocks_for_budget,
    quota_for_pool,
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
