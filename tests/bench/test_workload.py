"""Workloads: length distributions, synthetic and shared-prefix prompts, JSONL traces, presets."""

from __future__ import annotations

import json
import math
import random
import statistics
from pathlib import Path

import pytest

from pdrouter.bench.workload import (
    PRESETS,
    LengthDist,
    PointSource,
    RequestSpec,
    Workload,
    expected_hit_rate,
    from_jsonl,
    nonce,
    preset,
    read_trace,
    shared_prefix,
    synthetic,
)
from pdrouter.core.errors import ConfigError


@pytest.mark.parametrize(("text", "expected"), [
    ("512", LengthDist("fixed", 512)),
    (" 512 ", LengthDist("fixed", 512)),
    ("100-1000", LengthDist("uniform", 100, 1000)),
    ("7-7", LengthDist("uniform", 7, 7)),
    ("lognormal:1000:0.5", LengthDist("lognormal", 1000, 0.5)),
    ("lognormal:1000:0.5:4000", LengthDist("lognormal", 1000, 0.5, 4000)),
    ("lognormal:12.5:0", LengthDist("lognormal", 12.5, 0)),
])
def test_parse_reads_every_form(text: str, expected: LengthDist) -> None:
    assert LengthDist.parse(text, "--input-len") == expected


@pytest.mark.parametrize("text", ["512", "100-1000", "lognormal:1000:0.5", "lognormal:1000:0.5:4000"])
def test_str_reads_back(text: str) -> None:
    assert str(LengthDist.parse(text, "--input-len")) == text


@pytest.mark.parametrize(("text", "fragment"), [
    ("", "expected N, LO-HI or lognormal:MEAN:SIGMA"),
    ("abc", "expected N, LO-HI or lognormal:MEAN:SIGMA"),
    ("1.5", "expected N, LO-HI or lognormal:MEAN:SIGMA"),
    ("normal:5:1", "expected N, LO-HI or lognormal:MEAN:SIGMA"),
    ("0", "must be >= 1 token"),
    ("-5", "must be >= 1 token"),
    ("0-5", "must be >= 1 token"),
    ("10-5", "LO must not exceed HI"),
    ("lognormal:100", "expected lognormal:MEAN:SIGMA[:MAX]"),
    ("lognormal:100:1:2:3", "expected lognormal:MEAN:SIGMA[:MAX]"),
    ("lognormal:x:1", "expected a number"),
    ("lognormal:100:1:2.5", "expected a whole number"),
    ("lognormal:0:0.5", "mean must be > 0"),
    ("lognormal:-3:0.5", "mean must be > 0"),
    ("lognormal:100:-1", "sigma must be >= 0"),
    ("lognormal:nan:1", "finite"),
    ("lognormal:100:0.5:0", "maximum length must be >= 1"),
])
def test_parse_errors_name_the_flag(text: str, fragment: str) -> None:
    with pytest.raises(ConfigError) as err:
        LengthDist.parse(text, "--output-len")
    assert err.value.message.startswith("--output-len: ")
    assert fragment in err.value.message


def test_direct_construction_is_checked_too() -> None:
    with pytest.raises(ConfigError, match="unknown length distribution 'zipf'"):
        LengthDist("zipf", 1)
    with pytest.raises(ConfigError, match="LO must not exceed HI"):
        LengthDist("uniform", 9, 3)


def test_fixed_sample_is_exact_and_draws_nothing() -> None:
    rng = random.Random(3)
    assert [LengthDist("fixed", 64).sample(rng) for _ in range(3)] == [64, 64, 64]
    assert rng.random() == random.Random(3).random()


def test_uniform_sample_covers_both_ends_inclusive() -> None:
    rng = random.Random(0)
    seen = {LengthDist("uniform", 3, 6).sample(rng) for _ in range(200)}
    assert seen == {3, 4, 5, 6}


def test_lognormal_sample_mean_is_the_given_mean() -> None:
    dist = LengthDist.parse("lognormal:1000:0.5", "--input-len")
    rng = random.Random(0)
    samples = [dist.sample(rng) for _ in range(20_000)]
    assert statistics.fmean(samples) == pytest.approx(1000, rel=0.02)
    # sigma of the underlying normal: the log-lengths spread by 0.5
    assert statistics.pstdev([math.log(s) for s in samples]) == pytest.approx(0.5, rel=0.03)


def test_lognormal_with_zero_sigma_is_its_mean() -> None:
    rng = random.Random(1)
    assert {LengthDist("lognormal", 40, 0).sample(rng) for _ in range(10)} == {40}


def test_samples_are_clipped_to_one_and_the_cap() -> None:
    rng = random.Random(2)
    wide = LengthDist("lognormal", 2, 3.0, cap=50)
    samples = [wide.sample(rng) for _ in range(2000)]
    assert min(samples) == 1
    assert max(samples) == 50


def test_mean() -> None:
    assert LengthDist("fixed", 512).mean == 512
    assert LengthDist("uniform", 100, 1000).mean == 550
    assert LengthDist("lognormal", 1000, 0.5).mean == 1000


def test_request_spec_input_tokens() -> None:
    assert RequestSpec(0, (5, 6, 7), 10).input_tokens == 3


def test_synthetic_is_deterministic_in_the_seed() -> None:
    a = synthetic(20, LengthDist("uniform", 5, 50), LengthDist("uniform", 1, 9), seed=7)
    assert a == synthetic(20, LengthDist("uniform", 5, 50), LengthDist("uniform", 1, 9), seed=7)
    assert a != synthetic(20, LengthDist("uniform", 5, 50), LengthDist("uniform", 1, 9), seed=8)


def test_synthetic_lengths_ids_and_indices() -> None:
    specs = synthetic(10, LengthDist("fixed", 100), LengthDist("fixed", 7), seed=0)
    assert [s.index for s in specs] == list(range(10))
    assert all(s.input_tokens == 100 and s.max_tokens == 7 for s in specs)
    assert all(s.arrival_s is None and s.prefix_group is None for s in specs)
    ids = {t for s in specs for t in s.prompt}
    assert min(ids) >= 32 and max(ids) <= 126
    assert len(ids) > 80  # spread over the range


def test_synthetic_custom_token_range_and_empty() -> None:
    specs = synthetic(3, LengthDist("fixed", 50), LengthDist("fixed", 1), seed=0, token_range=(1000, 1003))
    assert {t for s in specs for t in s.prompt} == {1000, 1001, 1002}
    assert synthetic(0, LengthDist("fixed", 5), LengthDist("fixed", 5), seed=0) == []


def test_synthetic_rejects() -> None:
    one = LengthDist("fixed", 1)
    with pytest.raises(ConfigError, match="--num-requests must be >= 0, got -1"):
        synthetic(-1, one, one, seed=0)
    for bad in ((5, 5), (-1, 5)):
        with pytest.raises(ConfigError, match="token range must satisfy 0 <= lo < hi"):
            synthetic(1, one, one, seed=0, token_range=bad)


def _rag(*, n: int = 12, **kw: object) -> list[RequestSpec]:
    args: dict[str, object] = {"prefixes": 3, "prefix_len": 40, "suffix_len": LengthDist("uniform", 5, 20),
                               "output_len": LengthDist("fixed", 8), "seed": 5} | kw
    return shared_prefix(n, **args)  # type: ignore[arg-type]


def test_shared_prefix_groups_round_robin_and_share_the_prefix() -> None:
    specs = _rag()
    assert [s.prefix_group for s in specs] == [0, 1, 2] * 4
    heads = {g: {s.prompt[:40] for s in specs if s.prefix_group == g} for g in range(3)}
    assert all(len(h) == 1 for h in heads.values())  # one prefix per group
    assert len({next(iter(h)) for h in heads.values()}) == 3  # groups differ
    assert all(5 <= s.input_tokens - 40 <= 20 and s.max_tokens == 8 for s in specs)
    assert all(32 <= t <= 126 for s in specs for t in s.prompt)
    # the suffixes are the requests' own
    assert len({s.prompt[40:] for s in specs}) == 12


def test_shared_prefix_is_deterministic_in_the_seed() -> None:
    assert _rag() == _rag()
    assert _rag() != _rag(seed=6)


def test_shared_prefix_prefixes_are_distinct_even_over_few_ids() -> None:
    specs = _rag(n=8, prefixes=4, prefix_len=2, token_range=(0, 2))
    assert len({s.prompt[:2] for s in specs}) == 4


@pytest.mark.parametrize(("kw", "fragment"), [
    ({"prefixes": 0}, "--prefixes must be >= 1"),
    ({"prefix_len": 0}, "--prefix-len must be >= 1"),
    ({"prefixes": 200, "prefix_len": 1}, "200 distinct prefixes of 1 tokens do not exist over 95 token ids"),
])
def test_shared_prefix_rejects(kw: dict[str, int], fragment: str) -> None:
    with pytest.raises(ConfigError, match=fragment):
        _rag(**kw)


def _write(tmp_path: Path, *lines: str) -> Path:
    path = tmp_path / "trace.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path


def test_jsonl_ids_lengths_defaults_and_blank_lines(tmp_path: Path) -> None:
    path = _write(tmp_path, json.dumps({"prompt_token_ids": [1, 2, 3], "output_len": 4}), "", "   ",
                  json.dumps({"input_len": 6, "note": "ignored"}),
                  json.dumps({"prompt_token_ids": [9, 9], "input_len": 2, "output_len": 1}))
    specs = from_jsonl(path, seed=0, default_output=33)
    assert [s.index for s in specs] == [0, 1, 2]
    assert specs[0] == RequestSpec(0, (1, 2, 3), 4)
    assert specs[1].input_tokens == 6 and specs[1].max_tokens == 33
    assert all(32 <= t <= 126 for t in specs[1].prompt)
    assert specs[2] == RequestSpec(2, (9, 9), 1)
    assert all(s.arrival_s is None for s in specs)
    assert from_jsonl(path, seed=0, default_output=33) == specs
    assert from_jsonl(path, seed=1, default_output=33)[1].prompt != specs[1].prompt


def test_jsonl_timestamps_are_sorted_and_start_at_zero(tmp_path: Path) -> None:
    path = _write(tmp_path, json.dumps({"prompt_token_ids": [1], "timestamp": 1700000002.5}),
                  json.dumps({"prompt_token_ids": [2], "timestamp": 1700000001.0}),
                  json.dumps({"prompt_token_ids": [3], "timestamp": 1700000004}),
                  json.dumps({"prompt_token_ids": [4], "timestamp": 1700000001.0}))
    specs = from_jsonl(path, seed=0)
    assert [s.prompt for s in specs] == [(2,), (4,), (1,), (3,)]  # stable: ties keep the file's order
    assert [s.arrival_s for s in specs] == [0.0, 0.0, 1.5, 3.0]
    assert [s.index for s in specs] == [0, 1, 2, 3]
    assert all(s.max_tokens == 128 for s in specs)


@pytest.mark.parametrize(("bad", "fragment"), [
    ("{not json", "bad JSON"),
    ("[1, 2]", "expected a JSON object, got list"),
    ('{"output_len": 5}', "give prompt_token_ids (a list of ids) or input_len"),
    ('{"input_len": 0}', "input_len must be >= 1, got 0"),
    ('{"input_len": 2.5}', "input_len must be an integer"),
    ('{"input_len": true}', "input_len must be an integer"),
    ('{"input_len": 5, "output_len": -1}', "output_len must be >= 1"),
    ('{"prompt_token_ids": []}', "non-empty list"),
    ('{"prompt_token_ids": "abc"}', "non-empty list"),
    ('{"prompt_token_ids": [1, "2"]}', "non-negative integers, got '2'"),
    ('{"prompt_token_ids": [1, -2]}', "non-negative integers, got -2"),
    ('{"prompt_token_ids": [1, 2], "input_len": 3}', "input_len 3 disagrees with the 2 prompt_token_ids"),
    ('{"input_len": 5, "timestamp": "noon"}', "timestamp must be a number"),
])
def test_jsonl_errors_name_the_file_and_line(tmp_path: Path, bad: str, fragment: str) -> None:
    path = _write(tmp_path, '{"input_len": 5}', "", bad)
    with pytest.raises(ConfigError) as err:
        from_jsonl(path, seed=0)
    assert err.value.message.startswith(f"{path}:3: ")
    assert fragment in err.value.message


def test_jsonl_timestamps_on_every_line_or_none(tmp_path: Path) -> None:
    path = _write(tmp_path, '{"input_len": 5, "timestamp": 1}', '{"input_len": 5, "timestamp": 2}',
                  '{"input_len": 5}')
    with pytest.raises(ConfigError, match=r":3: timestamp on some lines and not others \(lines 1 and 3\)"):
        from_jsonl(path, seed=0)


def test_jsonl_empty_or_missing_file(tmp_path: Path) -> None:
    path = _write(tmp_path, "", "  ")
    with pytest.raises(ConfigError, match="holds no requests") as err:
        from_jsonl(path, seed=0)
    assert str(path) in err.value.message
    with pytest.raises(ConfigError, match="cannot read the workload file"):
        from_jsonl(tmp_path / "absent.jsonl", seed=0)


def test_presets() -> None:
    chat_in, chat_out = preset("chat")
    assert (chat_in.kind, chat_in.mean, chat_out.mean) == ("lognormal", 1000, 300)
    assert preset("summarize") == (LengthDist("fixed", 7936), LengthDist("fixed", 200))
    assert preset("generate") == (LengthDist("fixed", 200), LengthDist("fixed", 2000))
    assert set(PRESETS) == {"chat", "summarize", "generate", "rag"}
    with pytest.raises(ConfigError, match="--workload: unknown preset 'nope' \\(choose from chat, summarize"):
        preset("nope")


def test_every_point_draws_prompts_of_its_own() -> None:
    chat = Workload("chat", "chat", LengthDist("lognormal", 300, 0.5), LengthDist("fixed", 4), seed=0)
    points = [chat.build(200, point) for point in range(6)]
    prompts = [s.prompt for specs in points for s in specs]
    assert len(set(prompts)) == len(prompts)
    assert len({p[:16] for p in prompts if len(p) >= 16}) == sum(len(p) >= 16 for p in prompts)  # first blocks too
    assert points[0] == chat.build(200, 0)  # still deterministic in (seed, point)
    assert expected_hit_rate(points[0]) == 0.0


def test_the_nonce_spells_the_point_and_the_index() -> None:
    assert nonce(0, 0, (32, 127)) == (32,) * 5
    assert nonce(0, 1, (32, 127)) == (32, 32, 32, 32, 33)
    seen = {nonce(p, i, (32, 127)) for p in (0, 1, 4095) for i in (0, 1, 94, 95, (1 << 20) - 1)}
    assert len(seen) == 15
    assert all(32 <= t < 127 for n in seen for t in n)
    assert len(nonce(3, 7, (0, 2))) == 32  # a narrow range spells it in more digits
    with pytest.raises(ConfigError, match="at most 4096 points"):
        nonce(4096, 0, (32, 127))


def test_shared_prefixes_are_the_same_in_every_point_and_nothing_else_is() -> None:
    rag = Workload("rag", "rag", LengthDist("fixed", 50), LengthDist("fixed", 4), seed=3, prefixes=2, prefix_len=64)
    a, b = rag.build(20, 0), rag.build(20, 1)
    assert {s.prompt[:64] for s in a} == {s.prompt[:64] for s in b} and len({s.prompt[:64] for s in a}) == 2
    assert not {s.prompt[64:] for s in a} & {s.prompt[64:] for s in b}
    assert all(s.shared_prefix_len == 64 for s in a)
    assert expected_hit_rate(a) == pytest.approx(64 / 114)


def test_a_trace_with_its_own_ids_is_dealt_out_without_resending(tmp_path: Path) -> None:
    path = _write(tmp_path, *(json.dumps({"prompt_token_ids": [i, i + 1, i + 2]}) for i in range(10)))
    rows = tuple(read_trace(path))
    source = PointSource(Workload("jsonl", "t", LengthDist("fixed", 1), LengthDist("fixed", 2), trace=rows))
    _, first = source.take(4)
    _, second = source.take(4)
    assert [s.prompt[0] for s in first] == [0, 1, 2, 3] and [s.prompt[0] for s in second] == [4, 5, 6, 7]
    with pytest.raises(ConfigError, match="no point resends a prompt"):
        source.take(4)
    with pytest.raises(ConfigError, match="3 points need 12"):
        PointSource(source.workload).check([4, 4, 4])
    lengths = Workload("jsonl", "t", LengthDist("fixed", 1), LengthDist("fixed", 2),
                       trace=tuple(read_trace(_write(tmp_path, *(json.dumps({"input_len": 40})
                                                                 for _ in range(5))))))
    fresh = PointSource(lengths)
    (_, a), (_, b) = fresh.take(5), fresh.take(5)  # lengths only: fresh ids, as often as asked
    assert not {s.prompt for s in a} & {s.prompt for s in b}
