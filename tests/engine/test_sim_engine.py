"""The simulated engine: the capacity math's pool, the modeled clock, pseudo-random tokens, prefix hits."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from pdrouter.cli.main import main
from pdrouter.core.capacity import plan_capacity
from pdrouter.core.errors import ConfigError, InvalidRequestError
from pdrouter.core.gpu import GiB, get_gpu_preset
from pdrouter.core.model_spec import get_model_preset
from pdrouter.core.sampling import SamplingParams
from pdrouter.core.tokens import PackedPrompt, pack_token_ids
from pdrouter.engine.batch_engine import SchedulingConfig
from pdrouter.engine.outputs import FinishReason
from pdrouter.engine.sim.calibration import Calibration
from pdrouter.engine.sim.config import SimEngineConfig
from pdrouter.engine.sim.engine import SimEngine
from pdrouter.engine.sim.model_step import SimModelStep
from pdrouter.engine.sim.timing import SeqWork, TimingModel

from .engine_testing import assert_no_leak, rid

LLAMA_8B = get_model_preset("llama-3-8b")
H100 = get_gpu_preset("h100")


def sim(**kw: object) -> SimEngine:
    kw.setdefault("time_scale", 0.0)
    return SimEngine(SimEngineConfig(spec=LLAMA_8B, gpu=H100, eos_token_ids=(128001,), **kw))  # type: ignore[arg-type]


def test_the_pool_is_what_pdrouter_capacity_prints(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["capacity", "--model", "llama-3-8b", "--gpu", "h100", "--utilization", "0.9", "--json"]) == 0
    printed = json.loads(capsys.readouterr().out)["num_blocks"]
    engine = sim()
    assert engine.kv_layout.num_blocks == printed == plan_capacity(LLAMA_8B, H100).num_blocks
    assert engine.kv_layout.kv_bytes_per_token == 128 * 1024  # 2 × 32 layers × 8 heads × 128 × 2 bytes
    # 8B on one H100 holds 100+ concurrent 4k requests (the source document's figure).
    assert engine.kv_layout.num_blocks // (4096 // 16) > 100


def test_a_memory_quota_sets_the_utilization() -> None:
    quota = 40 * GiB
    engine = sim(memory_quota_bytes=quota)
    assert engine.kv_layout.num_blocks == plan_capacity(LLAMA_8B, H100, utilization=None, quota_bytes=quota).num_blocks
    assert engine.kv_layout.num_blocks < sim().kv_layout.num_blocks


def test_tensor_parallel_splits_heads_and_weights() -> None:
    tp2 = SimEngine(SimEngineConfig(spec=get_model_preset("llama-3-70b"), gpu=H100, tp=2, time_scale=0.0))
    assert tp2.kv_layout.num_kv_heads == 4
    assert tp2.kv_layout.num_blocks == plan_capacity(get_model_preset("llama-3-70b"), H100, tp=2).num_blocks
    assert tp2.device_name == "sim:h100-80gx2"


@pytest.mark.parametrize(("kw", "match"), [
    ({"tp": 3}, "does not divide"),
    ({"time_scale": -1.0}, "time-scale"),
    ({"memory_utilization": 0.2}, "does not fit"),
    ({"memory_utilization": 1.5}, "utilization"),
    ({"num_blocks": 0}, "num-blocks"),
])
def test_bad_configurations_say_what_to_fix(kw: dict[str, object], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        sim(**kw)


def test_a_pool_smaller_than_one_block_is_refused() -> None:
    # An overhead that leaves 1 MiB of the budget: less than one block of 16 × 128 KiB.
    overhead = int(H100.memory_bytes * 0.9) - LLAMA_8B.weight_bytes - (1 << 20)
    with pytest.raises(ConfigError, match="holds no block"):
        sim(overhead_bytes=overhead)


def test_70b_does_not_fit_one_h100() -> None:
    with pytest.raises(ConfigError, match="raise tensor parallelism"):
        SimEngine(SimEngineConfig(spec=get_model_preset("llama-3-70b"), gpu=H100))


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0
        self.sleeps: list[float] = []

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        self.now += seconds


def test_back_to_back_steps_chain_on_the_modeled_clock() -> None:
    timing = TimingModel(LLAMA_8B, H100)
    clock = FakeClock()
    step = SimModelStep(timing, (0, LLAMA_8B.vocab_size), time_scale=2.0, clock=clock, sleep=clock.sleep)
    cost = timing.decode_step(1, 100).seconds
    engine = sim()
    engine.add_request(rid(), list(range(100)), SamplingParams(max_tokens=5, ignore_eos=True))
    work = engine.scheduler.schedule()
    assert work
    from pdrouter.engine.batch_engine import StepWork

    item = [StepWork(work[0].request, [1], 100, [0] * 7, True)]
    step.run(item)
    assert clock.sleeps == [pytest.approx(2 * cost)]
    clock.now += 0.001  # the code between two steps: absorbed by the next step's sleep
    step.run(item)
    assert clock.sleeps[1] == pytest.approx(2 * cost - 0.001)
    clock.now += 10 * cost  # slower than the model: the step is late and does not sleep
    step.run(item)
    assert len(clock.sleeps) == 2 and step.stats().late_steps == 1
    # 8 modeled steps' worth of wall time late at scale 2: 4 steps of simulated time lost.
    assert step.stats().late_s == pytest.approx(4 * cost)
    step.idle()
    clock.now += 5.0  # after idling the next step starts now
    step.run(item)
    assert clock.sleeps[2] == pytest.approx(2 * cost)
    assert step.stats().steps == 4 and step.stats().busy_s == pytest.approx(4 * cost)
    engine.abort(work[0].request.request_id)


def test_time_scale_zero_never_sleeps() -> None:
    clock = FakeClock()
    step = SimModelStep(TimingModel(LLAMA_8B, H100), (0, LLAMA_8B.vocab_size), time_scale=0.0, clock=clock,
                        sleep=clock.sleep)
    engine = sim()
    engine.model_step = step
    assert engine.generate([list(range(16))], SamplingParams(max_tokens=16, ignore_eos=True)) != []
    assert clock.sleeps == [] and step.stats().steps == 16


def test_tokens_are_deterministic_inside_the_vocabulary() -> None:
    greedy = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    seeded = SamplingParams(max_tokens=20, temperature=1.0, seed=7, ignore_eos=True)
    a, b = sim(), sim()
    prompt = list(range(1000, 1040))
    first = a.generate([prompt, prompt], greedy)
    assert first[0] == first[1] == b.generate([prompt], greedy)[0]
    assert a.generate([prompt], seeded) == b.generate([prompt], seeded) != [first[0]]
    assert all(0 <= t < LLAMA_8B.vocab_size for t in first[0]) and len(set(first[0])) > 15
    assert a.generate([list(range(2000, 2040))], greedy) != first[:1]
    assert_no_leak(a)


def test_stop_ids_and_max_tokens_are_honoured() -> None:
    engine = sim()
    prompt = list(range(50))
    (tokens,) = engine.generate([prompt], SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True))
    assert len(tokens) == 10
    stop = SamplingParams(max_tokens=10, temperature=0.0, stop_token_ids=(tokens[3],))
    r = rid()
    engine.add_request(r, prompt, stop)
    outs = [o for _ in range(20) for o in engine.step()]
    assert [t for o in outs for t in o.new_token_ids] == tokens[:4]
    assert outs[-1].finish_reason is FinishReason.STOP
    assert_no_leak(engine)


def test_a_prefix_hit_cuts_the_prefill_by_what_the_model_says() -> None:
    engine = sim(scheduling=SchedulingConfig(max_num_batched_tokens=8192))
    timing = engine.timing
    one = SamplingParams(max_tokens=1, temperature=0.0)
    shared = list(range(2048))
    engine.generate([[*shared, *range(3000, 5048)]], one)
    before = engine.sim_stats().busy_s
    engine.generate([[*shared, *range(6000, 8048)]], one)
    spent = engine.sim_stats().busy_s - before
    assert spent == pytest.approx(timing.step([SeqWork(2048, 2048, True)]).seconds)
    cold = timing.prefill(4096).seconds
    assert spent == pytest.approx(timing.prefill(4096, cached=2048).seconds) and spent < cold
    assert engine.stats().num_cached_blocks > 0


def test_a_calibration_file_changes_the_figures(tmp_path: Path) -> None:
    path = tmp_path / "cal.json"
    path.write_text(json.dumps({"mbu": 1.0, "step_overhead_s": 0.0}))
    fast = sim(calibration=Calibration.from_file(path))
    assert fast.timing.decode_step(1, 16).seconds < sim().timing.decode_step(1, 16).seconds


def test_the_simulated_engine_never_imports_torch() -> None:
    code = ("import sys\n"
            "from pdrouter.core.gpu import get_gpu_preset\n"
            "from pdrouter.core.model_spec import get_model_preset\n"
            "from pdrouter.core.sampling import SamplingParams\n"
            "from pdrouter.engine.sim.config import SimEngineConfig\n"
            "from pdrouter.engine.sim.engine import SimEngine\n"
            "e = SimEngine(SimEngineConfig(spec=get_model_preset('llama-3-8b'), gpu=get_gpu_preset('h100'), "
            "time_scale=0))\n"
            "e.generate([[1, 2, 3]], SamplingParams(max_tokens=4))\n"
            "assert 'torch' not in sys.modules and 'numpy' not in sys.modules, sorted(sys.modules)\n")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def _run(engine: SimEngine, prompt: list[int], salt: bytes) -> tuple[int, float]:
    """Cached prompt tokens and modeled seconds of one request of ``prompt`` under ``salt``."""
    before = engine.sim_stats().busy_s
    request = rid()
    engine.add_request(request, prompt, SamplingParams(max_tokens=1, temperature=0.0), cache_salt=salt)
    cached = -1
    while engine.has_unfinished_requests():
        for out in engine.step():
            cached = out.num_cached_tokens
    return cached, engine.sim_stats().busy_s - before


def test_a_cache_salt_keeps_prefixes_apart_and_one_salt_shares_them() -> None:
    engine = sim(scheduling=SchedulingConfig(max_num_batched_tokens=8192))
    prompt = list(range(4096))
    cold, cold_s = _run(engine, prompt, b"tenant-a")
    other, other_s = _run(engine, prompt, b"tenant-b")  # another salt: nothing of it is cached
    plain, _ = _run(engine, prompt, b"")  # nor for unsalted prompts
    same, same_s = _run(engine, prompt, b"tenant-a")  # the same salt hits
    assert (cold, other, plain) == (0, 0, 0)
    assert same == 4096 - 16  # every full block but the last (its last token is computed again)
    assert other_s == pytest.approx(cold_s) and same_s < cold_s / 10
    assert engine.cached_prefix_tokens(prompt, b"tenant-b") == 4096
    assert engine.cached_prefix_tokens(prompt, b"tenant-c") == 0
    with pytest.raises(InvalidRequestError, match="cache_salt must be bytes"):
        engine.add_request(rid(), prompt, SamplingParams(max_tokens=1), cache_salt="text")  # type: ignore[arg-type]
    assert_no_leak(engine)


def test_a_packed_prompt_stays_packed_through_prefix_hits_and_decode() -> None:
    """The simulated step needs counts, not ids: a prompt that came packed (the worker protocol's
    bytes) is hashed from its bytes and never unpacked, and answers as its ids would."""
    engine, plain = sim(), sim()
    greedy = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    shared = list(range(1000, 1100))
    for tail in (range(5000, 5037), range(6000, 6050)):
        ids = [*shared, *tail]
        packed = PackedPrompt(pack_token_ids(ids), max(ids))
        assert engine.generate([packed], greedy) == plain.generate([ids], greedy)
        assert packed._ids is None
    assert engine.stats().num_cached_blocks == plain.stats().num_cached_blocks > 0
    assert_no_leak(engine)
