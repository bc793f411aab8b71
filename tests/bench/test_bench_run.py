"""``pdrouter bench run`` against a real cluster of simulated workers (router, Redis, prefill, decode processes)."""

from __future__ import annotations

import itertools
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from pdrouter.bench.arrivals import ks_exponential
from pdrouter.cli.local_cluster import ManagedProcess, worker_args
from pdrouter.core.capacity import blocks_for_tokens
from pdrouter.core.gpu import get_gpu_preset
from pdrouter.core.model_spec import get_model_preset
from pdrouter.engine.model_folder import write_config_folder
from pdrouter.engine.sim.timing import TimingModel
from pdrouter.state.embedded_redis import EmbeddedRedis

MODEL = "llama-3-8b"


def bench(*args: str, timeout: float = 120.0, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "pdrouter", "bench", "run", "--no-progress", *args],
                          capture_output=True, text=True, timeout=timeout,
                          env=None if env is None else {**os.environ, **env})


def document(out: Path) -> dict[str, Any]:
    (path,) = out.glob("*.json")
    assert (path.with_suffix(".md")).is_file()
    return dict(json.loads(path.read_text()))


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory, redis_server: EmbeddedRedis) -> Iterator[str]:
    """A router over one prefill and one decode simulated H100 (Llama-3-8B, real time): its /v1 URL.

    The router books every request alone (``--admission-credit 0``), so the bookings in Redis are
    exactly the requests' blocks."""
    import redis

    client = redis.Redis.from_url(redis_server.url)
    client.flushall()
    client.close()
    folder = write_config_folder(get_model_preset(MODEL), tmp_path_factory.mktemp("models") / MODEL)
    sim = ["--gpu", "h100", "--time-scale", "1", "--utilization", "0.3"]
    procs = [ManagedProcess(role, worker_args(role, folder, redis_url=redis_server.url, sim=sim,
                                              extra=("--worker-id", f"{role}-0")))
             for role in ("prefill", "decode")]
    try:
        for p in procs:
            p.wait_ready()
        router = ManagedProcess("router", ["router", "--model", str(folder), "--redis", redis_server.url,
                                           "--http-port", "0", "--grpc-port", "0", "--log-level", "WARNING",
                                           "--admission-credit", "0"])
        procs.append(router)
        address = router.wait_ready()
        yield f"http://{address}/v1"
    finally:
        for p in reversed(procs):
            p.stop()


def test_a_poisson_run_sends_every_request_at_poisson_gaps(cluster: str, tmp_path: Path) -> None:
    rate, n = 25.0, 120
    done = bench("--url", cluster, "--rate", str(rate), "--num-requests", str(n), "--input-len", "64",
                 "--output-len", "8", "--out", str(tmp_path), "--seed", "3", "--slo", "ttft=2s")
    assert done.returncode == 0, done.stderr
    doc = document(tmp_path)
    records = doc["requests"]
    assert isinstance(records, list) and len(records) == n
    assert all(r["status"] == 200 and r["output_tokens"] == 8 for r in records)
    starts = sorted(r["start_s"] for r in records)
    gaps = [b - a for a, b in itertools.pairwise(starts)]
    _, p_value = ks_exponential(gaps, rate)
    assert p_value > 0.01, p_value
    summary = doc["summary"]
    assert isinstance(summary, dict) and summary["completed"] == n and summary["slo_met"] == n
    # This machine's CPU over the measured window; the server's processes are not known to `bench run`.
    host = doc["host"]
    assert host["cpus"] >= 1 and 0 < host["busy_share"] <= 1 and host["processes"] == {}
    assert "This machine (" in (tmp_path / next(tmp_path.glob("*.json")).with_suffix(".md").name).read_text()
    assert "request_throughput:" in done.stdout and "goodput:" in done.stdout
    assert "host_cpus_busy: " in done.stdout and "host_bound: " in done.stdout
    assert host["load_generator_wait"]["cpus"] >= 0 and "host_load_generator_cpu_delay: " in done.stdout
    # The router's own TTFT over the window, from its histogram: as many requests, no slower than the client saw.
    router_ttft = doc["steady"]["router_ttft"]
    window = doc["steady"]["summary"]["ttft"]
    assert router_ttft["count"] >= 0.8 * window["count"], (router_ttft, window)
    assert 0 < router_ttft["p50_s"] <= 2 * window["p50"] + 0.01, (router_ttft, window)
    assert "window_router_ttft_p50: " in done.stdout
    w = doc["steady"]["window"]
    assert f"window_lifetimes: {w['lifetimes']:.3g} x" in done.stdout
    assert w["lifetimes"] == pytest.approx(w["length_s"] / w["lifetime_s"])
    assert doc["client"]["waited_for_a_connection"] == 0 and doc["client"]["peak_in_flight"] >= 1


def test_tpot_and_itl_are_the_modeled_decode_steps(cluster: str, tmp_path: Path) -> None:
    """One request at a time: every token is one modeled decode step of batch 1 (6.7 ms)."""
    done = bench("--url", cluster, "--concurrency", "1", "--num-requests", "4", "--input-len", "100",
                 "--output-len", "40", "--out", str(tmp_path), "--json")
    assert done.returncode == 0, done.stderr
    summary = json.loads(done.stdout)["summary"]
    step = TimingModel(get_model_preset(MODEL), get_gpu_preset("h100")).decode_step(1, 120).seconds
    assert summary["tpot"]["mean"] == pytest.approx(step, rel=0.1)
    assert summary["itl"]["p50"] == pytest.approx(step, rel=0.1)
    for r in document(tmp_path)["requests"]:
        assert r["tpot_s"] == pytest.approx((r["e2e_s"] - r["ttft_s"]) / (r["output_tokens"] - 1))
        # one gap per streamed chunk after the first, as vllm bench serve counts them; a router that
        # fell behind sends the tokens already waiting as one chunk, so there may be fewer gaps than tokens
        assert 0 < len(r["itl_s"]) <= r["output_tokens"] - 1


def test_the_scraped_water_level_is_the_admission_bookings(cluster: str, tmp_path: Path) -> None:
    concurrency, prompt, out = 6, 1000, 300
    done = bench("--url", cluster, "--concurrency", str(concurrency), "--num-requests", str(concurrency),
                 "--input-len", str(prompt), "--output-len", str(out), "--out", str(tmp_path), "--json")
    assert done.returncode == 0, done.stderr
    doc = document(tmp_path)
    samples = doc["metrics_samples"]
    assert isinstance(samples, list) and samples
    booked = max(sum(s["reserved_blocks"].values()) for s in samples)
    assert booked == concurrency * blocks_for_tokens(prompt + out)
    (capacity,) = {c for s in samples for c in s["capacity_blocks"].values()}
    router = doc["router"]
    assert isinstance(router, dict)
    assert max(router["kv_water_level_peak"].values()) == pytest.approx(booked / capacity)


@pytest.mark.parametrize(("args", "expected"), [
    (["--slo", "ttft=fast"], "--slo"),
    (["--slo", "latency=1s"], "--slo"),
    (["--rate", "-3"], "--rate"),
    (["--input-len", "0"], "--input-len"),
    (["--workload", "jsonl", "--dataset", "/nonexistent/requests.jsonl"], "requests.jsonl"),
    (["--url", "localhost:8000"], "--url"),
])
def test_bad_arguments_are_one_line_errors(args: list[str], expected: str, tmp_path: Path) -> None:
    done = bench("--model", "m", "--out", str(tmp_path), *args)
    assert done.returncode == 2
    assert expected in done.stderr and done.stderr.strip().count("\n") == 0, done.stderr


def test_an_unreachable_endpoint_ends_with_a_summary_and_exit_1(tmp_path: Path) -> None:
    started = time.monotonic()
    done = bench("--url", "http://127.0.0.1:9/v1", "--model", "m", "--num-requests", "5", "--out", str(tmp_path),
                 "--no-metrics")
    assert done.returncode == 1
    assert "no request completed" in done.stderr and "connect" in done.stderr
    assert document(tmp_path)["summary"]["failed"] == 5
    assert time.monotonic() - started < 60


def test_ctrl_c_writes_what_was_measured(cluster: str, tmp_path: Path) -> None:
    proc = subprocess.Popen([sys.executable, "-m", "pdrouter", "bench", "run", "--no-progress", "--url", cluster,
                             "--concurrency", "2", "--num-requests", "1000", "--input-len", "32",
                             "--output-len", "64", "--out", str(tmp_path)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    time.sleep(4.0)
    proc.send_signal(signal.SIGINT)
    stdout, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 130, stderr
    doc = document(tmp_path)
    assert doc["interrupted"] is True
    summary = doc["summary"]
    assert isinstance(summary, dict) and 0 < summary["completed"] < 1000
    assert "results:" in stdout


def sweep_points(stdout: str) -> list[dict[str, Any]]:
    points = json.loads(Path(json.loads(stdout)["file"]).read_text())["points"]
    assert isinstance(points, list)
    return points


def digests(points: list[dict[str, Any]]) -> list[str]:
    return [r["prompt_digest"] for p in points for r in json.loads(Path(p["file"]).read_text())["requests"]]


def test_a_sweep_sends_fresh_prompts_at_every_rate_to_a_server_that_stays_up(cluster: str, tmp_path: Path) -> None:
    """The cluster stays up across the rates, so a prompt sent twice would be a prefix-cache hit."""
    done = subprocess.run([sys.executable, "-m", "pdrouter", "bench", "sweep", "--no-progress", "--url", cluster,
                           "--num-requests", "30", "--input-len", "256", "--output-len", "8", "--seed", "11",
                           "--rates", "5,10,20", "--json", "--out", str(tmp_path)], capture_output=True, text=True,
                          timeout=180)
    assert done.returncode == 0, done.stderr
    points = sweep_points(done.stdout)
    assert [p["rate"] for p in points] == [5.0, 10.0, 20.0]
    assert all(p["run_summary"]["completed"] == 30 for p in points)
    sent = digests(points)
    assert len(sent) == 90 and len(set(sent)) == 90
    for p in points:
        assert p["prefix"] == {"expected_hit_rate": 0.0, "measured_hit_rate": 0.0, "flagged": False}
        assert p["router"]["prefix_hit_rate"] == 0.0  # the router's index found nothing either
        assert not p["window"]["steady"]  # 30 requests leave fewer than 50 in the window: marked


def test_a_search_steps_with_prompts_of_their_own_and_finds_the_slo_edge(cluster: str, tmp_path: Path) -> None:
    base = ["--url", cluster, "--num-requests", "20", "--input-len", "64", "--output-len", "8", "--json",
            "--seed", "12"]
    # TPOT is one modeled decode step (6.7 ms): a 20 ms bound holds at any low rate, 5 ms never does.
    for bound, met in (("20ms", True), ("5ms", False)):
        done = subprocess.run([sys.executable, "-m", "pdrouter", "bench", "sweep", "--no-progress", *base,
                               "--search", "--slo", f"tpot={bound}", "--min-rate", "1", "--max-rate", "8",
                               "--steps", "2", "--out", str(tmp_path / bound)], capture_output=True, text=True,
                              timeout=120)
        assert done.returncode == 0, done.stderr
        result = json.loads(done.stdout)
        assert (result["best_rate"] is not None) is met and result["points"] == 2
        sent = digests(sweep_points(done.stdout))
        assert len(sent) == 40 and len(set(sent)) == 40


def test_a_time_scale_stretches_arrivals_and_shrinks_latencies(cluster: str, tmp_path: Path) -> None:
    """Against workers at time scale 1, ``--time-scale 2`` sends at half the wall rate and reports
    halved latencies: the document's arrivals are Poisson at the nominal (simulated) rate."""
    rate = 20.0
    done = bench("--url", cluster, "--rate", str(rate), "--num-requests", "80", "--input-len", "64",
                 "--output-len", "8", "--out", str(tmp_path), "--seed", "5", "--time-scale", "2", "--json")
    assert done.returncode == 0, done.stderr
    records = document(tmp_path)["requests"]
    starts = sorted(r["start_s"] for r in records)
    _, p_value = ks_exponential([b - a for a, b in itertools.pairwise(starts)], rate)
    assert p_value > 0.01, p_value
    step = TimingModel(get_model_preset(MODEL), get_gpu_preset("h100")).decode_step(1, 68).seconds
    summary = json.loads(done.stdout)["summary"]
    assert summary["tpot"]["p50"] == pytest.approx(step / 2, rel=0.15)


def test_a_run_too_short_for_a_steady_window_is_marked(cluster: str, tmp_path: Path) -> None:
    done = bench("--url", cluster, "--rate", "20", "--num-requests", "20", "--input-len", "64", "--output-len", "8",
                 "--out", str(tmp_path), "--seed", "13", "--slo", "ttft=1s")
    assert done.returncode == 0, done.stderr
    assert "steady_state: no" in done.stdout
    doc = document(tmp_path)
    window = doc["steady"]["window"]
    assert not window["steady"] and "fewer than 50" in window["reason"]
    text = next(tmp_path.glob("*.md")).read_text()
    assert "**too short** to reach steady state" in text and "SLO: ttft <= 1000 ms" in text


def test_max_completion_tokens_bounds_a_completion(cluster: str) -> None:
    import httpx

    body = {"model": MODEL, "prompt": [65] * 40, "max_completion_tokens": 5, "ignore_eos": True}
    reply = httpx.post(f"{cluster}/completions", json=body, timeout=60)
    assert reply.status_code == 200, reply.text
    assert reply.json()["usage"]["completion_tokens"] == 5


@pytest.fixture(scope="module")
def keyed_router(cluster: str, redis_server: EmbeddedRedis, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A second router over the same workers that asks for an API key."""
    folder = write_config_folder(get_model_preset(MODEL), tmp_path_factory.mktemp("keyed") / MODEL)
    router = ManagedProcess("router", ["router", "--model", str(folder), "--redis", redis_server.url,
                                       "--http-port", "0", "--grpc-port", "0", "--log-level", "WARNING"],
                            env={"PDROUTER_API_KEYS": "k-" + "z" * 30})
    try:
        yield f"http://{router.wait_ready()}/v1"
    finally:
        router.stop()


def test_a_missing_key_is_named_as_such_not_as_a_bad_url(keyed_router: str, tmp_path: Path) -> None:
    done = bench("--url", keyed_router, "--num-requests", "2", "--out", str(tmp_path), env={"OPENAI_API_KEY": ""})
    assert done.returncode == 2
    assert "wants an API key: give --api-key or set OPENAI_API_KEY" in done.stderr and "check --url" not in done.stderr
    done = bench("--url", keyed_router, "--model", MODEL, "--num-requests", "2", "--out", str(tmp_path),
                 env={"OPENAI_API_KEY": ""})
    assert done.returncode == 1
    assert "http_401" in done.stderr and "--api-key" in done.stderr and "check --url" not in done.stderr
    done = bench("--url", keyed_router, "--num-requests", "2", "--input-len", "8", "--output-len", "2", "--out",
                 str(tmp_path / "ok"), env={"OPENAI_API_KEY": "k-" + "z" * 30})
    assert done.returncode == 0, done.stderr


def test_a_prompt_the_server_refuses_carries_its_reason(cluster: str, tmp_path: Path) -> None:
    done = bench("--url", cluster, "--num-requests", "2", "--input-len", "9000", "--output-len", "2",
                 "--out", str(tmp_path))
    assert done.returncode == 1
    assert "http_400: " in done.stderr and "9000" in done.stderr and "context" in done.stderr, done.stderr
    records = document(tmp_path)["requests"]
    assert all("9000" in r["detail"] for r in records)
